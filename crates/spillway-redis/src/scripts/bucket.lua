-- token_bucket and leaky_bucket share one exact virtual-scheduling step.
-- p1 capacity, p2 unit, p3 per, p4 mode, p5 undelayed: one unit of cost is
-- worth unit/per microseconds. State: m (whole microseconds) and f
-- (remainder, in 1/per µs) of the time the bucket is full / the queue has
-- drained. mode: 0 token bucket, 1 leaky shape, 2 leaky police.
local function bucket(op, key, s, cost, now, capacity, unit, per, mode, undelayed)
  if op == 'check' then
    -- The backlog in 1/per µs: (m - now) * per + f when the stamp is ahead.
    local backlog = 0
    if s.m > now or (s.m == now and s.f > 0) then
      backlog = (s.m - now) * per + s.f
    end
    local tolerance = capacity * unit
    local after = backlog + cost * unit

    -- Cost 0 only looks: allowed even when a clock set back leaves more
    -- backlog than the capacity.
    if cost == 0 or after <= tolerance then
      if cost > 0 then
        s.m = now + idiv(after, per)
        s.f = after - idiv(after, per) * per
      end
      local delay = 0
      if mode == 1 and cost > 0 then
        delay = cdiv(math.max(backlog - undelayed * unit, 0), per)
      end
      -- One more unit fits once the backlog leaves room for left + 1.
      local left = idiv(math.max(tolerance - after, 0), unit)
      local refill = 0
      if left < capacity then
        refill = cdiv(math.max(after + (left + 1) * unit - tolerance, 0), per)
      end
      return 1, capacity, left, cdiv(after, per), refill, -1, delay
    end
    local fits_at = backlog - (tolerance - cost * unit)
    local left = idiv(math.max(tolerance - backlog, 0), unit)
    local refill = 0
    if left < capacity then
      refill = cdiv(math.max(backlog + (left + 1) * unit - tolerance, 0), per)
    end
    return 0, capacity, left, cdiv(backlog, per), refill, cdiv(fits_at, per), 0
  elseif op == 'load' then
    local v = redis.call('HMGET', key, 'm', 'f')
    return { m = (v[1] or 0) + 0, f = (v[2] or 0) + 0 }
  elseif op == 'idle_at' then
    if s.f > 0 then return s.m + 1 end
    return s.m
  elseif op == 'save' then
    redis.call('HSET', key, 'm', s.m, 'f', s.f)
    redis.call('PEXPIRE', key, cost) -- `cost` is the time to live, in ms
  elseif op == 'refund' then
    local back = cost * unit
    local whole = idiv(back, per)
    s.m = s.m - whole
    s.f = s.f - (back - whole * per)
    if s.f < 0 then
      s.f = s.f + per
      s.m = s.m - 1
    end
    if s.m < 0 then s.m, s.f = 0, 0 end
  elseif op == 'settle' then
    -- The charge of `cost` at s.charged_at, whose decision's reset_after
    -- was s.charged_reset, now s.actual. It held the backlog until
    -- e = s.charged_at + s.charged_reset.
    -- Worked relative to `now` (an absolute time in 1/per µs can pass 2^53).
    local e = s.charged_at + s.charged_reset
    if s.actual < cost then
      -- The charge's tail still in the backlog at `now`, none after e.
      if e <= now then return end
      local back = math.min((cost - s.actual) * unit, (e - now) * per)
      local whole = idiv(back, per)
      s.m = s.m - whole
      s.f = s.f - (back - whole * per)
      if s.f < 0 then
        s.f = s.f + per
        s.m = s.m - 1
      end
      if s.m < 0 then s.m, s.f = 0, 0 end
    elseif s.actual > cost then
      -- As if charged at e, less what refill has paid back by `now`; the
      -- overrun counts for two capacities at most, and the backlog after
      -- it is at most two capacities' (or what it was, if more).
      local extra = math.min(s.actual - cost, 2 * capacity) * unit
      local paid = 0
      if now > e then paid = (now - e) * per end
      if paid >= extra then return end
      local backlog = 0
      if s.m > now or (s.m == now and s.f > 0) then
        backlog = (s.m - now) * per + s.f
      end
      local room = math.max(2 * capacity * unit - backlog, 0)
      local after = backlog + math.min(extra - paid, room)
      s.m = now + idiv(after, per)
      s.f = after - idiv(after, per) * per
    end
  end
end
