-- Decides on one request: every check at once, nothing written unless all
-- admit; and gives charges back. A request of one check goes to the
-- smaller script.rs makes from single.lua instead.
-- KEYS[i]: the state key of check i.
-- ARGV[1]: the time in µs, or "" to read the server's clock (the store
--          sends "" always; only the test build can send a time).
-- ARGV[2]: "" to decide; or, to give back charges admitted at that time
--          (µs, as this script reported it), the time of the charges. A
--          refund then has one more key, last: its receipt, which makes a
--          refund sent again (after a lost answer) give nothing back twice;
--          and after the checks, one number per check: a concurrency
--          check's lease name, or 0.
--          Or "settle", to settle admitted charges at their actual costs:
--          one more key, last, the settle's receipt; and after the checks,
--          four numbers per check (the charge's time, its decision's
--          reset_after, the actual cost, 1 if the charge is a reservation
--          held open under the settle's id), then the receipt's life in ms
--          and the settle's id.
--          Or "renew", to renew concurrency leases: after the checks, one
--          number per check, its lease's name (-1 for a request that holds
--          none yet).
--          Or "reserve", to decide and hold the charges of the checks that
--          release what is not settled in time open under an id: after the
--          checks, the id.
--          Or "close", to close the reservations held open under an id,
--          leaving their charges as they stand: after the checks, the id.
--          A refund also has, after the lease names, the id its charges were
--          held open under ("" for none): they are closed.
-- then 8 numbers per check: algorithm, p1..p5, cost (for a settle, the
-- cost charged), and how long (µs) a reservation of its rule stays open
-- unsettled before it is given back, 0 if it never is (negative: the rule
-- gives reservations back, but this check's charge is not held).
-- Before a call does anything with a key whose rule gives reservations
-- back, it gives back those whose time has passed (`give_back_due`). A
-- key's open reservations are a sorted set, `KEY:rs` (the id, scored by
-- the time it is given back), and a hash, `KEY:rs:c` (the id: its charge's
-- cost, time and reset_after, as this node took them).
-- The reply: admitted (0/1), the time, then the seven numbers of each
-- check's decision, then how many reservations were given back. A
-- settle's: applied (0/1: 0 if its receipt was there already), the time,
-- then each key's state as it now stands, then how many were given back. A
-- renew's: 1, the time, each lease's decision (admitted: held now), then
-- two numbers per check: whether the lease was still held (0/1), and the
-- time of the renew.
local now
-- Keys expire on the server's real clock. Under a test's virtual clock they
-- must outlive the test's steps instead: an idle state decides like a fresh
-- one, so keeping it longer changes no decision.
local ttl_slack_ms = 0
if ARGV[1] ~= '' and ALLOW_TIME_OVERRIDE then
  now = ARGV[1] + 0
  ttl_slack_ms = 60000
else
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end

local n = #KEYS
-- A refund's or a settle's receipt is the last key; a renew has none.
if ARGV[2] ~= '' and ARGV[2] ~= 'renew' and ARGV[2] ~= 'reserve' and ARGV[2] ~= 'close' then
  n = n - 1
end
-- Where the arguments after the checks begin.
local extra = 2 + 8 * n

-- Overrides (see store/overrides.rs): a check's algorithm sent as "-N"
-- (N its number) reads its key's own override, `KEY:ov`: "N cap until p1
-- p2 p3 p4 p5", the override's parameters (a calendar's p2..p5 are the
-- call's), the most one request may cost under it (0: a limit of 0) and
-- the time (µs) it ends, 0 for never; one made for another algorithm, or
-- past its time, is not in force. "-N/cap/until" carries the override of
-- a prefix the key is under, whose parameters were sent: it holds unless
-- the key has its own.
-- Check i's override in force: { cap, until }.
local overrides = {}

