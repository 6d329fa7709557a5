"""One client cannot stall or starve the others: `hybridkv serve` on the demo model, with its
default scheduling (chunked prefill under the 0.25 s step target, steps up to 0.4 s), holds a stream open while an
abuser sends, one after another: a fan-out over the per-request sequence cap, a 1,024-prompt
fan-out within it, a request while that fan-out fills the queue, an 8,000-token prompt, a body
near the 8 MiB limit, a Content-Length far over it, half-sent bodies and a half-sent header.

Invariants checked:
- the open stream's gaps between two token events: p99 under STREAM_GAP_P99_BOUND_S, the
  longest under STREAM_GAP_BOUND_S (targets and measurements next to the bounds);
- /health answers within HEALTH_BOUND_S every time it is polled;
- the abuser gets 400 / 413 / 503 / 408 where a limit applies, and the server still serves a
  normal request afterwards, ending with no pages or prefix-cache locks in use.

Figures (2-core Zen 3, demo model, float32) and why the gap bounds scale with the machine: next
to the bounds below; the test prints its own (`-s`).
"""
from __future__ import annotations

import json
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest

from benchmarks import soak

# Goals: stream gaps 0.5 s, /health 100 ms, on the 2-core Zen 3 machine. Measured there
# (standalone runs of this test, demo model, float32), quiet gap 0.09 s at first:
#   before prompts kept their pages in one run: p99 0.78 s, longest 1.06 s (late in the 8k prompt);
#   since (2026-12-02, two runs on a machine 1.61x / 1.43x slower than that quiet gap): p99 0.39 /
#   0.44 s, longest 0.80 / 0.51 s, one gap over 0.5 s in 1,744 / 1,615; /health worst 38 / 16 ms.
#   With the fused CPU ops (2026-12-03, two runs): quiet gap 0.039 / 0.038 s, p99 0.32 / 0.32 s,
#   longest 0.39 / 0.35 s, no gap over 0.5 s; /health worst 21 / 14 ms. The quiet gap fell from
#   0.09 to 0.04 s over these changes, the floor step less, hence the new reference: with 0.09 s a
#   machine up to 2.3x slower than this one would not have scaled the bounds at all.
#   With the target as a mean and steps up to 0.4 s (2026-12-04): quiet gap 0.035 s, p99 0.42 s,
#   longest 0.50 s, one gap over 0.5 s in 1,015; /health worst 57 ms.
# The long gaps are the floor steps late in the 8k-token prompt (4 prompt tokens over 7-8k keys
# plus the stream's decode), which through the server also share 2 cores with the event loop
# and this test's probe threads. A step cannot be cheaper than that floor, and the floor scales
# with the machine, so the gap bounds are scaled by how much slower this machine's quiet gap is
# than the reference's (measured in the same sitting before any abuse; never scaled below 1).
# The bounds keep room for a noisy VM (its speed moved 1.7x within an hour here).
# /health does no model work and is not scaled.
REFERENCE_QUIET_GAP_S = 0.04
STREAM_GAP_P99_BOUND_S = 0.55
STREAM_GAP_BOUND_S = 1.2
HEALTH_BOUND_S = 0.25
MAX_QUEUED = 300


class _Server(soak.LocalServer):
    """benchmarks/soak.py's local server with blocking helpers for this test's threads."""

    def __init__(self) -> None:
        super().__init__(["--max-queued-requests", str(MAX_QUEUED), "--body-timeout", "2", "--keepalive-timeout", "2"])

    def post(self, path: str, body, timeout: float = 300) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"},
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return soak.parse_metrics(r.read().decode())


def _metric(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


class _Stream(threading.Thread):
    """A long-running stream whose token events are timestamped as they arrive."""

    def __init__(self, srv: _Server) -> None:
        super().__init__(daemon=True)
        self.srv, self.times, self.stop = srv, [], threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 7000, "ignore_eos": True, "stream": True,
                "temperature": 0}
        try:
            with socket.create_connection(("127.0.0.1", self.srv.port), timeout=300) as s:
                data = json.dumps(body).encode()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(data) + data)
                f = s.makefile("rb")
                while not self.stop.is_set():
                    line = f.readline()
                    if not line:
                        raise RuntimeError("stream ended early")
                    if line.startswith(b"data: {"):
                        self.times.append(time.monotonic())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            if not self.stop.is_set():
                self.error = e

    def gaps(self, since: float) -> list[float]:
        ts = [t for t in self.times if t >= since]
        return sorted(b - a for a, b in zip(ts, ts[1:]))


