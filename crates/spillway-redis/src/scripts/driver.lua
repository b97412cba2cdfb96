-- Decides on one request: every check at once, nothing written unless all
-- admit.
-- KEYS[i]: the state key of check i.
-- ARGV[1]: the time in µs, or "" to read the server's clock (the store
--          sends "" always; only the test build can send a time).
-- ARGV[2]: "" to decide; or, to give back charges admitted at that time
--          (µs, as this script reported it), the time of the charges.
-- then 7 numbers per check: algorithm, p1..p5, cost.
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

local function params_of(i)
  local base = 2 + (i - 1) * 7
  local algo = ALGORITHMS[tonumber(ARGV[base + 1])]
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

if ARGV[2] ~= '' then
  -- Refund: another part of the request (on another cluster node) denied.
  local charged_at = tonumber(ARGV[2])
  for i = 1, n do
    local algo, p, cost = params_of(i)
    if cost > 0 and redis.call('EXISTS', KEYS[i]) == 1 then
      local state = algo.load(KEYS[i])
      algo.refund(state, p, cost, charged_at)
      save(algo, KEYS[i], state, p)
    end
  end
  -- Report each key's state as it now stands.
  local reply = { 1, now }
  for i = 1, n do
    local algo, p = params_of(i)
    local d = algo.check(algo.load(KEYS[i]), p, 0, now)
    for j = 1, 6 do table.insert(reply, d[j]) end
  end
  return reply
end

local states, algos, params, costs = {}, {}, {}, {}
local decisions = {}
local all_allowed = true
for i = 1, n do
  local algo, p, cost = params_of(i)
  local key = KEYS[i]
  if not states[key] then
    states[key] = algo.load(key)
  end
  algos[i], params[i], costs[i] = algo, p, cost
  local d = algo.check(states[key], p, cost, now)
  if d[1] == 0 then all_allowed = false end
  decisions[i] = d
end

local reply = { all_allowed and 1 or 0, now }
if all_allowed then
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
    if decisions[i][1] == 1 then
      local fresh = algos[i].load(KEYS[i])
      decisions[i] = algos[i].check(fresh, params[i], 0, now)
    end
  end
end
for i = 1, n do
  for j = 1, 6 do table.insert(reply, decisions[i][j]) end
end
return reply
