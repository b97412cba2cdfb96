-- fixed_window: p1 limit, p2 window. State: w (window index), c (count).
local function fixed_window(op, key, s, cost, now, limit, w)
  if op == 'check' then
    local k = idiv(now, w)
    if k > s.w then
      s.w, s.c = k, 0
    else
      k = s.w -- time went backwards: keep counting in the stored window
    end
    local until_end = math.max((k + 1) * w - now, 0)
    if s.c + cost <= limit then
      s.c = s.c + cost
      local reset = 0
      if s.c > 0 then reset = until_end end
      return 1, limit, limit - s.c, reset, -1, 0
    end
    return 0, limit, limit - s.c, until_end, until_end, 0
  elseif op == 'load' then
    local v = redis.call('HMGET', key, 'w', 'c')
    return { w = (v[1] or 0) + 0, c = (v[2] or 0) + 0 }
  elseif op == 'idle_at' then
    if s.c == 0 then return 0 end
    return (s.w + 1) * w
  elseif op == 'save' then
    redis.call('HSET', key, 'w', s.w, 'c', s.c)
  elseif op == 'refund' then
    if idiv(now, w) == s.w then s.c = math.max(s.c - cost, 0) end
  end
end
