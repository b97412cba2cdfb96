-- sliding_log: p1 limit, p2 window. State, in one hash: t (total cost),
-- h (sequence number of the oldest entry), n (the next sequence number),
-- and one field per entry, "e<seq>" = "<timestamp>:<cost>". Entries are
-- read lazily: a check that expires nothing reads only the header and the
-- newest entry.
-- `current`: for a refund only, the time now (`now` is then the charge's).
local function sliding_log(op, key, s, cost, now, limit, w, current)
  -- An integer as text, for the strings this algorithm builds itself. Lua's
  -- own number-to-string conversion keeps 14 significant digits, which
  -- would round a timestamp in microseconds (16 digits). A number passed
  -- straight to redis.call needs no such care: Redis converts it exactly
  -- (`%.17g`, or its integer printer when the number is whole).
  local function int(x)
    return string.format('%.0f', x)
  end

  -- Entry `seq`'s time and cost, read with the next ones (up to BATCH in
  -- one HMGET), or (`back`, for the walks from the newest end: a refund's
  -- and a settle's) with the ones before it. Kept in two tables of
  -- numbers (s.at, s.c), not a table per entry: a walk of thousands of
  -- entries would spend its time in Lua's allocator and collector.
  local BATCH = 64
  local function log_entry(s, seq, back)
    local at = s.at[seq]
    if not at then
      local first, last = seq, math.min(seq + BATCH - 1, s.n - 1)
      if back then first, last = math.max(seq - BATCH + 1, s.h), seq end
      local fields = {}
      for q = first, last do fields[#fields + 1] = 'e' .. int(q) end
      local values = redis.call('HMGET', s.key, unpack(fields))
      for j = 1, #fields do
        local q = first + j - 1
        if not s.at[q] then
          local a, c = string.match(values[j] or '', '^(%d+):(%d+)$')
          if a then
            s.at[q], s.c[q] = a + 0, c + 0
          elseif q == seq then
            error('spillway: corrupt sliding log entry ' .. int(seq) .. ' in ' .. s.key)
          end
        end
      end
      at = s.at[seq]
    end
    return at, s.c[seq]
  end

  if op == 'load' then
    local v = redis.call('HMGET', key, 't', 'h', 'n')
    return { key = key, t = (v[1] or 0) + 0, h = (v[2] or 0) + 0, n = (v[3] or 0) + 0,
             at = {}, c = {}, dropped = {}, dirty = {} }
  elseif op == 'save' then
    -- The dropped entries, a thousand fields per HDEL.
    local dropped = s.dropped
    for first = 1, #dropped, 1000 do
      local fields = {}
      for j = first, math.min(first + 999, #dropped) do
        fields[#fields + 1] = 'e' .. int(dropped[j])
      end
      redis.call('HDEL', key, unpack(fields))
    end
    for seq in pairs(s.dirty) do
      redis.call('HSET', key, 'e' .. int(seq), int(s.at[seq]) .. ':' .. int(s.c[seq]))
    end
    redis.call('HSET', key, 't', s.t, 'h', s.h, 'n', s.n)
    redis.call('PEXPIRE', key, cost) -- `cost` is the time to live, in ms
  elseif op == 'check' then
    -- Drop the entries that left the window (now - w, now].
    while s.h < s.n do
      local at, c = log_entry(s, s.h)
      if at + w > now then break end
      s.t = s.t - c
      table.insert(s.dropped, s.h)
      s.dirty[s.h] = nil
      s.h = s.h + 1
    end
    local function reset_after()
      if s.h == s.n then return 0 end
      return math.max(log_entry(s, s.n - 1) + w - now, 0)
    end
    -- Cost 0 only looks: allowed even over the limit (in debt).
    if cost == 0 or s.t + cost <= limit then
      if cost > 0 then
        if s.h < s.n and log_entry(s, s.n - 1) >= now then
          -- Same microsecond, or time went backwards: charge the newest
          -- entry, which expires no earlier than `now` would.
          s.c[s.n - 1] = s.c[s.n - 1] + cost
          s.dirty[s.n - 1] = true
        else
          s.at[s.n], s.c[s.n] = now, cost
          s.dirty[s.n] = true
          s.n = s.n + 1
        end
        s.t = s.t + cost
      end
      return 1, limit, math.max(limit - s.t, 0), reset_after(),
        sliding_log('refill', key, s, 0, now, limit, w), -1, 0
    end
    return 0, limit, limit - s.t, reset_after(), sliding_log('refill', key, s, 0, now, limit, w),
      sliding_log('fits', key, s, cost, now, limit, w), 0
  elseif op == 'refill' then
    -- Until one more unit fits than remain; 0 when the quota is whole.
    if s.t <= 0 then return 0 end
    return sliding_log('fits', key, s, math.max(limit - s.t, 0) + 1, now, limit, w)
  elseif op == 'fits' then
    -- Until `cost` fits: until enough of the oldest entries have left.
    local left = s.t
    if left + cost <= limit then return 0 end
    for seq = s.h, s.n - 1 do
      local at, c = log_entry(s, seq)
      left = left - c
      if left + cost <= limit then return math.max(at + w - now, 0) end
    end
    return 0
  elseif op == 'dirty' then
    -- Whether a check dropped entries that a save should delete, though
    -- it charged nothing: a denial or a peek saves them, so that the next
    -- check does not walk them again.
    return #s.dropped > 0
  elseif op == 'idle_at' then
    if s.h == s.n then return 0 end
    return log_entry(s, s.n - 1) + w
  elseif op == 'refund' then
    -- `now` is the time of the charge. A charge that left the window
    -- counts no more: nothing to give back (and the entries left are
    -- other requests'). Else it is in the entry stamped with it, or (if
    -- time went backwards when it was made) in the oldest later one.
    if current and now + w <= current then return end
    local at, found = now, nil
    for seq = s.n - 1, s.h, -1 do
      if log_entry(s, seq, true) == at then found = seq break end
    end
    if not found then
      for seq = s.h, s.n - 1 do
        if log_entry(s, seq) > at then found = seq break end
      end
    end
    if not found then return end
    local _, c = log_entry(s, found)
    local taken = math.min(cost, c)
    s.c[found] = c - taken
    s.t = s.t - taken
    s.dirty[found] = true
    -- An emptied entry stays as a zero-cost placeholder unless it is the
    -- oldest or newest, so sequence numbers stay contiguous.
    while s.h < s.n and select(2, log_entry(s, s.h)) == 0 do
      table.insert(s.dropped, s.h)
      s.dirty[s.h] = nil
      s.h = s.h + 1
    end
    while s.h < s.n and select(2, log_entry(s, s.n - 1)) == 0 do
      s.n = s.n - 1
      table.insert(s.dropped, s.n)
      s.dirty[s.n] = nil
    end
  elseif op == 'settle' then
    -- After a peek at `now` (which dropped what left the window): the
    -- charge of `cost` at s.charged_at, now s.actual. It is in the entry
    -- stamped s.charged_at, and no other; gone from the window, a give-back changes
    -- nothing and an overrun was served now. One quota owed at most.
    local found = nil
    for seq = s.n - 1, s.h, -1 do
      if log_entry(s, seq, true) == s.charged_at then found = seq break end
    end
    if s.actual < cost then
      if found then
        sliding_log('refund', key, s, cost - s.actual, s.charged_at, limit, w)
      end
    elseif s.actual > cost then
      local total = math.min(s.t + (s.actual - cost), math.max(s.t, 2 * limit))
      local extra = total - s.t
      if extra == 0 then return end
      s.t = total
      if not found and s.h < s.n and log_entry(s, s.n - 1) >= now then found = s.n - 1 end
      if found then
        s.c[found] = s.c[found] + extra
        s.dirty[found] = true
      else
        s.at[s.n], s.c[s.n] = now, extra
        s.dirty[s.n] = true
        s.n = s.n + 1
      end
    end
  end
end
