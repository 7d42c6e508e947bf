-- Claim an idempotency key: take it if it is free (or its lease or answer has lapsed), otherwise
-- say who has it. The take is SET-if-absent with an expiry, decided inside this one script so that
-- the lapse check, the fingerprint comparison and the take cannot interleave with another claim.
--
-- KEYS[1]  the key (hash: fp, token, expires, and once complete: status, headers, body)
-- ARGV     now ('' = server TIME), fingerprint, token, lease seconds
-- returns  {'claimed'} | {'mismatch'} | {'in_progress'} | {'replay', status, headers, body}

local key = KEYS[1]
local now = clock_now(ARGV[1])
local fingerprint, token, lease = ARGV[2], ARGV[3], tonumber(ARGV[4])

local held = redis.call('HMGET', key, 'fp', 'expires', 'status', 'headers', 'body')
if held[1] and tonumber(held[2]) <= now then
  redis.call('DEL', key)
  held = {false}
end
if not held[1] then
  redis.call('HSET', key, 'fp', fingerprint, 'token', token, 'expires', fmt(now + lease))
  redis.call('PEXPIRE', key, ms(lease))
  return {'claimed'}
end
if held[1] ~= fingerprint then
  return {'mismatch'}
end
if not held[3] then
  return {'in_progress'}
end
return {'replay', held[3], held[4], held[5]}
