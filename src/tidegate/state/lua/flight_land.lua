-- End a flight: publish its result for the followers (unless it failed) and give up the lead if
-- this token still holds it.
--
-- KEYS[1]  the result (string)
-- KEYS[2]  the lead (string)
-- ARGV     token, result ('' with no result: the call failed), result milliseconds
-- returns  1 if the lead was still this token's, else 0

if ARGV[3] ~= '0' then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
if redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
  return 1
end
return 0
