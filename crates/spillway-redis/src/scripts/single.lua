-- Decides on one check: the common request, without driver.lua's
-- bookkeeping for several checks. script.rs makes one such script per
-- algorithm (but the fixed window, which has its own:
-- fixed_window_single.lua), filling in its function, how many parameters
-- it reads and their names.
-- KEYS[1]: the state key.
-- ARGV: the algorithm's parameters, then the cost, then (only the test
--       build reads it) a time in µs to decide at instead of the server's
--       clock.
-- The reply, as driver.lua's: admitted (0/1), the time, then the seven
-- numbers of the decision.
local key = KEYS[1]
local cost = ARGV[ARITY + 1] + 0
local now
-- As in driver.lua: under a test's virtual clock, keys must outlive the
-- test's steps.
local ttl_slack_ms = 0
if ALLOW_TIME_OVERRIDE and ARGV[ARITY + 2] then
  now = ARGV[ARITY + 2] + 0
  ttl_slack_ms = 60000
else
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
-- PARAMS_FROM_ARGV
local state = ALGORITHM('load', key, nil, 0, now, PARAMS)
local allowed, limit, remaining, reset_after, refill_after, retry_after, delay =
  ALGORITHM('check', key, state, cost, now, PARAMS)
-- An admitted charge is saved; so is a check that only dropped expired
-- state (the sliding log's 'dirty': other algorithms answer nil).
if (allowed == 1 and cost > 0) or ALGORITHM('dirty', key, state, 0, now, PARAMS) then
  local idle_at = ALGORITHM('idle_at', key, state, 0, now, PARAMS)
  if idle_at <= now then
    redis.call('DEL', key)
  else
    ALGORITHM('save', key, state, cdiv(idle_at - now, 1000) + ttl_slack_ms, now, PARAMS)
  end
end
return { allowed, now, allowed, limit, remaining, reset_after, refill_after, retry_after, delay }
