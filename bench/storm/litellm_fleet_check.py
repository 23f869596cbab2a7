"""(x-litellm) Are the three proxies' rpm counters shared? 150 calls (50 at a time) through the 60/30/10 LB,
the simulator answering every call at once. Shared rpm 90: at most 90 reach the provider within
one clock minute; per-proxy counters (90 each) would let all 150 through (the busiest proxy gets
~90). Calls LiteLLM makes wait are cut by a 20 s client timeout."""
from pathlib import Path
import sys, subprocess, collections, time, concurrent.futures as cf
sys.path.insert(0, str(Path(__file__).resolve().parent))
from storm_core import gateways
from harness import Simulator
import requests
sim = Simulator().start()
g = gateways.make_gateway("x-litellm", sim)
g.start()
try:
    sim.scenario({"mode": "ok"})
    url = g.base_url() + "/chat/completions"
    hdr = {"authorization": "Bearer " + g.client_key("")}
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    def call(_):
        try:
            return requests.post(url, json=body, headers=hdr, timeout=20).status_code
        except requests.RequestException as e:
            return type(e).__name__
    t0 = time.strftime("%H:%M:%S", time.gmtime())
    with cf.ThreadPoolExecutor(50) as ex:
        codes = collections.Counter(ex.map(call, range(150)))
    print("started", t0, "UTC, ended", time.strftime("%H:%M:%S", time.gmtime()))
    print("client outcomes", dict(codes))
    print("provider requests", len(sim.requests_for(gateways.LiteLLMGateway.UPSTREAM_KEY)))
    for k in subprocess.run(["redis-cli", "-p", str(g.redis.port), "--scan"], capture_output=True, text=True).stdout.split():
        if ":rpm:" in k or ":tpm:" in k:
            v = subprocess.run(["redis-cli", "-p", str(g.redis.port), "get", k], capture_output=True, text=True).stdout.strip()
            print("redis", k, v)
finally:
    g.stop(); sim.cleanup()
