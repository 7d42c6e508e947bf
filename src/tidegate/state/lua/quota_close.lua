-- Close an open reservation once: settle it at the actual amounts, or refund it; or rebase it:
-- settle it and hold a smaller amount under the same reservation, which stays open.
-- The arithmetic is tidegate.policy.budget.settle / refund / rebase, operation for operation.
--
-- KEYS[1]  the subject's usage (hash, as in quota_reserve.lua)
-- KEYS[2]  the reservation (deleting it is what makes closing happen once)
-- ARGV     now ('' = server TIME), 'settle', 'refund' or 'rebase', the reservation's day,
--          reserved calls, tokens, cost, actual calls, tokens, cost,
--          and for 'rebase' the calls, tokens, cost kept
-- returns  1 if this call closed (or rebased) the reservation, 0 if it was not open

local mode = ARGV[2]
if mode == 'rebase' then
  if redis.call('EXISTS', KEYS[2]) == 0 then
    return 0
  end
elseif redis.call('DEL', KEYS[2]) == 0 then
  return 0
end

local now = clock_now(ARGV[1])
local settle = mode ~= 'refund'
local keep = {0, 0, 0}
if mode == 'rebase' then
  keep = {tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])}
end
local reservation_day = tonumber(ARGV[3])
local amount = {tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])}
local actual = {tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])}

local today = day_number(now)
local u = redis.call('HMGET', KEYS[1], 'day', 'calls', 'tokens', 'cost', 'rcalls', 'rtokens', 'rcost')
local day, used, reserved = today, {0, 0, 0}, {0, 0, 0}
if u[1] and tonumber(u[1]) >= today then
  day = tonumber(u[1])
  used = {tonumber(u[2]), tonumber(u[3]), tonumber(u[4])}
  reserved = {tonumber(u[5]), tonumber(u[6]), tonumber(u[7])}
end

-- A past day's reservation closes against that day only, which is over: nothing changes.
if reservation_day == day then
  for i = 1, 3 do
    reserved[i] = math.max(0, reserved[i] - amount[i]) + keep[i]
    if settle then
      used[i] = used[i] + actual[i]
    end
  end
end

redis.call('HSET', KEYS[1], 'day', fmt(day), 'calls', fmt(used[1]), 'tokens', fmt(used[2]),
  'cost', fmt(used[3]), 'rcalls', fmt(reserved[1]), 'rtokens', fmt(reserved[2]),
  'rcost', fmt(reserved[3]))
redis.call('PEXPIRE', KEYS[1], ms(seconds_until_midnight(now) + DAY_SECONDS))
return 1
