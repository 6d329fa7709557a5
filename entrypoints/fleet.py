"""`hybridkv fleet`: several `hybridkv serve` replicas of one model on this machine, sharing one
Redis storage tier, behind SGLang's cache-aware router (sglang-router), started with one
command and stopped together.

    hybridkv fleet MODEL --replicas 2 --port 8000 [--redis-url redis://host:6379/0] [-- serve flags]

Without --redis-url a private redis-server is started on a free loopback port (no persistence).
Each replica runs `hybridkv serve MODEL` on a free loopback port with the host tier and the
Redis storage tier on, so a prefix one replica computed is a storage hit on the others once its
write-behind has run; the router sends each request where its prefix is cached. Clients talk
to the router's port only. Every process is a child of this one: SIGINT / SIGTERM stops the
router, the replicas and the Redis it started, in that order.
For replicas on several machines, start `hybridkv serve` on each with the same Redis URL and
point `sglang-router launch --worker-urls ...` at them (docs/serving.md).
"""
from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # a replica's first start may convert a checkpoint and build kernels
STOP_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


def _program(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ValueError(f"hybridkv fleet needs `{name}`: {install}")
    return path


@dataclass
class Fleet:
    model: str | None  # None: the demo model
    replicas: int = 2
    port: int = 8000  # the router's
    host: str = "127.0.0.1"  # the router's bind address; replicas always bind loopback
    policy: str = "cache_aware"
    redis_url: str | None = None  # None: start a private redis-server
    shared_storage: bool = True  # False: replicas keep their own caches (no Redis; for comparison)
    serve_args: list[str] = field(default_factory=list)
    health_check_interval_s: int = 1
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    replica_urls: list[str] = field(default_factory=list)
    commands: dict[str, list[str]] = field(default_factory=dict)  # how each replica was started

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Fleet":
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        router = _program("sglang-router", "pip install sglang-router")
        try:
            storage = []
            if self.shared_storage:
                if self.redis_url is None:
                    self._start_redis()
                storage = ["--enable-hierarchical-cache", "--hicache-storage-backend", "redis",
                           "--hicache-storage-backend-extra-config", json.dumps({"url": self.redis_url})]
            for i in range(self.replicas):
                port = free_port()
                cmd = [sys.executable, "-m", "hybridkv", "serve", *([self.model] if self.model else []),
                       "--port", str(port), *storage, *self.serve_args]
                self.commands[f"replica {i}"] = cmd
                self.processes[f"replica {i}"] = subprocess.Popen(cmd)
                self.replica_urls.append(f"http://127.0.0.1:{port}")
            for i, url in enumerate(self.replica_urls):
                self._wait(f"replica {i}", f"{url}/health")
            self.processes["router"] = subprocess.Popen(
                [router, "launch", "--host", self.host, "--port", str(self.port), "--policy", self.policy,
                 "--worker-urls", *self.replica_urls,
                 "--health-check-interval-secs", str(self.health_check_interval_s), "--health-failure-threshold", "1",
                 # A request sent to a replica that just died is retried; the cache-aware policy
                 # picks that replica again until the health check drops it, so the retries
                 # must outlast one check (backoffs 0.4, 0.6, 0.9, ... check intervals).
                 "--retry-initial-backoff-ms", str(int(self.health_check_interval_s * 400)),
                 "--retry-max-retries", "6",
                 "--log-level", "warn"])
            self._wait("router", f"{self.url}/health")
        except BaseException:
            self.stop()
            raise
        logger.info("fleet up: router %s (%s) over %s; storage %s", self.url, self.policy,
                    ", ".join(self.replica_urls), self.redis_url)
        return self

    def restart_replica(self, i: int) -> None:
        """Stop replica i (if it still runs) and start it again on its port: it comes back with
        empty device and host caches and warms from the shared store; the router takes it back
        at its next health check."""
        name = f"replica {i}"
        process = self.processes[name]
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes[name] = subprocess.Popen(self.commands[name])
        self._wait(name, f"{self.replica_urls[i]}/health")

    def _start_redis(self) -> None:
        server = _program("redis-server", "apt-get install -y redis-server, or pass --redis-url")
        port = free_port()
        self.processes["redis"] = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL)
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                    s.sendall(b"*1\r\n$4\r\nPING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.processes["redis"].poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def _wait(self, name: str, health_url: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not answers(health_url):
            process = self.processes[name]
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode} before it answered {health_url}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not answer {health_url} within {STARTUP_TIMEOUT_S:g} s")
            time.sleep(0.2)

    def stop(self) -> None:
        """Router first (no new requests reach a replica going down), then replicas, then Redis."""
        order = ["router"] + [n for n in self.processes if n.startswith("replica")] + ["redis"]
        for name in order:
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %g s: killed", name, STOP_TIMEOUT_S)
                process.kill()
                process.wait()

    def run_until_signal(self) -> int:
        """Serve until SIGINT / SIGTERM (or the router exits); returns the exit code."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        reported: set[str] = set()
        try:
            while not stop.wait(1.0):
                for name, process in self.processes.items():
                    if process.poll() is not None and name not in reported:
                        reported.add(name)
                        logger.warning("%s exited with code %s", name, process.returncode)
                if self.processes["router"].poll() is not None:
                    return 1
            return 0
        finally:
            self.stop()
