-- Give up a claim held by this token so that a retry may run; a completed key is kept.
--
-- KEYS[1]  the key (hash, as in idempotency_claim.lua)
-- ARGV     token
-- returns  1 if the claim was released, 0 if it was not this token's to release

local held = redis.call('HMGET', KEYS[1], 'token', 'status')
if held[1] ~= ARGV[1] or held[2] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