-- Check i's algorithm (by its number, script.rs::params), its cost and its
-- parameters, its override's if it has one: only those the algorithm
-- reads are converted.
local function check_of(i)
  local base = 2 + (i - 1) * 8
  local id = ARGV[base + 1]
  local p1, p2, p3, p4, p5 = ARGV[base + 2], ARGV[base + 3], ARGV[base + 4], ARGV[base + 5],
    ARGV[base + 6]
  if string.byte(id, 1) == 45 then
    local sent, cap, ends = string.match(id, '^%-(%d+)/?(%d*)/?(%d*)$')
    id = sent
    if cap ~= '' then overrides[i] = { cap + 0, ends + 0 } end
    local own = redis.call('GET', KEYS[i] .. ':ov')
    if own then
      local of, c, u, q1, q2, q3, q4, q5 =
        string.match(own, '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
      if of == id and (u == '0' or now < u + 0) then
        overrides[i] = { c + 0, u + 0 }
        p1 = q1
        if id ~= '7' then p2, p3, p4, p5 = q2, q3, q4, q5 end
      end
    end
  end
  if id == '1' then
    return fixed_window, ARGV[base + 7] + 0, p1 + 0, p2 + 0
  elseif id == '4' or id == '5' then
    return bucket, ARGV[base + 7] + 0, p1 + 0, p2 + 0, p3 + 0, p4 + 0, p5 + 0
  elseif id == '3' then
    return sliding_window, ARGV[base + 7] + 0, p1 + 0, p2 + 0
  elseif id == '2' then
    return sliding_log, ARGV[base + 7] + 0, p1 + 0, p2 + 0
  elseif id == '6' then
    return leases, ARGV[base + 7] + 0, p1 + 0, p2 + 0
  elseif id == '7' then
    return calendar_window, ARGV[base + 7] + 0, p1 + 0, p2 + 0, p3 + 0, p4 + 0, p5 + 0
  end
  error('spillway: unknown algorithm ' .. tostring(id))
end

local function save(algo, key, state, p1, p2, p3, p4, p5)
  local idle_at = algo('idle_at', key, state, 0, now, p1, p2, p3, p4, p5)
  if idle_at <= now then
    redis.call('DEL', key)
  else
    algo('save', key, state, cdiv(idle_at - now, 1000) + ttl_slack_ms, now, p1, p2, p3, p4, p5)
  end
end

-- Copies check i's decision (seven numbers) into the reply.
local function put(reply, i, allowed, limit, remaining, reset_after, refill_after, retry_after,
    delay)
  local o = 7 * i - 5
  reply[o + 1], reply[o + 2], reply[o + 3] = allowed, limit, remaining
  reply[o + 4], reply[o + 5], reply[o + 6], reply[o + 7] =
    reset_after, refill_after, retry_after, delay
  return allowed
end

-- The checks an override stopped.
local stops = {}
-- Whether check i's override stops it (a limit of 0, or a cost over what
-- the override takes); if so, puts its decision: denied until the
-- override ends (no retry time if it never does), nothing counted; a look
-- at a limit of 0 admitted with nothing remaining.
local function stopped(reply, i, cost)
  local o = overrides[i]
  if not o or (cost <= o[1] and (cost > 0 or o[1] > 0)) then return false end
  local left = 0
  if o[2] > 0 then left = math.max(o[2] - now, 0) end
  local retry = -1
  if cost > 0 and o[2] > 0 then retry = left end
  local allowed = 0
  if cost == 0 then allowed = 1 end
  put(reply, i, allowed, o[1], 0, left, left, retry, 0)
  stops[i] = true
  return true
end

-- Each check's algorithm, cost, and parameters (five slots per check),
-- and how long its rule holds a reservation open (0: never given back).
local algos, costs, params, holds = {}, {}, {}, {}
for i = 1, n do
  local o = 5 * i
  algos[i], costs[i], params[o + 1], params[o + 2], params[o + 3], params[o + 4], params[o + 5] =
    check_of(i)
  holds[i] = ARGV[2 + i * 8] + 0
end
-- Check i's call of its algorithm.
local function run(i, op, state, cost, at)
  local o = 5 * i
  return algos[i](op, KEYS[i], state, cost, at,
    params[o + 1], params[o + 2], params[o + 3], params[o + 4], params[o + 5])
end
local function save_of(i, state)
  local o = 5 * i
  save(algos[i], KEYS[i], state, params[o + 1], params[o + 2], params[o + 3], params[o + 4],
    params[o + 5])
end

-- How many reservations this call gave back.
local given_back = 0

-- Gives back `ids`, reservations of check i's key: each settled at 0 as
-- of its charge, and closed.
local function give_back(i, ids)
  if #ids == 0 then return end
  local rs = KEYS[i] .. ':rs'
  local charges = redis.call('HMGET', rs .. ':c', unpack(ids))
  local state = run(i, 'load', nil, 0, now)
  run(i, 'check', state, 0, now)
  for j = 1, #ids do
    local c = charges[j]
    if c then
      local cost, at, reset = string.match(c, '^(%d+) (%d+) (%d+)$')
      if cost then
        state.charged_at, state.charged_reset, state.actual = at + 0, reset + 0, 0
        run(i, 'settle', state, cost + 0, now)
      end
    end
  end
  save_of(i, state)
  redis.call('ZREM', rs, unpack(ids))
  redis.call('HDEL', rs .. ':c', unpack(ids))
  given_back = given_back + #ids
