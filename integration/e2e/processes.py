"""Server processes on loopback ports, written once: `Server` starts one, waits until it is
ready, stops it, removes its work folder, and reads its log; `with` does all of it.

A server gets its port one of two ways:
- it announces the port it bound (`announces_port`: it is started on port 0 and prints
  `listening on 127.0.0.1:PORT`, or, for Envoy, writes its admin address to a file), so no
  other process can take it first;
- or `choose_ports` picks a free port just before the launch, and the launch is tried again
  on another port (up to BIND_ATTEMPTS times) when the log says the port was taken meanwhile.
A port known before the first start (given, or a restart) is kept: there is no other to try.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import requests

BIND_ATTEMPTS = 3
# "llm-sim listening on 127.0.0.1:PORT", "limitador-rls listening on 127.0.0.1:PORT".
ANNOUNCEMENT = re.compile(rb"listening on [\d.]+:(\d+)")
# How a server says the port it was given is taken (Go, Rust and C wordings).
PORT_TAKEN = ("address already in use", "address in use")


class HarnessError(RuntimeError):
    pass


def keep_logs() -> bool:
    """LLM_GOVERNOR_KEEP_LOGS keeps every work folder (configs and logs), for debugging."""
    return bool(os.environ.get("LLM_GOVERNOR_KEEP_LOGS"))


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (prefer letting servers bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0, interval_s: float = 0.05) -> Any:
    """Polls predicate until it returns something true or timeout_s passes; returns its last
    result (so `assert wait_for(...)` fails with the last value falsy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(interval_s)


def http_ok(url: str) -> bool:
    """True when url answers 200 now."""
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:
        return False


def accepts(port: int) -> bool:
    """True when 127.0.0.1:port takes a TCP connection now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_http_ok(url: str, deadline: float, proc: subprocess.Popen) -> bool:
    """True once url answers 200 before the monotonic deadline; False if proc exits first."""
    answered = wait_for(lambda: proc.poll() is not None or http_ok(url), max(0.0, deadline - time.monotonic()))
    return bool(answered) and proc.poll() is None


def terminate(proc: Optional[subprocess.Popen], grace_s: float = 5.0) -> Optional[int]:
    """SIGTERM, then SIGKILL after grace_s; the exit code (None for no process)."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)
    return proc.returncode


class Server:
    """A process on a loopback port with a work folder of its own (its log, its files).

    Subclasses say how to launch it (`launch`, after `port` is set, or on port 0 when it
    announces the port) and when it is ready (`ready`, one probe). start() waits for that;
    stop() ends the process and keeps the folder (its log can be read, and start() runs it
    again on the same port); cleanup() also removes the folder; `with` does start, then both.
    """

    what = "server"
    # True: started on port 0, the server says which port it bound (`read_announcement`).
    announces_port = False
    ready_timeout_s = 15.0
    stop_grace_s = 5.0

    def __init__(self, port: Optional[int] = None):
        self.workdir = Path(tempfile.mkdtemp(prefix=f"llm-governor-{self.what}-"))
        self.log_path = self.workdir / f"{self.what}.log"
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = port
        self.exit_code: Optional[int] = None

    # --- what a subclass says ------------------------------------------------------------------

    def launch(self) -> subprocess.Popen:
        raise NotImplementedError

    def ready(self) -> bool:
        """One readiness probe; the default: announcing its port was enough."""
        return True

    def choose_ports(self) -> None:
        self.port = free_port()

    def read_announcement(self, deadline: float) -> bool:
        """Reads the bound port from the first stdout lines (the process runs with
        stdout=PIPE); False when it exits or says nothing before the deadline."""
        assert self.proc is not None and self.proc.stdout is not None
        fd, seen = self.proc.stdout.fileno(), b""
        while time.monotonic() < deadline:
            readable, _, _ = select.select([fd], [], [], 0.1)
            if not readable:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return False
            seen += chunk
            match = ANNOUNCEMENT.search(seen)
            if match:
                self.port = int(match.group(1))
                return True
        return False

    # --- lifecycle ---------------------------------------------------------------------------------

    def spawn(self, args: list, stdout: Any = None, **popen: Any) -> subprocess.Popen:
        """Runs args with stdin closed and stderr (and stdout, unless given) into the log."""
        with self.log_path.open("w") as log:
            return subprocess.Popen([str(a) for a in args], stdin=subprocess.DEVNULL,
                                    stdout=log if stdout is None else stdout, stderr=log, **popen)

    def await_ready(self, deadline: float) -> bool:
        """True once the process announced its port (if it does) and is ready; False when it
        exits first or the deadline passes."""
        assert self.proc is not None
        proc = self.proc
        if self.announces_port and not self.read_announcement(deadline):
            return False
        answered = wait_for(lambda: proc.poll() is not None or self.ready(), max(0.0, deadline - time.monotonic()))
        return bool(answered) and proc.poll() is None

    def start(self, timeout_s: Optional[float] = None) -> Any:
        """Launches the server and waits until it is ready; on failure, raises HarnessError
        with the log's tail and removes the work folder."""
        timeout_s = timeout_s or self.ready_timeout_s
        fixed = self.announces_port or self.port is not None
        state = ""
        for _ in range(1 if fixed else BIND_ATTEMPTS):
            if not fixed:
                self.choose_ports()
            self.proc = self.launch()
            if self.await_ready(time.monotonic() + timeout_s):
                return self
            exited = self.settled_exit_code()
            state = f"exited with {exited}" if exited is not None else f"not ready after {timeout_s:.0f}s"
            self._halt()
            if not any(taken in self.log().lower() for taken in PORT_TAKEN):
                break
        tail = self.log_tail()
        self.cleanup()
        raise HarnessError(f"{self.what} {state}; log tail:\n{tail}")

    def settled_exit_code(self) -> Optional[int]:
        """The exit code, or None while it runs (a process that just closed its output is given
        a moment to be reaped)."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            return None

    def _halt(self) -> None:
        """Ends the process (stop() and cleanup() both come here)."""
        if self.proc is not None:
            self.exit_code = terminate(self.proc, self.stop_grace_s)
            if self.proc.stdout:
                self.proc.stdout.close()
        self.proc = None

    def stop(self) -> None:
        """Ends the process; the work folder stays (start() runs it again on the same port)."""
        self._halt()

    def cleanup(self) -> None:
        """Ends the process and removes the work folder (kept under LLM_GOVERNOR_KEEP_LOGS)."""
        self._halt()
        if not keep_logs():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            self.cleanup()

    # --- reading ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_lines(self, *parts: str, wait_s: float = 5.0) -> list:
        """The log's lines that hold every one of `parts`. A process writes its log in the
        background (Envoy flushes every 50 ms here), so a line just said is waited for up to
        `wait_s`; an empty list means it was not said in that time."""
        lines = lambda: [line for line in self.log().splitlines() if all(p in line for p in parts)]  # noqa: E731
        return wait_for(lines, timeout_s=wait_s)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])
