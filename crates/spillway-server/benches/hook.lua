-- wrk script for benches/service.sh: the forward-auth hook as a proxy calls
-- it, GET /v1/forward-auth with the original request described in
-- X-Forwarded-* headers, the client's address spread over BENCH_KEYS
-- distinct values (default 10000), the requests built once.
local nkeys = tonumber(os.getenv("BENCH_KEYS") or "10000")
local reqs = {}
local n = 0

init = function(args)
  local offset = math.random(0, nkeys - 1)
  for i = 1, nkeys do
    local k = (i + offset) % nkeys
    local headers = {
      ["X-Forwarded-Method"] = "GET",
      ["X-Forwarded-Uri"] = "/",
      ["X-Forwarded-Host"] = "bench.example",
      ["X-Forwarded-Proto"] = "http",
      ["X-Forwarded-For"] = string.format("10.0.%d.%d", math.floor(k / 256), k % 256),
    }
    reqs[i] = wrk.format("GET", "/v1/forward-auth", headers)
  end
end

request = function()
  n = n % nkeys + 1
  return reqs[n]
end
