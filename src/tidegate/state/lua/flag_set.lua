-- Change one flag, append its audit record and announce the change, in one atomic step.
--
-- KEYS[1]  every flag's value (hash: name -> JSON)
-- KEYS[2]  the audit log of every flag, newest first (capped list of JSON records)
-- KEYS[3]  the audit log of this flag, newest first (capped list)
-- ARGV     now ('' = server TIME), flag, new value (JSON), who, why, cap, change channel
-- returns  {at, old value (JSON) or ''}, with old '' when the flag was never set

local now = clock_now(ARGV[1])
local flag, new = ARGV[2], ARGV[3]
local cap = tonumber(ARGV[6])
local old = redis.call('HGET', KEYS[1], flag)
redis.call('HSET', KEYS[1], flag, new)
local record = cjson.encode({
  flag = flag, old = old or cjson.null, new = new, who = ARGV[4], why = ARGV[5], at = fmt(now),
})
for _, log in ipairs({KEYS[2], KEYS[3]}) do
  redis.call('LPUSH', log, record)
  redis.call('LTRIM', log, 0, cap - 1)
end
redis.call('PUBLISH', ARGV[7], flag)
return {fmt(now), old or ''}
