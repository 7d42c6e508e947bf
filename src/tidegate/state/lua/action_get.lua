-- Read an action and the deciding clock's now (an undecided action past its expiry has expired).
--
-- KEYS[1]  the action (hash, as in action_propose.lua)
-- ARGV     now ('' = server TIME)
-- returns  {now, the action's fields...}; just {now} when there is no such action

local reply = {fmt(clock_now(ARGV[1]))}
for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do
  table.insert(reply, v)
end
return reply
