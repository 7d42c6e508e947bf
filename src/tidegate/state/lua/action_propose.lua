-- Record a proposed action awaiting a decision until now + ttl; kept for `keep` seconds after that
-- so that its outcome can still be read.
--
-- KEYS[1]  the action (hash)
-- ARGV     now ('' = server TIME), kind, payload (JSON), proposed_by, ttl seconds, keep seconds
-- returns  {created_at, expires_at}

local now = clock_now(ARGV[1])
local ttl, keep = tonumber(ARGV[5]), tonumber(ARGV[6])
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('action id already exists')
end
redis.call('HSET', KEYS[1], 'kind', ARGV[2], 'payload', ARGV[3], 'status', 'pending',
  'proposed_by', ARGV[4], 'created_at', fmt(now), 'expires_at', fmt(now + ttl))
redis.call('PEXPIRE', KEYS[1], ms(ttl + keep))
return {fmt(now), fmt(now + ttl)}
