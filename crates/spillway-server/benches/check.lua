-- wrk script for benches/service.sh: POSTs a JSON body, the key spread over
-- BENCH_KEYS distinct values (default 10000), the bodies built once.
-- BENCH_PATH is the path, BENCH_BODY a format string with one %d (the key).
local path = os.getenv("BENCH_PATH") or "/v1/check"
local fmt = os.getenv("BENCH_BODY") or '{"rule":"bench","key":"ip=10.0.%d"}'
local nkeys = tonumber(os.getenv("BENCH_KEYS") or "10000")
local reqs = {}
local n = 0

init = function(args)
  local headers = { ["Content-Type"] = "application/json" }
  -- Each wrk thread starts at its own point of the key space.
  local offset = math.random(0, nkeys - 1)
  for i = 1, nkeys do
    local body = string.format(fmt, (i + offset) % nkeys)
    reqs[i] = wrk.format("POST", path, headers, body)
  end
end

request = function()
  n = n % nkeys + 1
  return reqs[n]
end
