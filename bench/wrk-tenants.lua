-- wrk request script for `make bench`: OpenAI-style chat completion POSTs from one account
-- (authorization header) spread over BENCH_TENANTS tenants (x-tenant-id), prebuilt so wrk
-- spends no time formatting requests during the run.
local tenants = tonumber(os.getenv("BENCH_TENANTS") or "1000")
local auth = os.getenv("BENCH_AUTH") or "Bearer sk-bench"
local body = '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}'
local requests = {}
local i = 0

function init(args)
  for t = 1, tenants do
    requests[t] = wrk.format("POST", nil, {
      ["content-type"] = "application/json",
      ["authorization"] = auth,
      ["x-tenant-id"] = "tenant-" .. (t - 1),
    }, body)
  end
end

function request()
  i = i % tenants + 1
  return requests[i]
end
