-- Take n tokens from one token bucket: read, refill, take, write back, in one atomic step; or,
-- with ARGV[5] = 'give', give n unused tokens back (never past the burst).
-- The arithmetic is tidegate.policy.ratelimit.take / give_back, operation for operation.
--
-- KEYS[1]  the bucket (hash: tokens, updated)
-- ARGV     now ('' = server TIME), rate, burst, n, and optionally 'give'
-- returns  {allowed (1/0), remaining, retry_after, reset_after}; for 'give', {remaining}

local key = KEYS[1]
local now = clock_now(ARGV[1])
local rate = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local n = tonumber(ARGV[4])

local function refill(tokens, updated, at)
  local elapsed = math.max(0, at - updated)
  return math.min(burst, tokens + rate * elapsed)
end

local tokens, updated = burst, now
local held = redis.call('HMGET', key, 'tokens', 'updated')
if held[1] then
  tokens = tonumber(held[1])
  updated = tonumber(held[2])
end

local available = refill(tokens, updated, now)
local new_updated = math.max(updated, now)

if ARGV[5] == 'give' then
  local given = math.min(burst, available + n)
  redis.call('HSET', key, 'tokens', fmt(given), 'updated', fmt(new_updated))
  redis.call('PEXPIRE', key, ms((burst - given) / rate + (new_updated - now) + 1))
  return {fmt(given)}
end
local allowed = available >= n
local new_tokens = available
if allowed then
  new_tokens = available - n
end

local retry_after = 0
if not allowed then
  if n > burst then
    retry_after = math.huge
  else
    -- The division and the addition may each round down: step up one unit in the last place of
    -- the instant until the refill at that instant really holds n tokens.
    retry_after = (n - new_tokens) / rate + (new_updated - now)
    while refill(new_tokens, new_updated, now + retry_after) < n do
      retry_after = retry_after + ulp(now + retry_after)
    end
  end
end
local reset_after = (burst - new_tokens) / rate + (new_updated - now)

redis.call('HSET', key, 'tokens', fmt(new_tokens), 'updated', fmt(new_updated))
-- Once full, a bucket equals a new one: let Redis forget it a second after that.
redis.call('PEXPIRE', key, ms(reset_after + 1))
return {allowed and 1 or 0, fmt(new_tokens), fmt(retry_after), fmt(reset_after)}
