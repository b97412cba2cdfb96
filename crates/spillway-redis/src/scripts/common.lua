-- Shared helpers. Lua numbers are doubles: every value here is an integer
-- below 2^53 (the store refuses rules that could exceed it), and division
-- goes through idiv so that it is exact.
--
-- The whole script runs on every call, so each algorithm file only
-- registers a definer: the driver builds an algorithm's functions when a
-- check uses it, not on every call for every algorithm.

-- floor(a / b) for integers a >= 0, b > 0, exactly.
local function idiv(a, b)
  local q = math.floor(a / b)
  while q * b > a do q = q - 1 end
  while (q + 1) * b <= a do q = q + 1 end
  return q
end

-- ceil(a / b) for integers a >= 0, b > 0.
local function cdiv(a, b)
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end

-- An integer as text, for the strings this script builds itself. Lua's own
-- number-to-string conversion keeps 14 significant digits, which would
-- round a timestamp in microseconds (16 digits). A number passed straight
-- to redis.call needs no such care: Redis converts it exactly (`%.17g`, or
-- its integer printer when the number is whole).
local function int(x)
  return string.format('%.0f', x)
end

local function num(v)
  if v then return tonumber(v) end
  return nil
end

-- A decision, as six numbers (no table: the driver copies them into the
-- reply): allowed (0/1), limit, remaining, reset_after, retry_after (-1 when
-- admitted), delay. Times in microseconds.
local function decision(allowed, limit, remaining, reset_after, retry_after, delay)
  return allowed and 1 or 0, limit, remaining, reset_after, retry_after or -1, delay or 0
end
