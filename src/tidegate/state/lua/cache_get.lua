-- Read an entry: a fresh one always, a stale one only when asked for.
--
-- KEYS[1]  the entry (hash, as in cache_put.lua)
-- ARGV     now ('' = server TIME), allow_stale ('1' or '0')
-- returns  nil | {value, stored, fresh (1/0)}

local now = clock_now(ARGV[1])
local held = redis.call('HMGET', KEYS[1], 'value', 'stored', 'fresh_until', 'stale_until')
if not held[1] then
  return nil
end
if now >= tonumber(held[4]) then
  redis.call('DEL', KEYS[1])
  return nil
end
local fresh = now < tonumber(held[3])
if not fresh and ARGV[2] ~= '1' then
  return nil
end
return {held[1], held[2], fresh and 1 or 0}
