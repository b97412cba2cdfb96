-- fixed_window: p = { limit, window }. State: w (window index), c (count).
local function fixed_window()
  return {
    load = function(key)
      local v = redis.call('HMGET', key, 'w', 'c')
      return { w = num(v[1]) or 0, c = num(v[2]) or 0 }
    end,
    save = function(key, s)
      redis.call('HSET', key, 'w', s.w, 'c', s.c)
    end,
    check = function(s, p, cost, now)
      local limit, w = p[1], p[2]
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
        return decision(true, limit, limit - s.c, reset)
      end
      return decision(false, limit, limit - s.c, until_end, until_end)
    end,
    idle_at = function(s, p)
      if s.c == 0 then return 0 end
      return (s.w + 1) * p[2]
    end,
    refund = function(s, p, cost, at)
      if idiv(at, p[2]) == s.w then s.c = math.max(s.c - cost, 0) end
    end,
  }
end
