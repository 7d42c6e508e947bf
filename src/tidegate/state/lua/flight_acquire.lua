-- One step of a cross-replica single flight: the finished result if there is one, else the lead
-- if nobody holds it, else "wait".
--
-- KEYS[1]  the result (string, kept briefly after a flight lands)
-- KEYS[2]  the lead (string: the leader's token, with a lease)
-- ARGV     token, lease milliseconds
-- returns  {'done', result} | {'lead'} | {'wait'}

local result = redis.call('GET', KEYS[1])
if result then
  return {'done', result}
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {'lead'}
end
return {'wait'}
