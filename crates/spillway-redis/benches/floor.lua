-- The floor of an exact fixed window on Redis, for the bench only (never
-- loaded by the store): the least work a script can do that reads the
-- server's clock (TIME, as the store must) and never charges a denied
-- request (so it reads before it writes). The state is one string,
-- "window:count", written with its expiry in the same SET. No multi-check
-- bookkeeping, no other algorithm, no reply beyond the decision.
-- KEYS[1]: the key. ARGV: limit, window (µs), cost.
local limit, window, cost = ARGV[1] + 0, ARGV[2] + 0, ARGV[3] + 0
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local k = math.floor(now / window)
local count = 0
local v = redis.call('GET', KEYS[1])
if v then
  local sep = string.find(v, ':', 1, true)
  if string.sub(v, 1, sep - 1) + 0 == k then count = string.sub(v, sep + 1) + 0 end
end
local until_end = (k + 1) * window - now
if count + cost > limit then
  return { 0, limit - count, until_end }
end
count = count + cost
redis.call('SET', KEYS[1], k .. ':' .. count, 'PX', math.ceil(until_end / 1000))
return { 1, limit - count, until_end }