end

-- Gives back check i's reservations whose time has passed (a check whose
-- own charge is not held, a negative time, does too).
local function give_back_due(i)
  if holds[i] ~= 0 then
    give_back(i, redis.call('ZRANGEBYSCORE', KEYS[i] .. ':rs', '-inf', now))
  end
end

-- Closes reservation `id` of check i's key: whether it was open.
local function close(i, id)
  local rs = KEYS[i] .. ':rs'
  if redis.call('ZREM', rs, id) == 0 then return false end
  redis.call('HDEL', rs .. ':c', id)
  return true
end

-- Holds check i's charge (admitted now, `reset` its reset_after) open
-- under `id` (the decision saw room for it: see the bound below). Both
-- keys live as long as the reservations, or the state, whichever is
-- longer, and a minute more.
local function hold(i, id, reset)
  local rs = KEYS[i] .. ':rs'
  redis.call('ZADD', rs, now + holds[i], id)
  -- Written with %d: Lua's own number-to-text keeps 14 digits only.
  redis.call('HSET', rs .. ':c', id, string.format('%d %d %d', costs[i], now, reset))
  local keep = math.max(cdiv(holds[i], 1000), redis.call('PTTL', KEYS[i])) + 60000 + ttl_slack_ms
  if redis.call('PTTL', rs) < keep then
    redis.call('PEXPIRE', rs, keep)
    redis.call('PEXPIRE', rs .. ':c', keep)
  end
end

for i = 1, n do give_back_due(i) end

