"""`eagle-serve serve` as a child process on a free loopback port (soak runs, shutdown tests).

Unlike `server.app.BackgroundServer` (uvicorn in a thread of the caller), the server here has
its own process: its RSS can be sampled alone and it can be sent real signals.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: str, startup_timeout: float = 300.0, env: dict | None = None):
        """args: `serve` flags after the subcommand (host and port are chosen here)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "eagle_serve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=root,
                                     env={**os.environ, **(env or {})})
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        import httpx2 as httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the server was not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code (SIGKILL after timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")
