-- fixed_window: p1 limit, p2 window. State: w (window index), c (count).
--
-- Stored as one integer string, tag x 2^33 + c, so that a lone check
-- (fixed_window_single.lua, which reads and writes this same integer) can
-- add its cost with one INCRBY and look afterwards. The tag names the
-- window: its index mod 2^20 - 1, plus one, so a missing key (INCRBY
-- makes it `cost`, tag 0) never passes for a window. A count fits in 33
-- bits: it is at most the limit (a u32) before a charge, plus a cost of at
-- most the limit; the whole stays below 2^53, exact in Lua. A key outlives
-- its window by less than a millisecond of expiry rounding, so its tag is
-- this window's, an earlier one's, or (after the clock was set back) one
-- ahead: up to 2^19 windows ahead are read as ahead. (2^33 = 8589934592,
-- 2^20 - 1 = 1048575, 2^19 = 524288: constants in line, since every
-- upvalue costs each call.)
local function fixed_window(op, key, s, cost, now, limit, w)
  if op == 'check' then
    local k = idiv(now, w)
    if k > s.w then
      s.w, s.c = k, 0
    else
      k = s.w -- time went backwards: keep counting in the stored window
    end
    local until_end = math.max((k + 1) * w - now, 0)
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
      local k = idiv(now, w)
      local tag = math.floor(v / 8589934592)
      local ahead = (tag - (k - idiv(k, 1048575) * 1048575 + 1)) % 1048575
      if tag > 0 and ahead < 524288 then
        return { w = k + ahead, c = v - tag * 8589934592 }
      end
    end
    return { w = -1, c = 0 } -- no count, or an earlier window's
  elseif op == 'idle_at' then
    if s.c == 0 then return 0 end
    return (s.w + 1) * w
  elseif op == 'save' then
    -- `cost` is the time to live, in ms.
    local tag = s.w - idiv(s.w, 1048575) * 1048575 + 1
    redis.call('SET', key, tag * 8589934592 + s.c, 'PX', cost)
  elseif op == 'refund' then
    if idiv(now, w) == s.w then s.c = math.max(s.c - cost, 0) end
  elseif op == 'settle' then
    -- After a peek at `now` (which rolled an ended window over): the
    -- charge of `cost` at s.charged_at, now s.actual (see driver.lua). A give-back
    -- moves the charge's window, if it is still the stored one; an overrun
    -- counts in the stored window, owing one quota at most, and leaving
    -- room in 33 bits for a check's cost.
    if s.actual < cost then
      if idiv(s.charged_at, w) == s.w then s.c = math.max(s.c - (cost - s.actual), 0) end
    elseif s.actual > cost then
      local most = math.max(s.c, math.min(2 * limit, 8589934591 - limit))
      s.c = math.min(s.c + (s.actual - cost), most)
    end
  end
end
