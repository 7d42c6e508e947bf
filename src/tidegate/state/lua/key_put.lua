-- Write one virtual API key if it is at the expected revision, append its audit record, move the
-- change counter on and announce the change, in one atomic step.
--
-- KEYS[1]  every key's record (hash: id -> JSON)
-- KEYS[2]  every key's revision (hash: id -> integer)
-- KEYS[3]  the audit log of every key, newest first (capped list of JSON records)
-- KEYS[4]  the audit log of this key, newest first (capped list)
-- KEYS[5]  the change counter
-- ARGV     now ('' = server TIME), id, expected revision, record (JSON), action, who, why,
--          detail (JSON), cap, change channel, notice
-- returns  {'ok', at} or {'conflict', current revision}

local now = clock_now(ARGV[1])
local id = ARGV[2]
local current = tonumber(redis.call('HGET', KEYS[2], id) or '0')
if current ~= tonumber(ARGV[3]) then
  return {'conflict', tostring(current)}
end
redis.call('HSET', KEYS[1], id, ARGV[4])
redis.call('HSET', KEYS[2], id, current + 1)
redis.call('INCR', KEYS[5])
local record = cjson.encode({
  key_id = id, action = ARGV[5], who = ARGV[6], why = ARGV[7], at = fmt(now), detail = ARGV[8],
})
local cap = tonumber(ARGV[9])
for _, log in ipairs({KEYS[3], KEYS[4]}) do
  redis.call('LPUSH', log, record)
  redis.call('LTRIM', log, 0, cap - 1)
end
redis.call('PUBLISH', ARGV[10], ARGV[11])
return {'ok', fmt(now)}
