-- Decides on one request: every check at once, nothing written unless all
-- admit.
-- KEYS[i]: the state key of check i.
-- ARGV[1]: the time in µs, or "" to read the server's clock (the store
--          sends "" always; only the test build can send a time).
-- ARGV[2]: "" to decide; or, to give back charges admitted at that time
--          (µs, as this script reported it), the time of the charges.
-- then 7 numbers per check: algorithm, p1..p5, cost.
-- The reply: admitted (0/1), the time, then the six numbers of each
-- check's decision.
local now
-- Keys expire on the server's real clock. Under a test's virtual clock they
-- must outlive the test's steps instead: an idle state decides like a fresh
-- one, so keeping it longer changes no decision.
local ttl_slack_ms = 0
if ARGV[1] ~= '' and ALLOW_TIME_OVERRIDE then
  now = tonumber(ARGV[1])
  ttl_slack_ms = 60000
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local n = #KEYS

-- An algorithm's functions, by its number (script.rs::params). The whole
-- script runs on every call: defining only the algorithms a call uses keeps
-- the others from costing anything.
local function define(id)
  if id == 1 then return fixed_window() end
  if id == 2 then return sliding_log() end
  if id == 3 then return sliding_window() end
  if id == 4 or id == 5 then return bucket() end
  error('spillway: unknown algorithm ' .. tostring(id))
end

-- Check i's algorithm (defined once per call when given a `defined`
-- table to keep it in), its parameters, its cost.
local function params_of(i, defined)
  local base = 2 + (i - 1) * 7
  local id = tonumber(ARGV[base + 1])
  local algo = defined and defined[id]
  if not algo then
    algo = define(id)
    if defined then defined[id] = algo end
  end
  local p = { tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4]),
              tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6]) }
  return algo, p, tonumber(ARGV[base + 7])
end

local function save(algo, key, state, p)
  local idle_at = algo.idle_at(state, p)
  if idle_at <= now then
    redis.call('DEL', key)
  else
    algo.save(key, state)
    redis.call('PEXPIRE', key, cdiv(idle_at - now, 1000) + ttl_slack_ms)
  end
end

-- Copies check i's decision (six numbers) into the reply.
local function put(reply, i, allowed, limit, remaining, reset_after, retry_after, delay)
  local o = 6 * i - 4
  reply[o + 1], reply[o + 2], reply[o + 3] = allowed, limit, remaining
  reply[o + 4], reply[o + 5], reply[o + 6] = reset_after, retry_after, delay
  return allowed
end

if ARGV[2] ~= '' then
  -- Refund: another part of the request (on another cluster node) denied.
  local charged_at = tonumber(ARGV[2])
  local defined = {}
  for i = 1, n do
    local algo, p, cost = params_of(i, defined)
    if cost > 0 and redis.call('EXISTS', KEYS[i]) == 1 then
      local state = algo.load(KEYS[i])
      algo.refund(state, p, cost, charged_at)
      save(algo, KEYS[i], state, p)
    end
  end
  -- Report each key's state as it now stands.
  local reply = { 1, now }
  for i = 1, n do
    local algo, p = params_of(i, defined)
    put(reply, i, algo.check(algo.load(KEYS[i]), p, 0, now))
  end
  return reply
end

if n == 1 then
  -- The common case, without the bookkeeping for several checks.
  local algo, p, cost = params_of(1)
  local key = KEYS[1]
  local state = algo.load(key)
  local allowed, limit, remaining, reset_after, retry_after, delay =
    algo.check(state, p, cost, now)
  if allowed == 1 and cost > 0 then save(algo, key, state, p) end
  return { allowed, now, allowed, limit, remaining, reset_after, retry_after, delay }
end

local defined, states, algos, params, costs = {}, {}, {}, {}, {}
local reply = { 1, now }
for i = 1, n do
  local algo, p, cost = params_of(i, defined)
  local key = KEYS[i]
  if not states[key] then
    states[key] = algo.load(key)
  end
  algos[i], params[i], costs[i] = algo, p, cost
  if put(reply, i, algo.check(states[key], p, cost, now)) == 0 then reply[1] = 0 end
end

if reply[1] == 1 then
  local written = {}
  for i = 1, n do
    local key = KEYS[i]
    if not written[key] and costs[i] > 0 then
      written[key] = true
      save(algos[i], key, states[key], params[i])
    end
  end
else
  -- Nothing is charged: the admitting checks (peeks included, which may
  -- have seen a charge of this request) report their state as it stands.
  for i = 1, n do
    if reply[6 * i - 3] == 1 then
      local fresh = algos[i].load(KEYS[i])
      put(reply, i, algos[i].check(fresh, params[i], 0, now))
    end
  end
end
return reply
