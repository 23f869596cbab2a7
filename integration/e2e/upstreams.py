"""What Envoy forwards to in the tests: the bundled provider simulator (llm-sim), and
`RawUpstream`, a hand-written one for answers the simulator cannot give."""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Optional, Union

import requests

from artifacts import SIM_BINARY
from processes import HarnessError, Server, http_ok


class Simulator(Server):
    """The bundled provider simulator (target/release/llm-sim) on a free loopback port: it
    binds port 0 (or `port`) and announces the port; ready once /_sim/health answers."""

    what = "llm-sim"
    announces_port = True
    ready_timeout_s = 10.0

    def __init__(self, binary: Union[str, Path] = SIM_BINARY, port: int = 0):
        super().__init__()
        self.binary = Path(binary)
        self.requested_port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> subprocess.Popen:
        if not self.binary.exists():
            raise HarnessError(f"{self.binary} missing: build it with `make sim`")
        return self.spawn([self.binary, "--listen", f"127.0.0.1:{self.requested_port}"], stdout=subprocess.PIPE)

    def ready(self) -> bool:
        return http_ok(self.url + "/_sim/health")

    def scenario(self, scenario: dict) -> None:
        r = requests.post(self.url + "/_sim/scenario", json=scenario, timeout=5)
        if r.status_code >= 300:
            raise HarnessError(f"scenario {scenario} rejected: {r.status_code} {r.text}")

    def reset(self) -> None:
        r = requests.post(self.url + "/_sim/reset", timeout=5)
        r.raise_for_status()

    def requests(self) -> dict:
        r = requests.get(self.url + "/_sim/requests", timeout=5)
        r.raise_for_status()
        return r.json()

    def requests_for(self, key: str) -> list:
        """The requests the simulator saw for one account key, in arrival order."""
        return [q for q in self.requests().get("requests", []) if q.get("key") == key]


class RawUpstream(threading.Thread):
    """A hand-written upstream on a free loopback port, for answers the simulator cannot give
    (late ends of stream, resets, oversized bodies). Subclasses implement serve(conn), called on
    its own thread per connection; stop() ends the accept loop.

        with MyUpstream() as up:
            envoy_bootstrap(up.port, ...)
    """

    def __init__(self):
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()

    def run(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()

    def __enter__(self) -> "RawUpstream":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @staticmethod
    def read_request(conn: socket.socket) -> Optional[bytes]:
        """One request's head and body (content-length), or None if the peer closed."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, rest = data.split(b"\r\n\r\n", 1)
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            rest += chunk
        return head + b"\r\n\r\n" + rest