class _HealthProbe(threading.Thread):
    def __init__(self, srv: _Server) -> None:
        super().__init__(daemon=True)
        self.srv, self.latencies, self.stop = srv, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            with urllib.request.urlopen(self.srv.url + "/health", timeout=30) as r:
                assert r.status == 200
            self.latencies.append(time.monotonic() - t)
            time.sleep(0.1)


def _raw(port: int, payload: bytes, wait: float) -> tuple[bytes, float]:
    """Send payload, then read what comes back within `wait` seconds; returns the bytes (b"" =
    closed silently, b"<open>" = still open and silent) and the seconds to the first byte."""
    t = time.monotonic()
    first = float("inf")
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(payload)
        chunks = []
        try:
            while True:
                c = s.recv(65536)
                if not c:
                    break
                if not chunks:
                    first = time.monotonic() - t
                chunks.append(c)
        except socket.timeout:
            return b"".join(chunks) or b"<open>", first
        return b"".join(chunks), first


@pytest.mark.slow
def test_one_client_cannot_stall_the_others():
    # Bodies encoded up front: the probes share this process's GIL with whatever it does meanwhile.
    near_limit_body = json.dumps({"prompt": "hello " * 1398000, "max_tokens": 1}).encode()
    long_prompt_body = json.dumps({"prompt": [(37 * i) % 40000 + 100 for i in range(8000)], "max_tokens": 1}).encode()
    srv = _Server()
    try:  # any failure still stops the server subprocess (no process outlives the test)
        stream, health = _Stream(srv), _HealthProbe(srv)
        try:
            stream.start()
            while len(stream.times) < 5:
                assert stream.error is None and stream.is_alive(), f"stream failed: {stream.error}"
                time.sleep(0.05)
            # The machine's speed: the stream's gaps alone, before any abuse.
            while len(stream.times) < 35:
                assert stream.error is None and stream.is_alive(), f"stream failed: {stream.error}"
                time.sleep(0.05)
            quiet = statistics.median(stream.gaps(stream.times[4]))
            slowdown = max(1.0, quiet / REFERENCE_QUIET_GAP_S)
            health.start()
            t0 = time.monotonic()
            phases: dict[str, float] = {}

            def phase(name: str) -> None:
                phases[name] = time.monotonic()

            # 1. A fan-out over the per-request cap (1,024 prompts x n=128) is refused outright.
            phase("fan-out over cap")
            status, _, body = srv.post("/v1/completions", {"prompt": ["hi"] * 1024, "n": 128, "max_tokens": 1})
            assert status == 400 and body["error"]["param"] == "n", body

            # 2. A fan-out within it is served; while it waits, the queue is full for others (503).
            phase("fan-out within cap")
            result: dict = {}
            fan = threading.Thread(target=lambda: result.update(
                r=srv.post("/v1/completions", {"prompt": ["hi"] * 1024, "max_tokens": 1})))
            fan.start()
            deadline = time.monotonic() + 60
            while _metric(srv.metrics(), "hybridkv:num_requests_waiting") <= MAX_QUEUED:
                assert time.monotonic() < deadline and fan.is_alive(), "the fan-out never filled the queue"
                time.sleep(0.02)
            status, headers, body = srv.post("/v1/completions", {"prompt": "hello", "max_tokens": 1})
            assert status == 503 and int(headers["Retry-After"]) >= 1, (status, body)
            assert body["error"]["type"] == "ServiceUnavailableError"
            fan.join(300)
            assert result["r"][0] == 200 and len(result["r"][2]["choices"]) == 1024

            # 3. An 8,000-token prompt is prefilled in chunks between the stream's tokens.
            phase("8k-token prompt")
            # Beside a stream it prefills a few tokens per step late in the prompt: 200-300 s here.
            status, _, body = srv.post("/v1/completions", long_prompt_body, timeout=1200)
            assert status == 200 and body["usage"]["prompt_tokens"] == 8000, body

            # 4. A body just under the 8 MiB limit: refused (it cannot fit the context) without stalling anyone.
            phase("near-limit body")
            status, _, body = srv.post("/v1/completions", near_limit_body)
            assert status == 400 and body["error"]["param"] == "prompt", body

            # 5. A Content-Length far over the limit is refused at once (413), not waited for.
            phase("huge Content-Length")
            reply, first = _raw(srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                b"\r\nContent-Length: 9223372036854775807\r\n\r\n{}", wait=15)
            assert reply.startswith(b"HTTP/1.1 413") and first < 1, (first, reply[:200])

            # 6. Half-sent bodies (408 after the body timeout) and a half-sent header (closed).
            phase("slow clients")
            replies: list[bytes] = []
            slow = [threading.Thread(target=lambda: replies.append(_raw(
                srv.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"prompt\": ", wait=20)[0])) for _ in range(16)]
            slow.append(threading.Thread(target=lambda: replies.append(_raw(srv.port, b"POST /v1/compl", wait=20)[0])))
            for th in slow:
                th.start()
            for th in slow:
                th.join(60)
            assert len(replies) == 17 and b"<open>" not in replies, "a slow client was held open"
            assert sum(r.startswith(b"HTTP/1.1 408") for r in replies) == 16, replies[:2]
            phase("end")

            gaps = stream.gaps(t0)
            gap, p99 = gaps[-1], gaps[int(0.99 * (len(gaps) - 1))]
            health_worst = max(health.latencies)
            names = list(phases)
            for a, b in zip(names, names[1:]):
                ts = [x for x in stream.times if phases[a] <= x < phases[b]]
                g = max((q - p for p, q in zip(ts, ts[1:])), default=0.0)
                print(f"{a}: {phases[b] - phases[a]:.1f} s, {len(ts)} stream tokens, longest gap {g:.3f} s")
            m = srv.metrics()
            gc_runs = {k: v for k, v in m.items() if k.startswith("hybridkv:gc_collections_total")}
            full_gcs = sum(v for k, v in gc_runs.items() if 'generation="2"' in k)
            print(f"server: {sum(gc_runs.values()):.0f} garbage collections ({full_gcs:.0f} full), longest pause "
                  f"{_metric(m, 'hybridkv:gc_longest_pause_seconds') * 1000:.0f} ms")
            print(f"stream: quiet gap {quiet:.3f} s (machine {slowdown:.2f}x the reference's); under abuse longest "
                  f"gap {gap:.3f} s, p99 {p99:.3f} s, {sum(g > 0.5 for g in gaps)} gaps over 0.5 s, "
                  f"over {len(stream.times)} tokens; /health worst "
                  f"{health_worst * 1000:.0f} ms over {len(health.latencies)} probes")
            assert stream.error is None and stream.is_alive(), f"the open stream failed: {stream.error}"
            assert p99 <= STREAM_GAP_P99_BOUND_S * slowdown, (
                f"the open stream's p99 gap is {p99:.3f} s (bound {STREAM_GAP_P99_BOUND_S} s x {slowdown:.2f})")
            assert gap <= STREAM_GAP_BOUND_S * slowdown, (
                f"the open stream stalled for {gap:.3f} s (bound {STREAM_GAP_BOUND_S} s x {slowdown:.2f})")
            assert health_worst <= HEALTH_BOUND_S, f"/health took {health_worst * 1000:.0f} ms"

            # Afterwards: a normal request is served, and nothing is left in use once the stream ends.
            status, _, body = srv.post("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4})
            assert status == 200 and body["choices"][0]["text"]
        finally:
            stream.stop.set()
            health.stop.set()
            health.join(30)
        deadline = time.monotonic() + 60
        while any((left := soak.leftovers(srv.metrics())).values()):
            assert time.monotonic() < deadline, f"left in use: {left}"
            time.sleep(0.2)
    finally:
        srv.stop()
