-- Read today's usage of one subject (a past day's counts as empty); writes nothing.
--
-- KEYS[1]  the subject's usage (hash, as in quota_reserve.lua)
-- ARGV     now ('' = server TIME)
-- returns  {day, calls, tokens, cost, reserved calls, reserved tokens, reserved cost}

local now = clock_now(ARGV[1])
local today = day_number(now)
local u = redis.call('HMGET', KEYS[1], 'day', 'calls', 'tokens', 'cost', 'rcalls', 'rtokens', 'rcost')
if u[1] and tonumber(u[1]) >= today then
  return {u[1], u[2], u[3], u[4], u[5], u[6], u[7]}
end
return {fmt(today), '0', '0', '0', '0', '0', '0'}
