-- Helpers shared by every tidegate script; the loader puts this text in front of each one.
--
-- Time: a script reads "now" (Unix seconds) from the Redis server's own clock (TIME), so that every
-- replica decides against one clock however far their own clocks drift. Tests may pass an explicit
-- now instead; an empty string means "use TIME".
--
-- Numbers go back to the client as strings written with 17 significant digits: Redis would truncate
-- a Lua number to an integer, and 17 digits make a double survive the round trip exactly.

local function clock_now(arg)
  if arg ~= nil and arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function fmt(x)
  return string.format('%.17g', x)
end

-- Milliseconds for PEXPIRE, as an integer string: at least 1 (0 or less would delete the key) and
-- at most about 31,000 years (Redis refuses what does not fit, and writes 1e17 for a large double).
local function ms(seconds)
  local millis = math.ceil(seconds * 1000)
  if millis < 1 then
    millis = 1
  elseif not (millis <= 1e15) then
    millis = 1e15
  end
  return string.format('%d', millis)
end

-- The gap from |x| to the next larger double, as Python's math.ulp.
local function ulp(x)
  x = math.abs(x)
  local tiny = 4.9406564584124654e-324
  if x == 0 then
    return tiny
  end
  local _, e = math.frexp(x)
  local step = math.ldexp(1, e - 53)
  if step == 0 then
    return tiny
  end
  return step
end

-- Python's float floor division x // y, step for step (CPython's float_floor_div), so a day number
-- near midnight rounds the way the Python policy code rounds it.
local function floordiv(x, y)
  local mod = math.fmod(x, y)
  local div = (x - mod) / y
  if mod ~= 0 and ((y < 0) ~= (mod < 0)) then
    div = div - 1
  end
  if div == 0 then
    return 0
  end
  local floored = math.floor(div)
  if div - floored > 0.5 then
    floored = floored + 1
  end
  return floored
end

local DAY_SECONDS = 86400

local function day_number(wall)
  return floordiv(wall, DAY_SECONDS)
end

local function seconds_until_midnight(wall)
  return (day_number(wall) + 1) * DAY_SECONDS - wall
end

