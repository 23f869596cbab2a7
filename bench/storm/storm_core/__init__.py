"""The storm harness, shared by `make storm` (bench/storm/storm.py) and the end-to-end test
(integration/e2e/test_storm.py). One module per job:

- `scenarios`: what the provider does and how many clients call (Storm, Phase, SCENARIOS);
- `gateways`: what stands between them, configurations (a) to (g), and (e-fo), (d-fo) with a
  second provider (issue 9);
- `clients`: the official openai SDK, and the raw HTTP/1.1 client on a fixed schedule;
- `run`: one storm through one gateway: reset, release the clients, collect the simulator's log;
- `analysis`: the figures, read from what the simulator logged and what the clients got.

Standard library, `requests` and the `openai` SDK only (no plotting), so the test can import it.
Processes, ports and Envoy configs come from integration/e2e/harness.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
_E2E = str(REPO_ROOT / "integration" / "e2e")
if _E2E not in sys.path:
    sys.path.insert(0, _E2E)
