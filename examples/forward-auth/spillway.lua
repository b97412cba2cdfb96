-- Spillway's forward-auth hook as an HAProxy action (HAProxy 2.6 or later,
-- built with Lua: `haproxy -vv | grep Lua`). haproxy.cfg beside it loads it
-- and calls it for every request; docs/integrations.md explains both.
--
-- The action describes the request to the hook (its method, target, host
-- and the client's address, with the request's own headers) and keeps the
-- answer in variables of the transaction: txn.spillway_status, the body
-- and each rate-limit field, which haproxy.cfg answers or copies.

local hook = "http://127.0.0.1:8080/v1/forward-auth"

-- The hook's header fields kept, and the variable each goes to.
local fields = {
  ["x-ratelimit-limit"] = "txn.spillway_limit",
  ["x-ratelimit-remaining"] = "txn.spillway_remaining",
  ["x-ratelimit-reset"] = "txn.spillway_reset",
  ["ratelimit-policy"] = "txn.spillway_policy",
  ["ratelimit"] = "txn.spillway_ratelimit",
  ["retry-after"] = "txn.spillway_retry_after",
  ["x-spillway-limited"] = "txn.spillway_limited",
}

-- What describes the connection to the hook, not the client's request:
-- never copied from it.
local own = {
  ["host"] = true,
  ["content-length"] = true,
  ["transfer-encoding"] = true,
  ["connection"] = true,
  ["keep-alive"] = true,
  ["te"] = true,
  ["upgrade"] = true,
  ["expect"] = true,
}

core.register_action("spillway", { "http-req" }, function(txn)
  local headers = {}
  -- HAProxy lists a header's values from index 0.
  for name, values in pairs(txn.http:req_get_headers()) do
    if not own[name] then
      local list = {}
      for i = 0, #values do
        list[#list + 1] = values[i]
      end
      headers[name] = list
    end
  end
  -- The description replaces whatever the client sent under these names.
  headers["x-forwarded-method"] = { txn.sf:method() }
  -- The target as the request line has it: an absolute-form target keeps
  -- its host, which upstreams route by before the Host header.
  headers["x-forwarded-uri"] = { txn.sf:url() }
  headers["x-forwarded-host"] = { txn.sf:req_fhdr("host") }
  headers["x-forwarded-proto"] = { "http" }
  -- HAProxy is the edge: the client's own chain is not believed.
  headers["x-forwarded-for"] = { txn.sf:src() }

  -- A shaped request is answered on its turn: wait as long as nginx would
  -- (60 s), as long as the longest queue of a shaping rule may hold it.
  local res = core.httpclient():get{ url = hook, headers = headers, timeout = 60000 }
  if res == nil or res.status == nil or res.status == 0 then
    -- The hook did not answer: haproxy.cfg answers 503.
    txn:set_var("txn.spillway_status", 503)
    return
  end
  txn:set_var("txn.spillway_status", res.status)
  for name, var in pairs(fields) do
    local values = res.headers[name]
    if values ~= nil and values[0] ~= nil then
      txn:set_var(var, values[0])
    end
  end
  if res.body ~= nil and res.body ~= "" then
    txn:set_var("txn.spillway_body", res.body)
  end
end)
