-- Approve or reject a pending action exactly once: only while it is pending and unexpired.
--
-- KEYS[1]  the action (hash, as in action_propose.lua)
-- ARGV     now ('' = server TIME), new status, who
-- returns  {'decided' | 'missing' | 'already' | 'expired', now, the action's fields...}

local now = clock_now(ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'missing', fmt(now)}
end
local held = redis.call('HMGET', KEYS[1], 'status', 'expires_at')
local outcome = 'decided'
if held[1] ~= 'pending' then
  outcome = 'already'
elseif tonumber(held[2]) <= now then
  outcome = 'expired'
else
  redis.call('HSET', KEYS[1], 'status', ARGV[2], 'decided_by', ARGV[3], 'decided_at', fmt(now))
end
local reply = {outcome, fmt(now)}
for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do
  table.insert(reply, v)
end
return reply
