"""A real ``redis-server`` (the OS package tools/test.sh installs) on a free loopback port.

``redis_server`` is one server for the test session (tests/conftest.py exposes it); each test that
uses it takes its own key prefix, so tests never see each other's entries. Tests that stop the server
(faults) start their own :class:`RedisServer` and leave the shared one alone. No persistence (no RDB,
no AOF) unless asked for: a restart is then the empty server a crashed Redis comes back as.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, appendonly: bool = False, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            # the test setup installs it (tools/test.sh); missing is a broken setup, not a skip
            raise RuntimeError("redis-server not found: run tools/test.sh (it installs the OS package)")
        self.binary = binary
        self.port = port or _free_port()
        self.appendonly = appendonly
        self.password = password
        self.dir = Path(tempfile.mkdtemp(prefix="bidikv-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
               "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--daemonize", "no",
               "--maxmemory-policy", "noeviction", "--loglevel", "warning"]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=open(self.dir / "redis.log", "ab"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers_ping():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   f"{(self.dir / 'redis.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING within {START_TIMEOUT_S} s")
            time.sleep(0.02)
        return self

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
                s.sendall(auth + b"PING\r\n")
                data = b""
                while b"PONG" not in data and b"-" not in data[:1]:
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    data += chunk
                return b"PONG" in data
        except OSError:
            return False

    def stop(self) -> None:
        """Kill the server (SIGKILL: a crash, not a shutdown that could save anything)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


def unique_prefix() -> str:
    return f"test-{uuid.uuid4().hex[:12]}:"
