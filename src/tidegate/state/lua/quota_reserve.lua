-- Reserve an estimate against a daily quota: roll the day over, decide, hold, in one atomic step.
-- The arithmetic is tidegate.policy.budget.reserve, operation for operation.
--
-- KEYS[1]  the subject's usage (hash: day, calls, tokens, cost, rcalls, rtokens, rcost)
-- KEYS[2]  the reservation to open if the estimate is allowed (string: its day)
-- ARGV     now ('' = server TIME), quota calls, tokens, cost ('' = unlimited), degrade_at,
--          estimate calls, tokens, cost
-- returns  {verdict, reason ('' = none), retry_after, day}

local now = clock_now(ARGV[1])
local limits = {ARGV[2], ARGV[3], ARGV[4]}
local degrade_at = tonumber(ARGV[5])
local estimate = {tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])}
local names = {'calls', 'tokens', 'cost'}

local today = day_number(now)
local u = redis.call('HMGET', KEYS[1], 'day', 'calls', 'tokens', 'cost', 'rcalls', 'rtokens', 'rcost')
local day, used, reserved = today, {0, 0, 0}, {0, 0, 0}
if u[1] and tonumber(u[1]) >= today then
  day = tonumber(u[1])
  used = {tonumber(u[2]), tonumber(u[3]), tonumber(u[4])}
  reserved = {tonumber(u[5]), tonumber(u[6]), tonumber(u[7])}
end

local new_reserved = {}
local blocking, hopeless, degrading = nil, nil, nil
for i = 1, 3 do
  new_reserved[i] = reserved[i] + estimate[i]
  if limits[i] ~= '' then
    local limit = tonumber(limits[i])
    local total = used[i] + new_reserved[i]
    if total > limit then
      blocking = blocking or names[i]
      if estimate[i] > limit then
        hopeless = hopeless or names[i]
      end
    elseif total > degrade_at * limit then
      degrading = degrading or names[i]
    end
  end
end

local function store(r)
  redis.call('HSET', KEYS[1], 'day', fmt(day), 'calls', fmt(used[1]), 'tokens', fmt(used[2]),
    'cost', fmt(used[3]), 'rcalls', fmt(r[1]), 'rtokens', fmt(r[2]), 'rcost', fmt(r[3]))
  -- A day's usage matters until its reservations can no longer close: a day after midnight.
  redis.call('PEXPIRE', KEYS[1], ms(seconds_until_midnight(now) + DAY_SECONDS))
end

if blocking then
  store(reserved)
  if hopeless then
    return {'block', hopeless, fmt(math.huge), fmt(day)}
  end
  return {'block', blocking, fmt(seconds_until_midnight(now)), fmt(day)}
end

store(new_reserved)
redis.call('SET', KEYS[2], fmt(day), 'PX', ms(seconds_until_midnight(now) + DAY_SECONDS))
if degrading then
  return {'degrade', degrading, '0', fmt(day)}
end
return {'allow', '', '0', fmt(day)}
