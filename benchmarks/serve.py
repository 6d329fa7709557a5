"""Online serving benchmark, like `vllm bench serve`: load an OpenAI-compatible server, report latency.

Works against any OpenAI-compatible URL (hybridkv, vLLM, SGLang, ...). Requests are streamed so
time-to-first-token and inter-token latency are measured at the client.

Datasets
  random         prompts of --random-input-len random tokens (+/- --random-range-ratio), optionally
                 behind a shared --random-prefix-len prefix
  shared-prefix  --prefix-repetition-num-prefixes prefixes of --prefix-repetition-prefix-len tokens,
                 each followed by unique --prefix-repetition-suffix-len token suffixes (vLLM's
                 `prefix_repetition`); exercises the prefix cache
Token text comes from the server's /tokenize + /detokenize when it has them (hybridkv and vLLM
do), so prompt lengths are close to the requested ones; otherwise random words (~1 token each).

Load: --request-rate (requests/s, Poisson arrivals with --burstiness 1; inf = all at once) and/or
--max-concurrency. Reports request throughput, output and total token throughput, and
mean/median/percentiles of TTFT, TPOT, ITL and E2EL.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8
    python benchmarks/serve.py --dataset-name shared-prefix --max-concurrency 16 --endpoint /v1/chat/completions
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

_WORDS = ("the quick brown fox jumps over lazy dog a lighthouse keeper named Ada found hidden map inside old book "
          "hybrid attention keeps sliding window and compressed entries numbers one two three four five six seven "
          "eight nine ten river mountain city garden music story science history ocean planet").split()


@dataclass
class BenchRequest:
    prompt: str
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


# -- datasets ---------------------------------------------------------------------------------------
class PromptMaker:
    """Random token text: from the server's vocabulary when it has /tokenize + /detokenize."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, rng: random.Random) -> None:
        self.session, self.base_url, self.model, self.rng = session, base_url, model, rng
        self.pool: list[int] | None = None

    async def setup(self) -> None:
        try:
            async with self.session.post(f"{self.base_url}/tokenize",
                                         json={"model": self.model, "prompt": " ".join(_WORDS) * 4}) as r:
                if r.status == 200:
                    self.pool = sorted(set((await r.json())["tokens"]))
        except (aiohttp.ClientError, KeyError, ValueError):
            self.pool = None

    async def text(self, num_tokens: int) -> str:
        if self.pool:
            ids = [self.rng.choice(self.pool) for _ in range(num_tokens)]
            async with self.session.post(f"{self.base_url}/detokenize", json={"model": self.model, "tokens": ids}) as r:
                if r.status == 200:
                    return (await r.json())["prompt"]
            self.pool = None  # the endpoint misbehaves: fall back to words from now on
        return " ".join(self.rng.choice(_WORDS) for _ in range(num_tokens))


async def build_dataset(args: argparse.Namespace, maker: PromptMaker) -> list[BenchRequest]:
    rng = maker.rng
    if args.dataset_name == "random":
        prefix = await maker.text(args.random_prefix_len) + " " if args.random_prefix_len else ""

        def jitter(n: int) -> int:
            lo, hi = int(n * (1 - args.random_range_ratio)), int(n * (1 + args.random_range_ratio))
            return max(1, rng.randint(lo, max(lo, hi)))

        return [BenchRequest(prefix + await maker.text(jitter(args.random_input_len)), jitter(args.random_output_len))
                for _ in range(args.num_prompts)]
    prefixes = [await maker.text(args.prefix_repetition_prefix_len)
                for _ in range(args.prefix_repetition_num_prefixes)]
    reqs = [BenchRequest(prefixes[i % len(prefixes)] + " " + await maker.text(args.prefix_repetition_suffix_len),
                         args.prefix_repetition_output_len) for i in range(args.num_prompts)]
    rng.shuffle(reqs)
    return reqs


# -- one request ------------------------------------------------------------------------------------
def _payload(args: argparse.Namespace, req: BenchRequest) -> dict:
    body: dict[str, Any] = {"model": args.model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": args.temperature}
    if args.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    if args.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extra: makes output lengths exact
    return body


async def send(session: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"].get("message"))
                    return res
                if event.get("usage"):
                    res.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                    res.output_tokens = event["usage"].get("completion_tokens", 0)
                for choice in event.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
        res.e2el = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.success = chunks > 0 or res.output_tokens > 0
        if not res.success:
            res.error = "no output"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# -- the run -----------------------------------------------------------------------------------------
async def _arrivals(n: int, rate: float, burstiness: float, rng: random.Random):
    """Yield n times, spaced by gamma-distributed gaps (Poisson when burstiness == 1)."""
    for i in range(n):
        yield i
        if math.isfinite(rate) and rate > 0 and i < n - 1:
            theta = 1.0 / (rate * burstiness)
            await asyncio.sleep(rng.gammavariate(burstiness, theta))


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered),
            **{f"p{p:g}": pct(p) for p in percentiles}}


async def run_benchmark(args: argparse.Namespace) -> dict:
    base = args.base_url.rstrip("/")
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("HYBRIDKV_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)  # concurrency is ours to control, not the pool's
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        if not args.model:
            async with session.get(f"{base}/v1/models") as r:
                r.raise_for_status()
                args.model = (await r.json())["data"][0]["id"]
        maker = PromptMaker(session, base, args.model, rng)
        await maker.setup()
        dataset = await build_dataset(args, maker)
        url = base + args.endpoint
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                return await send(session, url, _payload(args, req))
            async with limit:
                return await send(session, url, _payload(args, req))

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(dataset), args.request_rate, args.burstiness, rng):
            tasks.append(asyncio.create_task(one(dataset[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    ok = [r for r in results if r.success]
    pcts = [float(p) for p in args.metric_percentiles.split(",")]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "model": args.model, "endpoint": args.endpoint, "dataset": args.dataset_name,
        "num_prompts": len(dataset), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": {k: v * 1e3 for k, v in _stats([r.ttft for r in ok], pcts).items()},
        "tpot_ms": {k: v * 1e3 for k, v in _stats(tpot, pcts).items()},
        "itl_ms": {k: v * 1e3 for k, v in _stats([x for r in ok for x in r.itl], pcts).items()},
        "e2el_ms": {k: v * 1e3 for k, v in _stats([r.e2el for r in ok], pcts).items()},
    }
    return summary


def print_summary(s: dict) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL")):
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        for stat, v in s[key].items():
            label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            print(f"{label + ' ' + short + ' (ms):':<40}{v:<10.2f}")
    if s["errors"]:
        print("Errors:", *s["errors"], sep="\n  ")
    print("=" * w)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY or $HYBRIDKV_API_KEY")
    p.add_argument("--dataset-name", default="random", choices=["random", "shared-prefix", "prefix_repetition"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=64)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=4)
    p.add_argument("--prefix-repetition-output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos so outputs have exact lengths")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=6 * 3600, help="per-request timeout (s)")
    p.add_argument("--save-result", default=None, help="write the summary as JSON to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.dataset_name == "prefix_repetition":
        args.dataset_name = "shared-prefix"
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        print("serve.py: --num-prompts and --max-concurrency must be >= 1", file=sys.stderr)
        return 2
    summary = asyncio.run(run_benchmark(args))
    print_summary(summary)
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
