"""Servers the deployment tests run beside Envoy, each a `harness.Server` on a free 127.0.0.1
port (started, stopped and cleaned up by `with`): Debian's docker-registry (distribution 2.8)
and Prometheus. Their binaries come from scripts/ensure-deploy-tools.sh, which installs the
Debian packages on demand when it runs as root (CI); `require(tool)` is how a test asks for one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

import pytest
import requests

from harness import REPO_ROOT, Server, http_ok

ENSURE = REPO_ROOT / "scripts" / "ensure-deploy-tools.sh"


def require(tool: str) -> str:
    """The path of tool, installed if missing and possible; skips the test where it cannot be
    had, except under CI=true, where a missing tool fails (an unchecked image must not pass CI)."""
    found = shutil.which(tool)
    if found:
        return found
    result = subprocess.run([str(ENSURE), tool], capture_output=True, text=True, timeout=600)
    if result.returncode == 0 and result.stdout.strip():
        return result.stdout.strip().splitlines()[-1]
    message = f"{tool} not available ({result.stderr.strip()[-300:]}); run scripts/ensure-deploy-tools.sh {tool}"
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


class LocalRegistry(Server):
    """docker-registry with filesystem storage in its work folder, HTTP on 127.0.0.1:<free port>."""

    what = "registry"

    def __init__(self, binary: str):
        super().__init__()
        self.binary = binary

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> subprocess.Popen:
        config = self.workdir / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log: {level: info}\n"
            f"storage: {{filesystem: {{rootdirectory: {self.workdir / 'data'}}}, delete: {{enabled: true}}}}\n"
            f"http: {{addr: '{self.address}'}}\n"
        )
        return self.spawn([self.binary, "serve", config])

    def ready(self) -> bool:
        return http_ok(f"http://{self.address}/v2/")


class LocalPrometheus(Server):
    """Prometheus scraping the given targets' /stats/prometheus every scrape_s, with TSDB in its
    work folder, its web API on 127.0.0.1:<free port>."""

    what = "prometheus"
    ready_timeout_s = 30.0

    def __init__(self, binary: str, targets: list, scrape_s: float = 1.0, job: str = "envoy"):
        super().__init__()
        self.binary = binary
        self.targets = targets
        self.scrape_s = scrape_s
        self.job = job

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> subprocess.Popen:
        scrape = f"{self.scrape_s:g}s"
        config = self.workdir / "prometheus.yml"
        targets = ", ".join(f"'{t}'" for t in self.targets)
        config.write_text(
            f"global: {{scrape_interval: {scrape}, evaluation_interval: {scrape}}}\n"
            "scrape_configs:\n"
            f"  - job_name: {self.job}\n"
            "    metrics_path: /stats/prometheus\n"
            f"    static_configs: [{{targets: [{targets}]}}]\n"
        )
        return self.spawn(
            [
                self.binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            cwd=self.workdir,
        )

    def ready(self) -> bool:
        return http_ok(self.url + "/-/ready")

    def query(self, expr: str, at: Optional[float] = None) -> dict:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        r = requests.get(self.url + "/api/v1/query", params=params, timeout=10)
        return r.json()

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        r = requests.get(
            self.url + "/api/v1/query_range",
            params={"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
            timeout=10,
        )
        return r.json()

    def label_values(self, label: str, match: str) -> dict:
        """The values of `label` on the series `match` selects (Grafana's label_values(match, label))."""
        r = requests.get(self.url + f"/api/v1/label/{label}/values", params={"match[]": match}, timeout=10)
        return r.json()
