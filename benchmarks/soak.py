"""Soak test for an OpenAI-compatible server: many streaming requests, some clients hanging up
mid-stream, then a check that the server is back to idle with nothing leaked.

    python benchmarks/soak.py                          # starts `hybridkv serve` (demo model) itself
    python benchmarks/soak.py --requests 2000 --concurrency 64 --disconnect-fraction 0.2
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct

Each request streams a completion of --max-tokens tokens; a --disconnect-fraction of them close
the connection after a random number of events (the server must abort them and free their pages).
At the end it reports 5xx and other errors, the server's KV pages and prefix-cache locks still in
use (from /metrics, after waiting for the engine to go idle), and, when it started the server, the
server's resident memory before and after (RSS growth). Exit status 1 when any 5xx, error or leak
is seen, so CI can run it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

_WORDS = ("the quick brown fox jumps over lazy dog a lighthouse keeper named Ada found hidden map inside old book "
          "river mountain city garden music story science history ocean planet").split()


@dataclass
class SoakResult:
    completed: int = 0
    disconnected: int = 0
    status_5xx: int = 0
    other_errors: list[str] = field(default_factory=list)


def rss_kib(pid: int) -> int:
    """Resident memory of a local process (Linux /proc), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class LocalServer:
    """`hybridkv serve` on a free loopback port, for the length of the soak."""

    url: str  # http://127.0.0.1:<port>
    port: int

    def __init__(self, extra_args: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridkv", "serve", "--port", "0", "--disable-access-log", *extra_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + 600
        seen: list[str] = []
        for line in self.proc.stdout:
            seen.append(line)
            m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                self.url = m.group(1)
                self.port = int(self.url.rsplit(":", 1)[1])
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError("the server exited before it was ready:\n" + "".join(seen[-5:]))
        # Keep reading its output (a full pipe would block it); tracebacks are counted as errors.
        import threading

        self.log: list[str] = []
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stdout], daemon=True).start()

    def unhandled_errors(self) -> list[str]:
        """Log lines of errors the server did not handle (a 500, or one it could not send)."""
        return [x for x in self.log if "unhandled error" in x or x.startswith("Traceback")]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def one(session: aiohttp.ClientSession, url: str, body: dict, hang_up_after: int | None,
              result: SoakResult) -> None:
    try:
        async with session.post(url, json=body) as resp:
            if resp.status >= 500:
                result.status_5xx += 1
                return
            if resp.status != 200:
                result.other_errors.append(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return
            events = 0
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    result.completed += 1
                    return
                payload = json.loads(line[6:])
                if "error" in payload:
                    code = payload["error"].get("code") or 0
                    if code >= 500:
                        result.status_5xx += 1
                    else:
                        result.other_errors.append(str(payload["error"])[:200])
                    return
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    result.disconnected += 1
                    return  # leaving the context manager closes the connection mid-stream
            result.other_errors.append("stream ended without [DONE]")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.other_errors.append(f"{type(e).__name__}: {e}")


async def metrics(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as r:
        return parse_metrics(await r.text())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def leftovers(m: dict[str, float]) -> dict[str, float]:
    """Requests, KV pages and prefix-cache locks still in use."""
    def total(pred) -> float:
        return sum(v for k, v in m.items() if pred(k))

    return {
        "requests": total(lambda k: k.startswith(("hybridkv:num_requests_running", "hybridkv:num_requests_waiting"))),
        "pages_in_use": total(lambda k: k.startswith("hybridkv:kv_cache_pages") and 'state="in_use"' in k),
        "locks": total(lambda k: k.startswith("hybridkv:prefix_cache_locks")),
    }


async def soak(args: argparse.Namespace, base: str, on_warm=lambda: None) -> tuple[SoakResult, dict[str, float], float]:
    """on_warm: called once the first 10% of the requests are done (RSS is sampled there: growth
    before it is allocator and cache warm-up, growth after it would be a leak)."""
    rng = random.Random(args.seed)
    result = SoakResult()
    sem = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=args.concurrency)) as s:
        model = args.model
        if model is None:
            async with s.get(base + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]

        async def run(i: int) -> None:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, args.prompt_words)))
            hang = rng.randint(1, args.max_tokens) if rng.random() < args.disconnect_fraction else None
            body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0.8, "seed": i}
            async with sem:
                await one(s, base + "/v1/completions", body, hang, result)

        t = time.monotonic()
        warm = max(1, args.requests // 10)
        await asyncio.gather(*(run(i) for i in range(warm)))
        on_warm()
        await asyncio.gather(*(run(i) for i in range(warm, args.requests)))
        elapsed = time.monotonic() - t
        # Aborts reach the engine asynchronously: wait for it to go idle before counting leaks.
        deadline = time.monotonic() + 60
        while True:
            left = leftovers(await metrics(s, base))
            if not any(left.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    return result, left, elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default=None, help="a running server; default: start `hybridkv serve` here")
    p.add_argument("--serve-args", default="", help="extra `hybridkv serve` flags when starting it (one string)")
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--timeout", type=float, default=600, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    server = None if args.base_url else LocalServer(args.serve_args.split())
    base = args.base_url or server.url
    try:
        rss = {"start": rss_kib(server.proc.pid) if server else 0}

        def sample_warm() -> None:
            rss["warm"] = rss_kib(server.proc.pid) if server else 0

        result, left, elapsed = asyncio.run(soak(args, base, sample_warm))
        rss["end"] = rss_kib(server.proc.pid) if server else 0
    finally:
        if server is not None:
            server.stop()
    print(f"{args.requests} streaming requests at concurrency {args.concurrency} in {elapsed:.1f} s: "
          f"{result.completed} completed, {result.disconnected} disconnected mid-stream, "
          f"{result.status_5xx} 5xx, {len(result.other_errors)} other errors")
    for e in result.other_errors[:5]:
        print("  error:", e)
    print(f"left in use after idle: {left['requests']:.0f} requests, {left['pages_in_use']:.0f} KV pages, "
          f"{left['locks']:.0f} prefix-cache locks")
    if server is not None:
        print(f"server RSS: {rss['start'] / 1024:.1f} MiB at start, {rss['warm'] / 1024:.1f} MiB after the first "
              f"10% of requests, {rss['end'] / 1024:.1f} MiB at the end ({(rss['end'] - rss['warm']) / 1024:+.1f} MiB "
              f"after warm-up)")
    unhandled = server.unhandled_errors() if server is not None else []
    if server is not None:
        print(f"server log: {len(unhandled)} unhandled errors" + (f", first: {unhandled[0].strip()}" if unhandled else ""))
    ok = result.status_5xx == 0 and not result.other_errors and not any(left.values()) and not unhandled
    print("RESULT", json.dumps({"ok": ok, "completed": result.completed, "disconnected": result.disconnected,
                                "5xx": result.status_5xx, "errors": len(result.other_errors), "unhandled": len(unhandled), **left,
                                "rss_growth_after_warmup_mib": round((rss["end"] - rss["warm"]) / 1024, 1)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
