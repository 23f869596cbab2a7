"""Servers the deployment tests run beside Envoy, each on a free 127.0.0.1 port and stopped by
stop() (also via `with`): Debian's docker-registry (distribution 2.8) and Prometheus. Their
binaries come from scripts/ensure-deploy-tools.sh, which installs the Debian packages on demand
when it runs as root (CI); `require(tool)` is how a test asks for one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest
import requests

from harness import REPO_ROOT, HarnessError, free_port, terminate

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


def _wait(url: str, proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HarnessError(f"{what} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise HarnessError(f"{what} not ready on {url}:\n{log.read_text(errors='replace')[-2000:]}")


class LocalRegistry:
    """docker-registry with filesystem storage in a temp dir, HTTP on 127.0.0.1:<free port>."""

    def __init__(self, binary: str):
        self.binary = binary
        self.workdir = Path(tempfile.mkdtemp(prefix="llm-governor-registry-"))
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "LocalRegistry":
        log = self.workdir / "registry.log"
        for _ in range(3):  # a port taken between free_port() and the bind: try another
            self.port = free_port()
            config = self.workdir / "config.yml"
            config.write_text(
                "version: 0.1\n"
                "log: {level: info}\n"
                f"storage: {{filesystem: {{rootdirectory: {self.workdir / 'data'}}}, delete: {{enabled: true}}}}\n"
                f"http: {{addr: '{self.address}'}}\n"
            )
            with log.open("w") as out:
                self.proc = subprocess.Popen(
                    [self.binary, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            try:
                _wait(f"http://{self.address}/v2/", self.proc, log, "docker-registry")
                return self
            except HarnessError:
                terminate(self.proc)
                if "address already in use" not in log.read_text(errors="replace"):
                    raise
        raise HarnessError(f"docker-registry could not bind a port:\n{log.read_text(errors='replace')[-2000:]}")

    def stop(self) -> None:
        terminate(self.proc)
        self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalRegistry":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalPrometheus:
    """Prometheus scraping the given targets' /stats/prometheus every scrape_s, with TSDB in a
    temp dir, its web API on 127.0.0.1:<free port>."""

    def __init__(self, binary: str, targets: list, scrape_s: float = 1.0, job: str = "envoy"):
        self.binary = binary
        self.targets = targets
        self.scrape_s = scrape_s
        self.job = job
        self.workdir = Path(tempfile.mkdtemp(prefix="llm-governor-prometheus-"))
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LocalPrometheus":
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
        log = self.workdir / "prometheus.log"
        for _ in range(3):
            self.port = free_port()
            with log.open("w") as out:
                self.proc = subprocess.Popen(
                    [
                        self.binary,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={self.workdir / 'data'}",
                        f"--web.listen-address=127.0.0.1:{self.port}",
                        "--log.level=warn",
                    ],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir,
                )
            try:
                _wait(self.url + "/-/ready", self.proc, log, "prometheus", timeout_s=30)
                return self
            except HarnessError:
                terminate(self.proc)
                if "address already in use" not in log.read_text(errors="replace"):
                    raise
        raise HarnessError(f"prometheus could not bind a port:\n{log.read_text(errors='replace')[-2000:]}")

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

    def stop(self) -> None:
        terminate(self.proc)
        self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalPrometheus":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
