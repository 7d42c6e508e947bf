-- Keep a value fresh for ttl seconds and stale for stale_ttl more; Redis drops it at the stale end.
--
-- KEYS[1]  the entry (hash: value, stored, fresh_until, stale_until)
-- ARGV     now ('' = server TIME), value, ttl seconds, stale_ttl seconds

local now = clock_now(ARGV[1])
local ttl, stale_ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local fresh_until = now + ttl
local stale_until = now + ttl + stale_ttl
if stale_until <= now then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('HSET', KEYS[1], 'value', ARGV[2], 'stored', fmt(now), 'fresh_until', fmt(fresh_until),
  'stale_until', fmt(stale_until))
redis.call('PEXPIRE', KEYS[1], ms(stale_until - now))
return 1
