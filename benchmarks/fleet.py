"""Multi-turn conversations through SGLang's router over a fleet of `hybridkv serve` replicas
(entrypoints/fleet.py: real processes), four ways: cache_aware or round_robin routing, each with
the replicas sharing one Redis storage tier or keeping their own caches. Reports, per way, the
prefix-cache hit rate (cached / prompt tokens, as the server reports them), the mean time to the
first token (streamed), and input tokens per second (prompt tokens / wall time). What the shared
L3 buys is the hit rate a replica gets for a conversation another replica served; what the
routing buys is keeping a conversation where its cache is.

    python benchmarks/fleet.py [--model DIR] [--conversations 7] [--turns 4] [--replicas 2]

The last line is machine-readable:
    RESULT hit_cache_aware_redis=<f> hit_round_robin_redis=<f> hit_cache_aware_local=<f>
           hit_round_robin_local=<f> ttft_cache_aware_redis=<s> ... tps_...=<tok/s>
"""
from __future__ import annotations

import argparse
import http.client
import json
import time
import urllib.parse

from hybridkv.entrypoints.fleet import Fleet, free_port
from cpu_info import cpu_name  # noqa: E402  (benchmarks/ is the script's folder)

WAYS = [("cache_aware", True), ("round_robin", True), ("cache_aware", False), ("round_robin", False)]


def chat_stream(base: str, model: str, messages: list[dict], max_tokens: int) -> tuple[str, float, int, int]:
    """(answer, seconds to the first content, prompt tokens, cached tokens) of one streamed turn."""
    url = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    text, first, usage = [], None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        for choice in event.get("choices", []):
            piece = choice.get("delta", {}).get("content")
            if piece:
                text.append(piece)
                if first is None:
                    first = time.perf_counter() - t0
        usage = event.get("usage") or usage
    conn.close()
    return "".join(text), first or time.perf_counter() - t0, usage["prompt_tokens"], \
        usage["prompt_tokens_details"]["cached_tokens"]


def run_way(model: str | None, served: str, policy: str, shared: bool, args) -> dict:
    fleet = Fleet(model, args.replicas, free_port(), policy=policy, shared_storage=shared,
                  serve_args=["--served-model-name", served, "--disable-access-log", *args.serve_args])
    fleet.start()
    try:
        docs = [" ".join(f"Note {c}.{i}: the archive keeps record {c * 100 + i}." for i in range(args.doc_sentences))
                for c in range(args.conversations)]
        histories = [[{"role": "system", "content": d}] for d in docs]
        prompt = cached = 0
        ttfts = []
        t0 = time.perf_counter()
        for turn in range(args.turns):  # turn t of every conversation, then turn t + 1
            for c, history in enumerate(histories):
                history.append({"role": "user", "content": f"Question {turn} about record {c * 100 + turn}?"})
                answer, ttft, p, h = chat_stream(fleet.url, served, history, args.max_tokens)
                history.append({"role": "assistant", "content": answer})
                prompt, cached = prompt + p, cached + h
                ttfts.append(ttft)
        wall = time.perf_counter() - t0
    finally:
        fleet.stop()
    return {"hit": cached / prompt, "ttft": sum(ttfts) / len(ttfts), "tps": prompt / wall, "prompt": prompt}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: the demo model)")
    # Odd: with an even count over 2 replicas, round_robin would send every turn of a conversation
    # to the same replica (request k goes to k % 2) and measure cache affinity by accident.
    ap.add_argument("--conversations", type=int, default=7)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--doc-sentences", type=int, default=40, help="length of each conversation's system document")
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                    help="flags for every replica's `hybridkv serve` (last on the line)")
    args = ap.parse_args(argv)
    print(f"{cpu_name()}; {args.replicas} replicas, {args.conversations} conversations x {args.turns} turns")
    print(f"{'routing':>12} {'storage':>8} {'hit rate':>9} {'mean TTFT':>10} {'input tok/s':>12}")
    results = {}
    for policy, shared in WAYS:
        r = run_way(args.model, "fleet-model", policy, shared, args)
        results[(policy, shared)] = r
        print(f"{policy:>12} {'redis' if shared else 'local':>8} {r['hit']:>9.3f} {r['ttft'] * 1000:>8.0f} ms "
              f"{r['tps']:>12.1f}", flush=True)
    fields = []
    for key in ("hit", "ttft", "tps"):
        for (policy, shared), r in results.items():
            fields.append(f"{key}_{policy}_{'redis' if shared else 'local'}={r[key]:.4f}")
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
