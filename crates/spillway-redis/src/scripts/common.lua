-- Shared helpers. Lua numbers are doubles: every value here is an integer
-- below 2^53 (the store refuses rules that could exceed it), and division
-- goes through idiv so that it is exact.
--
-- The whole script runs on every call, and each function definition in it
-- builds a closure every time it runs. So each algorithm is one function,
-- `algorithm(op, key, state, cost, now, p1..p5)`, whose `op` says what to
-- do: 'load' (returns the key's state as it stands at `now`), 'check'
-- (updates the state and returns the decision), 'idle_at' (when the state
-- is back to fresh, in µs), 'save' (writes the state, to expire in `cost`
-- ms), 'refund' (takes `cost` charged at `now` back off the state). The
-- parameters come as arguments, never in a table.
--
-- A decision is seven numbers (no table: the driver copies them into the
-- reply): allowed (0/1), limit, remaining, reset_after, refill_after (until
-- one more unit than remaining fits; 0 when the quota is whole),
-- retry_after (-1 when admitted), delay. Times in microseconds.
--
-- Numbers arrive as strings (ARGV, HMGET, TIME). `v + 0` converts one
-- exactly as tonumber does (Lua's string-to-number, strtod: exact below
-- 2^53) for less than half the cost of calling tonumber.

-- floor(a / b) for integers a >= 0, b > 0, exactly.
local function idiv(a, b)
  -- Below 2^53 the rounded quotient's floor is the true one or one more:
  -- one step corrects it. A step, not a loop: past 2^53 (a state the store
  -- never writes) q - 1 == q, and a loop would hold Redis for ever.
  local q = math.floor(a / b)
  if q * b > a then q = q - 1 end
  if (q + 1) * b <= a then q = q + 1 end
  return q
end

-- ceil(a / b) for integers a >= 0, b > 0.
local function cdiv(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end
