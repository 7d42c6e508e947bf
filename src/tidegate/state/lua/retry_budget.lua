-- A retry budget shared by every replica: first tries and granted retries counted per second of the
-- deciding clock, in one hash whose stale seconds are dropped as it is used.
--
-- Over a window of W whole seconds a retry is granted while
--     retries granted in the last W + 1 seconds + 1  <=  ratio * first tries in the last W seconds
--                                                         + floor * W
-- which is tidegate.policy.retry.RetryBudget with one slice per second: rounding favours the
-- provider (a retry counts one second longer than a first try does).
--
-- KEYS[1]  the budget (hash: 'f:<second>' and 'r:<second>' -> count)
-- ARGV     now ('' = server TIME), operation ('first', 'spend' or 'peek'), window W (whole
--          seconds), ratio, floor (retries per second)
-- returns  {granted (1/0), retries still available after this call}

local key = KEYS[1]
local now = clock_now(ARGV[1])
local op = ARGV[2]
local window = tonumber(ARGV[3])
local ratio, floor = tonumber(ARGV[4]), tonumber(ARGV[5])
local second = math.floor(now)

local firsts, spent = 0, 0
local fields = redis.call('HGETALL', key)
for i = 1, #fields, 2 do
  local kind = string.sub(fields[i], 1, 1)
  local at = tonumber(string.sub(fields[i], 3))
  local count = tonumber(fields[i + 1])
  if at < second - window then
    redis.call('HDEL', key, fields[i])
  elseif at <= second then
    if kind == 'r' then
      spent = spent + count
    elseif at > second - window then
      firsts = firsts + count
    end
  end
end

local allowance = ratio * firsts + floor * window
local granted = 0
if op == 'first' then
  redis.call('HINCRBY', key, 'f:' .. fmt(second), 1)
  allowance = allowance + ratio
elseif op == 'spend' and spent + 1 <= allowance then
  redis.call('HINCRBY', key, 'r:' .. fmt(second), 1)
  spent = spent + 1
  granted = 1
end
if op ~= 'peek' then
  redis.call('EXPIRE', key, window + 2)
end
return {granted, fmt(math.max(0, allowance - spent))}
