"""A real redis-server per test, on a free loopback port (never the default 6379, which may be a
user's own), with no persistence; stopped at teardown so no process outlives its test."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

import pytest

from system_tools import require_program

STARTUP_DEADLINE_S = 10.0


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_ping(port: int, timeout_s: float = 0.2) -> bool:
    """A raw RESP PING, so the fixture does not depend on the client under test."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """One redis-server process that a test can kill, pause and restart on the same port."""

    workdir: str
    port: int = field(default_factory=free_loopback_port)
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen | None = None
    paused: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.process is None, "redis-server already running"
        log = open(os.path.join(self.workdir, f"redis-{self.port}.log"), "ab")
        self.process = subprocess.Popen(
            [
                "redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.workdir, *self.extra_args,
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        while not answers_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING (see {self.workdir})")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, its connections reset."""
        if self.process is not None:
            self.resume()
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server still accepts connections (the kernel does) but never answers."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.process is not None and self.paused:
            self.process.send_signal(signal.SIGCONT)
            self.paused = False

    def stop(self) -> None:
        if self.process is None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process = None


@pytest.fixture
def redis_server_factory(tmp_path):
    """Factory: redis_server_factory(*extra redis-server args) -> a started RedisServer."""
    require_program("redis-server", "apt-get install -y redis-server")
    servers: list[RedisServer] = []

    def start(*extra_args: str) -> RedisServer:
        workdir = tmp_path / f"redis{len(servers)}"
        workdir.mkdir()
        for attempt in range(3):  # the free port may be taken between choosing and binding it
            server = RedisServer(str(workdir), extra_args=tuple(extra_args))
            servers.append(server)
            try:
                server.start()
                return server
            except RuntimeError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def redis_server(redis_server_factory) -> RedisServer:
    return redis_server_factory()
