-- calendar_window: a fixed window over calendar periods (days, weeks or
-- months in a time zone). p1 limit; p2 k0, the index of the period before
-- the caller's; p3, p4, p5 the first instants (µs) of periods k0 + 1,
-- k0 + 2 and k0 + 3, which the caller works out from the zone's rules (Lua
-- has none). Whatever the server's clock says within a period of the
-- caller's, its period and that period's end are among them. State and
-- storage as fixed_window's (fixed_window.lua): w the period's index, c
-- the count, one integer string, tag x 2^33 + c. The decision repeats
-- fixed_window's rather than share it through closures, which would cost
-- the fixed window's script (the cheapest and most used) an allocation a
-- call.

-- The period that holds `t`, and when it ends.
local function calendar_period(t, k0, b1, b2, b3)
  if t < b1 then return k0, b1 end
  if t < b2 then return k0 + 1, b2 end
  if t < b3 then return k0 + 2, b3 end
  -- Past what the caller knew (a clock a whole period ahead of it): a
  -- period as long as the last.
  return k0 + 3, b3 + (b3 - b2)
end

-- When period `k` ends, as far as the caller knew.
local function calendar_end(k, k0, b1, b2, b3)
  if k <= k0 then return b1 end
  if k == k0 + 1 then return b2 end
  if k == k0 + 2 then return b3 end
  return b3 + (k - k0 - 2) * (b3 - b2)
end

local function calendar_window(op, key, s, cost, now, limit, k0, b1, b2, b3)
  if op == 'check' then
    local k, e = calendar_period(now, k0, b1, b2, b3)
    if k > s.w then
      s.w, s.c = k, 0
    else
      k = s.w -- time went backwards: keep counting in the stored period
      e = calendar_end(k, k0, b1, b2, b3)
    end
    local until_end = math.max(e - now, 0)
    -- Cost 0 only looks: allowed even over the limit (in debt).
    if cost == 0 or s.c + cost <= limit then
      s.c = s.c + cost
      local reset = 0
      if s.c > 0 then reset = until_end end
      return 1, limit, math.max(limit - s.c, 0), reset, reset, -1, 0
    end
    return 0, limit, limit - s.c, until_end, until_end, until_end, 0
  elseif op == 'load' then
    local v = redis.call('GET', key)
    if v then
      v = v + 0
      local k = calendar_period(now, k0, b1, b2, b3)
      local tag = math.floor(v / 8589934592)
      local ahead = (tag - (k - idiv(k, 1048575) * 1048575 + 1)) % 1048575
      if tag > 0 and ahead < 524288 then
        return { w = k + ahead, c = v - tag * 8589934592 }
      end
    end
    return { w = -1, c = 0 } -- no count, or an earlier period's
  elseif op == 'idle_at' then
    if s.c == 0 then return 0 end
    return calendar_end(s.w, k0, b1, b2, b3)
  elseif op == 'save' then
    -- `cost` is the time to live, in ms.
    local tag = s.w - idiv(s.w, 1048575) * 1048575 + 1
    redis.call('SET', key, tag * 8589934592 + s.c, 'PX', cost)
  elseif op == 'refund' then
    if calendar_period(now, k0, b1, b2, b3) == s.w then s.c = math.max(s.c - cost, 0) end
  elseif op == 'settle' then
    -- As fixed_window's: a give-back moves the charge's period, if it is
    -- still the stored one; an overrun counts in the stored period.
    if s.actual < cost then
      if calendar_period(s.charged_at, k0, b1, b2, b3) == s.w then
        s.c = math.max(s.c - (cost - s.actual), 0)
      end
    elseif s.actual > cost then
      local most = math.max(s.c, math.min(2 * limit, 8589934591 - limit))
      s.c = math.min(s.c + (s.actual - cost), most)
    end
  end
end
