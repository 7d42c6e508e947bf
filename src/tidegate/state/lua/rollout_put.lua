-- Write a rollout state only if its version is still the one the writer read (0: not there yet).
--
-- KEYS[1]  the state (hash: value (JSON), version, updated_at)
-- ARGV     now ('' = server TIME), expected version, value
-- returns  {1, new version, updated_at} on success, {0, current version} on a conflict

local now = clock_now(ARGV[1])
local current = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if current ~= tonumber(ARGV[2]) then
  return {0, current}
end
redis.call('HSET', KEYS[1], 'value', ARGV[3], 'version', current + 1, 'updated_at', fmt(now))
return {1, current + 1, fmt(now)}