if ARGV[2] == 'close' then
  local id = ARGV[extra + 1]
  local reply = { 1, now }
  for i = 1, n do
    if holds[i] > 0 then close(i, id) end
    put(reply, i, run(i, 'check', run(i, 'load', nil, 0, now), 0, now))
  end
  reply[#reply + 1] = given_back
  return reply
end

if ARGV[2] == 'settle' then
  local applied = 0
  local id = ARGV[extra + 4 * n + 2]
  if redis.call('SET', KEYS[n + 1], 1, 'NX', 'PX', ARGV[extra + 4 * n + 1]) then
    applied = 1
    for i = 1, n do
      local state = run(i, 'load', nil, 0, now)
      -- A peek first rolls the windows and drops what left a log, as a
      -- check at `now` would.
      run(i, 'check', state, 0, now)
      local o = extra + 4 * (i - 1)
      local cost, reset = costs[i], ARGV[o + 2] + 0
      if ARGV[o + 4] == '1' and not close(i, id) then
        -- Given back already (not settled in time): the whole actual
        -- cost is charged, as a charge of nothing at its time, which for
        -- a bucket ends where the given-back one began.
        if algos[i] == bucket then
          local p = 5 * i
          reset = math.max(reset - idiv(cost * params[p + 2], params[p + 3]), 0)
        end
        cost = 0
      end
      state.charged_at, state.charged_reset, state.actual = ARGV[o + 1] + 0, reset, ARGV[o + 3] + 0
      run(i, 'settle', state, cost, now)
      save_of(i, state)
    end
  end
  local reply = { applied, now }
  for i = 1, n do
    put(reply, i, run(i, 'check', run(i, 'load', nil, 0, now), 0, now))
  end
  reply[#reply + 1] = given_back
  return reply
end

if ARGV[2] == 'renew' then
  -- Each lease on its own: one still held runs until a lease from now,
  -- whatever else is in flight (a limit lowered since included); one that
  -- ended is taken afresh under its name if it fits; a request that holds
  -- none yet takes one as a check would.
  local reply, renewed = { 1, now }, {}
  for i = 1, n do
    local state = run(i, 'load', nil, 0, now)
    state.lease_id = ARGV[extra + i] + 0
    local held = run(i, 'renew', state, costs[i], now)
    if held == -1 then
      -- Released before its end: not taken back.
      put(reply, i, run(i, 'released', state, costs[i], now))
      held = 0
    elseif held == 1 or #state.adds > 0 then
      put(reply, i, run(i, 'check', state, 0, now))
    else
      put(reply, i, run(i, 'check', state, costs[i], now))
    end
    save_of(i, state)
    renewed[2 * i - 1], renewed[2 * i] = held, now
  end
  for j = 1, 2 * n do reply[#reply + 1] = renewed[j] end
  return reply
end

if ARGV[2] ~= '' and ARGV[2] ~= 'reserve' and ARGV[2] ~= 'close' then
  -- Refund: another part of the request (on another cluster node) denied.
  local charged_at = ARGV[2] + 0
  -- The receipt outlives every retry of the refund (the store sends its
  -- last within about 8 s); short-lived, so that many refunds cost little.
  if redis.call('SET', KEYS[n + 1], 1, 'NX', 'PX', 10000) then
    -- Charges held open under an id are closed: given back here, unless
    -- they were given back already (their time passed, or the key's
    -- bound pushed them out), which must not happen twice.
    local id = ARGV[extra + n + 1] or ''
    for i = 1, n do
      local gone = id ~= '' and holds[i] > 0 and costs[i] > 0 and not close(i, id)
      if not gone and costs[i] > 0 and redis.call('EXISTS', KEYS[i]) == 1 then
        local state = run(i, 'load', nil, 0, now)
        state.lease_id = (ARGV[extra + i] or 0) + 0
        if algos[i] == sliding_log then
          -- The log also needs the time now, to tell an expired charge.
          local o = 5 * i
          sliding_log('refund', KEYS[i], state, costs[i], charged_at, params[o + 1],
            params[o + 2], now)
        else
          run(i, 'refund', state, costs[i], charged_at)
        end
        save_of(i, state)
      end
    end
  end
  -- Report each key's state as it now stands.
  local reply = { 1, now }
  for i = 1, n do
    put(reply, i, run(i, 'check', run(i, 'load', nil, 0, now), 0, now))
  end
  reply[#reply + 1] = given_back
  return reply
end

local states = {}
local reply = { 1, now }
for i = 1, n do
  local key = KEYS[i]
  if not states[key] then
    states[key] = run(i, 'load', nil, 0, now)
  end
  if stopped(reply, i, costs[i]) then
    if costs[i] > 0 then reply[1] = 0 end
  elseif put(reply, i, run(i, 'check', states[key], costs[i], now)) == 0 then
    reply[1] = 0
  end
end

-- A key holds a bounded number of reservations open: one more is denied
-- until the first of them is settled or given back.
if ARGV[2] == 'reserve' and reply[1] == 1 then
  for i = 1, n do
    local rs = KEYS[i] .. ':rs'
    if holds[i] > 0 and costs[i] > 0 and redis.call('ZCARD', rs) >= MAX_HOLDS_PER_KEY then
      local first = redis.call('ZRANGE', rs, 0, 0, 'WITHSCORES')
      local wait = math.max((first[2] or now) - now, 1)
      local _, limit, remaining, reset, refill = run(i, 'check', run(i, 'load', nil, 0, now), 0, now)
      put(reply, i, 0, limit, remaining, reset, refill, wait, 0)
      reply[1] = 0
    end
  end
end

if reply[1] == 1 then
  local written = {}
  for i = 1, n do
    local key = KEYS[i]
    if not written[key] and (costs[i] > 0 or run(i, 'dirty', states[key], 0, now)) then
      written[key] = true
      save_of(i, states[key])
    end
  end
  if ARGV[2] == 'reserve' then
    local id = ARGV[extra + 1]
    for i = 1, n do
      if holds[i] > 0 and costs[i] > 0 then hold(i, id, reply[7 * i - 1]) end
    end
  end
else
  -- Nothing is charged: the admitting checks (peeks included, which may
  -- have seen a charge of this request) report their state as it stands,
  -- and what a sliding log dropped is saved, from a state read afresh
  -- (the one decided on may hold this request's charge).
  for i = 1, n do
    local admitted = reply[7 * i - 4] == 1 and not stops[i]
    if admitted or algos[i] == sliding_log then
      local fresh = run(i, 'load', nil, 0, now)
      local a, limit, remaining, reset_after, refill_after, retry_after, delay =
        run(i, 'check', fresh, 0, now)
      if admitted then
        put(reply, i, a, limit, remaining, reset_after, refill_after, retry_after, delay)
      end
      if run(i, 'dirty', fresh, 0, now) then save_of(i, fresh) end
    end
  end
end
reply[#reply + 1] = given_back
return reply
