-- Store the answer under a live claim held by this token, and keep it for ttl seconds.
--
-- KEYS[1]  the key (hash, as in idempotency_claim.lua)
-- ARGV     now ('' = server TIME), token, status, headers (JSON), body, ttl seconds
-- returns  1 if stored, 0 if the claim was lost (another token, already complete, lapsed)

local key = KEYS[1]
local now = clock_now(ARGV[1])
local held = redis.call('HMGET', key, 'token', 'status', 'expires')
if held[1] ~= ARGV[2] or held[2] or tonumber(held[3]) <= now then
  return 0
end
local ttl = tonumber(ARGV[6])
redis.call('HSET', key, 'status', ARGV[3], 'headers', ARGV[4], 'body', ARGV[5],
  'expires', fmt(now + ttl))
redis.call('PEXPIRE', key, ms(ttl))
return 1
