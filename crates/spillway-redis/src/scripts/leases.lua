-- leases: a concurrency rule's leases. p1 the slots, p2 the lease (µs).
-- State: one sorted set per key, one member per slot held, scored by the
-- time its lease ends; a lease named `id` that holds `c` slots is the
-- members "id", "id.2", ..., "id.c". A lease's name is its first end: the
-- end it was taken with, after every lease then held. A lease released
-- before its end is remembered in a second sorted set in the same slot
-- (`key:rel`, name scored by the end it had), so that a renew that raced
-- its release does not take it back before then. A lease is held while now < its
-- score. A renew raises the scores of a lease's members (ZADD XX GT: sent
-- twice, it does what it did once), a release removes them: the name never
-- changes. Reads go to the set as it stands; what a check takes is kept in
-- the state (`s.adds`) until 'save' writes it, so that nothing is written
-- unless every check of the request admits. Every command here is
-- O(log n) in the leases of the key, but for the expired members 'save'
-- drops, each once.
local function leases(op, key, s, cost, now, limit, lease)
  -- An integer as text: Lua's own conversion keeps 14 significant digits,
  -- which would round a time in microseconds (16 digits).
  local function int(x)
    return string.format('%.0f', x)
  end
  -- Slot j (from 1) of lease `id`.
  local function member(id, j)
    if j == 1 then return int(id) end
    return int(id) .. '.' .. int(j)
  end
  -- The slots held at `now`, those this check takes included.
  local function held()
    if not s.held then
      s.held = redis.call('ZCOUNT', key, '(' .. int(now), '+inf')
    end
    local taken = 0
    for _, a in ipairs(s.adds) do taken = taken + a.c end
    return s.held + taken
  end
  -- When the last lease ends; nil when none is held.
  local function last_end()
    local last = nil
    local v = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if v[2] and v[2] + 0 > now then last = v[2] + 0 end
    for _, a in ipairs(s.adds) do
      if not last or a.ends > last then last = a.ends end
    end
    return last
  end
  -- When the n-th slot (from 1) to come back comes back, if nobody
  -- releases. A lease taken by this check ends after every other; one
  -- taken back by a renew (of `now + lease`) is counted last too, which
  -- only a denial would read, and a renew that takes back never denies.
  local function nth_end(n)
    held()
    if n > s.held then return s.adds[#s.adds].ends end
    local v = redis.call('ZRANGEBYSCORE', key, '(' .. int(now), '+inf', 'WITHSCORES',
      'LIMIT', n - 1, 1)
    return v[2] + 0
  end
  -- Until `c` slots fit (at most the limit); 0 if they fit now.
  local function fits(c)
    local h = held()
    if h + c <= limit then return 0 end
    return math.max(nth_end(h + c - limit) - now, 0)
  end
  local function reset_after()
    local last = last_end()
    if not last then return 0 end
    return math.max(last - now, 0)
  end
  -- The key's state, nothing taken: the seven numbers of a decision.
  local function standing()
    local remaining = math.max(limit - held(), 0)
    local refill = 0
    if remaining < limit then refill = fits(remaining + 1) end
    return 1, limit, remaining, reset_after(), refill, -1, 0
  end

  if op == 'load' then
    return { adds = {} }
  elseif op == 'check' then
    -- Cost 0 only looks: allowed even over the limit (a limit lowered
    -- while leases were held).
    if cost == 0 then return standing() end
    if held() + cost <= limit then
      -- It ends at now + lease, or a microsecond after the last lease if
      -- that one ends then or later: it is the last to end, and that end
      -- is its name, unique on the key; the decision names it
      -- (at + reset_after).
      local id = now + lease
      local last = last_end()
      if last then id = math.max(id, last + 1) end
      table.insert(s.adds, { id = id, ends = id, c = cost })
      return standing()
    end
    local remaining = math.max(limit - held(), 0)
    local refill = 0
    if remaining < limit then refill = fits(remaining + 1) end
    return 0, limit, remaining, reset_after(), refill, fits(cost), 0
  elseif op == 'save' then
    -- Ended leases go; the new ones come in. `cost` is the time to live
    -- (ms).
    redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
    for _, a in ipairs(s.adds) do
      for j = 1, a.c do redis.call('ZADD', key, a.ends, member(a.id, j)) end
    end
    redis.call('PEXPIRE', key, cost)
  elseif op == 'dirty' then
    -- Ended members are dropped by the next save, and never counted.
    return false
  elseif op == 'idle_at' then
    return last_end() or 0
  elseif op == 'refund' then
    -- The lease s.lease_id names (the caller read it off its decision),
    -- or, unnamed (0), the last taken: the greatest name from `now +
    -- lease` on (`now` is the time of the charge; a lease taken earlier is
    -- named less, and ends no earlier than its name).
    local name = s.lease_id
    if not name or name == 0 then
      local v = redis.call('ZRANGEBYSCORE', key, int(now + lease), '+inf')
      -- Names drawn by their holders (from 2^52) were taken by renews.
      for _, m in ipairs(v) do
        local id = string.match(m, '^(%d+)') + 0
        if id >= now + lease and id < 4503599627370496
            and (not name or name == 0 or id > name) then
          name = id
        end
      end
      if not name or name == 0 then return end
    end
    for j = 1, cost do redis.call('ZREM', key, member(name, j)) end
  elseif op == 'renew' then
    -- The lease named s.lease_id (-1: none yet, as for a request let in
    -- while Redis was away): if held, it runs until now + lease, never
    -- less; 1. If it was released and would not have ended yet, -1 (its
    -- end in s.released). Else 0, and if its slots fit, it is taken afresh
    -- under its name (in s.adds, for 'save').
    if s.lease_id < 0 or cost == 0 then return 0 end
    local ends = redis.call('ZSCORE', key, member(s.lease_id, 1))
    if ends and ends + 0 > now then
      for j = 1, cost do
        redis.call('ZADD', key, 'XX', 'GT', now + lease, member(s.lease_id, j))
      end
      return 1
    end
    local released = redis.call('ZSCORE', key .. ':rel', int(s.lease_id))
    if released and released + 0 > now then
      s.released = released + 0
      return -1
    end
    if held() + cost <= limit then
      table.insert(s.adds, { id = s.lease_id, ends = now + lease, c = cost })
    end
    return 0
  elseif op == 'settle' then
    -- The charge of `cost` whose decision was made at s.charged_at with
    -- s.charged_reset: its lease, if still held, keeps at most s.actual
    -- slots (a lease is given back, never grown). A charge that took no
    -- lease (reset 0) names none.
    if s.charged_reset == 0 or s.actual >= cost then return end
    local id = s.charged_at + s.charged_reset
    local ends = redis.call('ZSCORE', key, member(id, 1))
    if not (ends and ends + 0 > now) then return end
    for j = s.actual + 1, cost do redis.call('ZREM', key, member(id, j)) end
    if s.actual == 0 then
      -- Released: remembered until the end it had, and a margin (the
      -- lease, 10 s at most: a token issued at its last renew expires on
      -- its server's clock), 1024 at most (spillway::algorithm::
      -- concurrency::{RELEASE_MARGIN, MAX_RELEASED}).
      local rel = key .. ':rel'
      local untl = ends + math.min(lease, 10000000)
      redis.call('ZREMRANGEBYSCORE', rel, '-inf', int(now))
      redis.call('ZADD', rel, untl, int(id))
      if redis.call('ZCARD', rel) > 1024 then redis.call('ZPOPMIN', rel) end
      local ms = cdiv(untl - now, 1000)
      -- Under a test's virtual clock, past the test's steps (as the
      -- driver's TTLs).
      if ALLOW_TIME_OVERRIDE then ms = ms + 60000 end
      if redis.call('PTTL', rel) < ms then redis.call('PEXPIRE', rel, ms) end
    end
  elseif op == 'released' then
    -- The answer to a renew of a lease released before s.released: denied
    -- until then at least.
    local remaining = math.max(limit - held(), 0)
    local refill = 0
    if remaining < limit then refill = fits(remaining + 1) end
    return 0, limit, remaining, reset_after(), refill,
      math.max(s.released - now, fits(cost)), 0
  end
end
