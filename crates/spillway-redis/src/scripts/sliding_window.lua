-- sliding_window: p1 limit, p2 window. State: w (window index),
-- p (previous window's count), c (current window's count).
local function sliding_window(op, key, s, cost, now, limit, w)
  if op == 'check' then
    local k = idiv(now, w)
    local e = 0
    if k >= s.w then
      if k == s.w + 1 then
        s.w, s.p, s.c = k, s.c, 0
      elseif k > s.w then
        s.w, s.p, s.c = k, 0, 0
      end
      e = now - k * w
    end
    -- Otherwise time went backwards: stay in the stored window with the
    -- previous one at full weight.
    local weighted = s.p * (w - e)
    local allowed, retry_after = 0, -1
    if cost == 0 or weighted + (s.c + cost) * w <= limit * w then
      s.c = s.c + cost
      allowed = 1
    else
      retry_after = sliding_window('fits', key, s, cost, now, limit, w)
    end
    local remaining = idiv(math.max(limit * w - weighted - s.c * w, 0), w)
    local refill = 0
    if remaining < limit then
      refill = sliding_window('fits', key, s, remaining + 1, now, limit, w)
    end
    return allowed, limit, remaining,
      math.max(sliding_window('idle_at', key, s, 0, now, limit, w) - now, 0), refill,
      retry_after, 0
  elseif op == 'fits' then
    -- Until a request of `cost` (more than fits now) fits: in this window
    -- once the previous one's weight has dropped enough, or in the next,
    -- where this window's count decays from full weight.
    local start = s.w * w
    local fits_at = nil
    local room = limit - s.c - cost
    if room >= 0 and s.p > 0 then
      local e_ok = w - idiv(room * w, s.p)
      if e_ok < 0 then e_ok = 0 end
      if e_ok < w then fits_at = start + e_ok end
    end
    if not fits_at then
      local e_next = 0
      if s.c > 0 then e_next = math.max(w - idiv((limit - cost) * w, s.c), 0) end
      fits_at = start + w + e_next
    end
    return math.max(fits_at - now, 0)
  elseif op == 'load' then
    local v = redis.call('HMGET', key, 'w', 'p', 'c')
    return { w = (v[1] or 0) + 0, p = (v[2] or 0) + 0, c = (v[3] or 0) + 0 }
  elseif op == 'idle_at' then
    if s.c > 0 then return (s.w + 2) * w end
    if s.p > 0 then return (s.w + 1) * w end
    return 0
  elseif op == 'save' then
    redis.call('HSET', key, 'w', s.w, 'p', s.p, 'c', s.c)
    redis.call('PEXPIRE', key, cost) -- `cost` is the time to live, in ms
  elseif op == 'refund' then
    local k = idiv(now, w)
    if k == s.w then
      s.c = math.max(s.c - cost, 0)
    elseif k + 1 == s.w then
      s.p = math.max(s.p - cost, 0)
    end
  elseif op == 'settle' then
    -- After a peek at `now` (which rolled the windows): the charge of
    -- `cost` at s.charged_at, now s.actual. Its window is the current one or the
    -- previous one while that still weighs; older, a give-back changes
    -- nothing and an overrun counts now. One quota owed at most.
    local k = idiv(s.charged_at, w)
    local in_prev = k + 1 == s.w
    if s.actual < cost then
      if k == s.w then
        s.c = math.max(s.c - (cost - s.actual), 0)
      elseif in_prev then
        s.p = math.max(s.p - (cost - s.actual), 0)
      end
    elseif s.actual > cost then
      local extra = s.actual - cost
      if in_prev then
        s.p = math.min(s.p + extra, math.max(s.p, 2 * limit))
      else
        s.c = math.min(s.c + extra, math.max(s.c, 2 * limit))
      end
    end
  end
end
