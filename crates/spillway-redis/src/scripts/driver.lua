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
--          three numbers per check (the charge's time, its decision's
--          reset_after, the actual cost), then the receipt's life in ms.
--          Or "renew", to renew concurrency leases: after the checks, one
--          number per check, its lease's name (-1 for a request that holds
--          none yet).
-- then 7 numbers per check: algorithm, p1..p5, cost (for a settle, the
-- cost charged).
-- The reply: admitted (0/1), the time, then the seven numbers of each
-- check's decision. A settle's: applied (0/1: 0 if its receipt was there
-- already), the time, then each key's state as it now stands. A renew's:
-- 1, the time, each lease's decision (admitted: held now), then two numbers
-- per check: whether the lease was still held (0/1), and the time of the
-- renew.
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
if ARGV[2] ~= '' and ARGV[2] ~= 'renew' then n = n - 1 end

-- Check i's algorithm (by its number, script.rs::params), its cost and its
-- parameters: only those the algorithm reads are converted.
local function check_of(i)
  local base = 2 + (i - 1) * 7
  local id = ARGV[base + 1]
  if id == '1' then
    return fixed_window, ARGV[base + 7] + 0, ARGV[base + 2] + 0, ARGV[base + 3] + 0
  elseif id == '4' or id == '5' then
    return bucket, ARGV[base + 7] + 0, ARGV[base + 2] + 0, ARGV[base + 3] + 0,
      ARGV[base + 4] + 0, ARGV[base + 5] + 0, ARGV[base + 6] + 0
  elseif id == '3' then
    return sliding_window, ARGV[base + 7] + 0, ARGV[base + 2] + 0, ARGV[base + 3] + 0
  elseif id == '2' then
    return sliding_log, ARGV[base + 7] + 0, ARGV[base + 2] + 0, ARGV[base + 3] + 0
  elseif id == '6' then
    return leases, ARGV[base + 7] + 0, ARGV[base + 2] + 0, ARGV[base + 3] + 0
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

-- Each check's algorithm, cost, and parameters (five slots per check).
local algos, costs, params = {}, {}, {}
for i = 1, n do
  local o = 5 * i
  algos[i], costs[i], params[o + 1], params[o + 2], params[o + 3], params[o + 4], params[o + 5] =
    check_of(i)
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

if ARGV[2] == 'settle' then
  local applied = 0
  local extra = 2 + 7 * n
  if redis.call('SET', KEYS[n + 1], 1, 'NX', 'PX', ARGV[extra + 3 * n + 1]) then
    applied = 1
    for i = 1, n do
      local state = run(i, 'load', nil, 0, now)
      -- A peek first rolls the windows and drops what left a log, as a
      -- check at `now` would.
      run(i, 'check', state, 0, now)
      local o = extra + 3 * (i - 1)
      state.charged_at, state.charged_reset, state.actual =
        ARGV[o + 1] + 0, ARGV[o + 2] + 0, ARGV[o + 3] + 0
      run(i, 'settle', state, costs[i], now)
      save_of(i, state)
    end
  end
  local reply = { applied, now }
  for i = 1, n do
    put(reply, i, run(i, 'check', run(i, 'load', nil, 0, now), 0, now))
  end
  return reply
end

if ARGV[2] == 'renew' then
  -- Each lease on its own: one still held runs until a lease from now,
  -- whatever else is in flight (a limit lowered since included); one that
  -- ended is taken afresh under its name if it fits; a request that holds
  -- none yet takes one as a check would.
  local extra = 2 + 7 * n
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

if ARGV[2] ~= '' then
  -- Refund: another part of the request (on another cluster node) denied.
  local charged_at = ARGV[2] + 0
  -- The receipt outlives every retry of the refund (the store sends its
  -- last within about 8 s); short-lived, so that many refunds cost little.
  if redis.call('SET', KEYS[n + 1], 1, 'NX', 'PX', 10000) then
    for i = 1, n do
      if costs[i] > 0 and redis.call('EXISTS', KEYS[i]) == 1 then
        local state = run(i, 'load', nil, 0, now)
        state.lease_id = (ARGV[2 + 7 * n + i] or 0) + 0
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
  return reply
end

local states = {}
local reply = { 1, now }
for i = 1, n do
  local key = KEYS[i]
  if not states[key] then
    states[key] = run(i, 'load', nil, 0, now)
  end
  if put(reply, i, run(i, 'check', states[key], costs[i], now)) == 0 then reply[1] = 0 end
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
else
  -- Nothing is charged: the admitting checks (peeks included, which may
  -- have seen a charge of this request) report their state as it stands,
  -- and what a sliding log dropped is saved, from a state read afresh
  -- (the one decided on may hold this request's charge).
  for i = 1, n do
    local admitted = reply[7 * i - 4] == 1
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
return reply
