-- Decides on one fixed-window check: single.lua's job for the fixed
-- window, written out in line. The state is fixed_window.lua's integer;
-- a check of cost > 0 adds its cost with one INCRBY and looks afterwards
-- (a denial takes it back with DECRBY before the script ends), so that
-- the common request, admitted in a running window, costs TIME and
-- INCRBY. Every value is as fixed_window('check') would give it. The cost
-- goes to INCRBY and DECRBY as the string it came as: a Lua number would
-- be printed back to text (printf's %.17g) on every call.
-- KEYS[1]: the state key.
-- ARGV: limit, window (µs), cost, then (only the test build reads it) a
--       time in µs to decide at instead of the server's clock.
-- The reply, as single.lua's.
local key = KEYS[1]
local limit, w, cost = ARGV[1] + 0, ARGV[2] + 0, ARGV[3] + 0
local now
local ttl_slack_ms = 0
if ALLOW_TIME_OVERRIDE and ARGV[4] then
  now = ARGV[4] + 0
  ttl_slack_ms = 60000
else
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
local k = idiv(now, w)
local v
if cost > 0 then
  v = redis.call('INCRBY', key, ARGV[3])
else
  v = redis.call('GET', key)
  v = v and v + 0
end
-- The stored window: this one, one ahead (the clock was set back), or
-- none that counts.
local stored, count = -1, 0
if v then
  local tag = math.floor(v / 8589934592)
  local ahead = (tag - (k - idiv(k, 1048575) * 1048575 + 1)) % 1048575
  if tag > 0 and ahead < 524288 then
    stored, count = k + ahead, v - tag * 8589934592
  end
end
if stored >= k then
  local until_end = (stored + 1) * w - now
  -- Cost 0 only looks: allowed even over the limit (in debt).
  if cost == 0 or count <= limit then
    local reset = until_end
    if count == 0 then reset = 0 end
    return { 1, now, 1, limit, math.max(limit - count, 0), reset, reset, -1, 0 }
  end
  redis.call('DECRBY', key, ARGV[3])
  return { 0, now, 0, limit, limit - (count - cost), until_end, until_end, until_end, 0 }
end
-- A new window. A peek writes nothing; a charge fits (the store refuses a
-- cost above the limit).
local until_end = (k + 1) * w - now
if cost == 0 then
  return { 1, now, 1, limit, limit, 0, 0, -1, 0 }
end
redis.call('SET', key, (k - idiv(k, 1048575) * 1048575 + 1) * 8589934592 + cost, 'PX',
  cdiv(until_end, 1000) + ttl_slack_ms)
return { 1, now, 1, limit, limit - cost, until_end, until_end, -1, 0 }
