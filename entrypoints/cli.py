"""The `hybridkv` command line: `hybridkv generate "prompt"` and `hybridkv serve [MODEL]`."""
from __future__ import annotations

import argparse
import logging
import sys


# LLM(...) keywords deliberately kept off the command line. Every other keyword has a flag
# (tests/entrypoints/test_cli_flags.py checks it). allow_pickle_weights: loading pickled (.bin)
# weights can run arbitrary code, so a command line (often copied from elsewhere) never enables it;
# call LLM(..., allow_pickle_weights=True) from Python when the checkpoint is trusted.
CLI_EXCLUDED_LLM_KWARGS = frozenset({"allow_pickle_weights"})

DEFAULT_ATTENTION_BACKEND = "auto"
# A server's streams should not freeze behind someone's long prompt: a step's target time,
# "auto" = the time ~140 prompt tokens take on this machine (at the rate the scheduler
# measures), within 0.05-0.25 s, with the longest step 1.9x that, at most 0.4 s under the
# server's 0.5 s p99 gap goal (engine/step_target.py).
SERVE_TARGET_STEP_SECONDS = "auto"


def step_target(text: str) -> float | str:
    """--target-step-seconds: seconds, or "auto"."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'auto', got {text!r}") from None


_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def byte_size(text: str) -> int:
    """A size in bytes: a whole number, or one with a unit (64MiB, 1.5GiB, 500MB, 2G)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes, e.g. 2147483648, 2GiB or 512MiB; got {text!r}")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from hybridkv.attention_backends.kv_cache_dtype import KV_CACHE_DTYPE_CHOICES
    from hybridkv.attention_backends.registry import ATTENTION_BACKEND_CHOICES
    from hybridkv.block_manager.eviction_policy import POLICIES as EVICTION_POLICIES
    from hybridkv.engine.scheduling_policy import POLICIES as SCHEDULING_POLICIES

    p.add_argument("--model", default=None, help="HF checkpoint folder (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPE_CHOICES),
                   help="KV cache element type: auto (the model's dtype), or fp8 (= fp8_e4m3) / fp8_e5m2, one "
                        "byte an element (twice the pages of bfloat16 in the same budget; dense models only)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV page (default: the model's page size, 16 for dense models, 128 for DeepSeek-V4)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--target-step-seconds", type=step_target, default=None,
                   help="while requests decode, size prefill chunks so a step stays under this many seconds "
                        "on average; 'auto' = the time of ~140 prompt tokens on this machine, "
                        "measured as it runs "
                        f"(default: off for generate, {SERVE_TARGET_STEP_SECONDS} for serve; 0 = off)")
    p.add_argument("--max-step-seconds", type=float, default=None,
                   help="with a step target: the longest step while requests decode or streamed prompts wait "
                        "for a first token; above the target, time "
                        "steps leave under it buys fewer, longer prefill steps and the mean stays at the target "
                        "(default: the target; with 'auto', 1.9x the target, at most 0.4)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory-bytes", type=byte_size, default=None,
                   help="KV cache budget over every block space, e.g. 2GiB (default: what --max-num-seqs "
                        "full-length sequences need, capped at a quarter of the available memory)")
    p.add_argument("--kv-cache-prefault", action=argparse.BooleanOptionalAction, default=None,
                   help="put the CPU KV pools on huge pages and touch them at start, so no step pays a "
                        "first-touch fault (default: on for serve; off for generate, whose pools are taken "
                        "as pages are written)")
    p.add_argument("--chat-template", default=None, help="Jinja chat template (a file path or the template text)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                   help="order of waiting requests: fcfs, or cache-aware lpm / dfs-weight (default: fcfs)")
    p.add_argument("--eviction-policy", default="lru", choices=list(EVICTION_POLICIES),
                   help="which cached prefix pages are evicted first (default: lru)")
    p.add_argument("--windowed-match", action=argparse.BooleanOptionalAction, default=True,
                   help="keep matching a cached prefix after some of its sliding-window pages are gone "
                        "(--no-windowed-match: the baseline that drops such a prefix)")
    p.add_argument("--attention-backend", default=DEFAULT_ATTENTION_BACKEND, choices=list(ATTENTION_BACKEND_CHOICES),
                   help="auto: triton on CUDA when the triton package imports, else torch_native; "
                        "xformers needs CUDA; triton on CPU only under TRITON_INTERPRET=1 "
                        f"(default: {DEFAULT_ATTENTION_BACKEND})")
    p.add_argument("--device", default="cpu",
                   help="cpu (default), cuda, cuda:N, or auto (CUDA when torch sees a GPU, else cpu); "
                        "the CUDA path is checked on the CPU only so far (benchmarks/gpu_check.py)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="CPU compute threads (default: OMP_NUM_THREADS, else one per core)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="model shards, one process each (torch.distributed, gloo on the CPU); dense "
                        "Llama-family and Gemma-3 models and DeepSeek-V4, every KV tier on each rank (default: 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size > 1: each rank holds whole routed experts (1/N of "
                        "them) instead of a slice of every expert; mixture-of-experts models only")
    n = p.add_argument_group("several machines (tensor parallelism across nodes; SGLang's flags)")
    n.add_argument("--nnodes", type=int, default=None,
                   help="machines the --tensor-parallel-size ranks are split over, evenly (default: $WORLD_SIZE "
                        "with --tensor-parallel-size > 1, else 1)")
    n.add_argument("--node-rank", type=int, default=None,
                   help="this machine's index: 0 runs the engine (and the server); any other runs only its "
                        "ranks, until node 0 stops them (default: $RANK, else 0)")
    n.add_argument("--dist-init-addr", default=None,
                   help="host:port of node 0, where it listens for the other nodes' ranks "
                        "(default: $MASTER_ADDR:$MASTER_PORT; needed with --nnodes > 1)")
    p.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="greedy decode steps per model call when every running request decodes greedily "
                        "and none waits (default: 8 without a step target, so `generate`; 1 with one, so `serve`)")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding (vLLM\'s format), JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\': greedy requests only, '
                        "full-attention models (docs/configuration.md)")
    p.add_argument("--dequantize-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8/FP4 checkpoints: dequantize once at load (faster, 2-4x the memory) instead of "
                        "keeping weights compressed (default: compressed)")
    h = p.add_argument_group("hierarchical cache (HiCache L2: host memory under the device KV cache)")
    h.add_argument("--enable-hierarchical-cache", action="store_true",
                   help="keep pages the device evicts in host memory and load them back on a prefix hit")
    h.add_argument("--hicache-ratio", type=float, default=2.0,
                   help="host pages per space as a multiple of the device's (default: 2.0)")
    h.add_argument("--hicache-size", type=byte_size, default=None,
                   help="host tier size over all spaces, e.g. 4GiB (overrides --hicache-ratio)")
    h.add_argument("--hicache-write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="when pages are copied to the host (default: write_through)")
    h.add_argument("--hicache-mem-layout", default="page_first", choices=["page_first", "layer_first"],
                   help="host buffer layout (default: page_first, one page of every layer contiguous)")
    h.add_argument("--load-back-threshold", type=int, default=0,
                   help="host hits shorter than this many tokens are recomputed instead of loaded (default: 0)")
    h.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="swap: a preempted request's pages go to the host tier (needs --enable-hierarchical-cache)")
    h.add_argument("--hicache-storage-backend", default=None, choices=["file", "redis"],
                   help="a store under the host tier (HiCache L3), shared across processes")
    h.add_argument("--hicache-storage-backend-extra-config", default=None,
                   help='JSON settings of the store, e.g. \'{"url": "redis://127.0.0.1:6379/0"}\'')
    h.add_argument("--hicache-storage-dir", default=None,
                   help="directory of the file store (default $HYBRIDKV_CACHE_DIR/kv_store, else ~/.cache/hybridkv/kv_store)")
    h.add_argument("--hicache-storage-prefetch-policy", default="timeout",
                   choices=["best_effort", "wait_complete", "timeout"],
                   help="how long a request waits for its prefix to be read from the store (default: timeout)")
    hs = p.add_argument_group("HiSparse (DeepSeek-V4: decode keeps a hot buffer of C4 entries on the device)")
    hs.add_argument("--enable-hisparse", action="store_true",
                    help="the full C4 history lives in a host mirror; outputs are unchanged")
    hs.add_argument("--hisparse-config", default=None,
                    help='JSON, e.g. \'{"hot_buffer_size": 1024, "mirror_bytes": 8589934592}\' '
                         "(hot_buffer_size default: 2 x the model's index_topk)")
    p.add_argument("--kv-events-config", default=None,
                   help='publish KV cache events (vLLM\'s format, ZeroMQ) for a KV-aware router: JSON, e.g. '
                        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}\'')


def engine_kwargs(args: argparse.Namespace) -> dict:
    template = args.chat_template
    if template is not None:
        import os

        if os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
    kwargs = dict(
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        target_step_seconds=args.target_step_seconds or None,  # 0 = off
        max_step_seconds=args.max_step_seconds,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        num_threads=args.num_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        num_scheduler_steps=args.num_scheduler_steps,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_prefault=args.kv_cache_prefault,
        chat_template=template,
        scheduling_policy=args.scheduling_policy,
        eviction_policy=args.eviction_policy,
        windowed_match=args.windowed_match,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_ratio=args.hicache_ratio,
        hicache_size=args.hicache_size,
        hicache_write_policy=args.hicache_write_policy,
        hicache_mem_layout=args.hicache_mem_layout,
        load_back_threshold=args.load_back_threshold,
        preemption_mode=args.preemption_mode,
        hicache_storage_backend=args.hicache_storage_backend,
        hicache_storage_backend_extra_config=args.hicache_storage_backend_extra_config,
        hicache_storage_dir=args.hicache_storage_dir,
        hicache_storage_prefetch_policy=args.hicache_storage_prefetch_policy,
        dequantize_weights=args.dequantize_weights,
        attention_backend=args.attention_backend,
        device=args.device,
        enable_hisparse=args.enable_hisparse,
        hisparse_config=args.hisparse_config,
        kv_events_config=args.kv_events_config,
        speculative_config=args.speculative_config,
    )
    return kwargs


def _follower_node(model: str | None, kwargs: dict) -> int | None:
    """With --node-rank > 0: run this node's tensor-parallel ranks until node 0 stops them (no
    engine, no server) and return the exit status; None on node 0."""
    from hybridkv.engine.config import EngineConfig

    config = EngineConfig(model=model, **kwargs)
    if not config.node_rank:
        return None
    from hybridkv.engine.tp_node import run_node

    return run_node(config)


def _generate(args: argparse.Namespace) -> int:
    from hybridkv.entrypoints import LLM, SamplingParams

    status = _follower_node(args.model, engine_kwargs(args))
    if status is not None:
        return status
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed
    )
    prompts = args.prompt or ["The capital of France is"]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        print(f"### {prompt}\n{out.outputs[0].text}\n", flush=True)
    return 0


def serve_engine_kwargs(args: argparse.Namespace) -> dict:
    """engine_kwargs with the serving defaults: a step target, and the longest step around it."""
    kwargs = engine_kwargs(args)
    if args.target_step_seconds is None:  # serving default; an explicit 0 turns it off
        kwargs["target_step_seconds"] = SERVE_TARGET_STEP_SECONDS
    if args.kv_cache_prefault is None:  # a server holds its memory for its life: steady steps from the start
        kwargs["kv_cache_prefault"] = True
    return kwargs


def server_settings(args: argparse.Namespace, chat_template: str | None):
    """The ServerSettings `hybridkv serve` runs with, validated (before any model loads)."""
    import os

    from hybridkv.entrypoints.openai.api_server import API_KEY_ENV, ServerSettings

    settings = ServerSettings(
        served_model_names=args.served_model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_request_body_bytes=args.max_request_body_bytes,
        chat_template=chat_template,
        keepalive_timeout=args.keepalive_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        max_seqs_per_request=args.max_seqs_per_request,
        metrics_require_api_key=args.metrics_require_api_key,
        reasoning_parser=args.reasoning_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )
    settings.validate()
    return settings


def max_queued_requests(args: argparse.Namespace) -> int | None:
    """The engine's queue bound from --max-queued-requests (0 = unbounded)."""
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0 (0 = unbounded), got {args.max_queued_requests}")
    return args.max_queued_requests or None


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from hybridkv.engine.async_llm_engine import AsyncLLMEngine
    from hybridkv.engine.config import EngineConfig
    from hybridkv.entrypoints.openai.api_server import default_model_name, serve

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    kwargs = serve_engine_kwargs(args)
    status = _follower_node(args.model_tag or args.model, kwargs)
    if status is not None:
        return status
    settings = server_settings(args, kwargs["chat_template"])
    engine = AsyncLLMEngine.from_config(EngineConfig(model=args.model_tag or args.model, **kwargs),
                                        max_queued_requests=max_queued_requests(args))
    log = logging.getLogger("hybridkv.serve")
    names = settings.served_model_names or [default_model_name(engine)]
    snap = engine.snapshot()
    log.info("model %s served as %s; max_model_len %d, block size %d, prefix caching %s",
             engine.model_dir, ", ".join(repr(n) for n in names), engine.max_model_len, snap.page_size,
             "on" if engine.config.enable_prefix_caching else "off")
    for name, space in snap.spaces.items():
        log.info("KV space %r: %d pages of %d tokens, %.1f MiB", name, space.num_pages, snap.page_size,
                 space.total_bytes / 2**20)
    queued = engine.max_queued_requests
    log.info("limits: bodies %d bytes (in %gs), headers in %gs, %d connections, %d sequences per request, "
             "%s queued sequences", settings.max_request_body_bytes, settings.body_timeout,
             settings.keepalive_timeout, settings.max_connections, settings.max_seqs_per_request,
             queued if queued is not None else "unbounded")

    def ready(port: int) -> None:
        host = f"[{args.host}]" if ":" in args.host else args.host
        log.info("serving the OpenAI-compatible API at http://%s:%d/v1 (%s); Ctrl-C to stop", host, port,
                 "API key required" if settings.api_key else "no API key")
        if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
            log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)

    try:
        status = asyncio.run(serve(engine, settings, args.host, args.port, access_log=not args.disable_access_log,
                                   on_ready=ready))
    except OSError as e:  # e.g. the port is taken
        print(f"hybridkv: error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()
    if status:
        log.error("server stopped: the engine died")
    else:
        log.info("server stopped")
    return status


def _fleet(args: argparse.Namespace) -> int:
    from hybridkv.entrypoints.fleet import Fleet

    fleet = Fleet(args.model_tag, args.replicas, args.port, args.host, args.policy, args.redis_url,
                  serve_args=list(args.serve_args))
    fleet.start()
    logging.getLogger("hybridkv.fleet").info("serving at %s/v1 through the router; Ctrl-C stops every process",
                                             fleet.url)
    return fleet.run_until_signal()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridkv", description="hybridkv: hybrid-attention LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="*", help="prompt(s); default: a short demo prompt")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    s.add_argument("model_tag", nargs="?", default=None, help="HF checkpoint folder (default: the demo model)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port to bind (0 = any free port)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1 routes (default: $HYBRIDKV_API_KEY)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: the model path)")
    s.add_argument("--max-request-body-bytes", type=int, default=8 << 20, help="larger bodies get 413")
    s.add_argument("--keepalive-timeout", type=float, default=15.0,
                   help="seconds a connection gets to send a request's headers (from connect or the previous "
                        "response); also the idle keep-alive timeout (default: 15)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds to receive a request body, else 408 and the connection closes (default: 30)")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="open connections at most; more are closed as soon as they connect (default: 1024)")
    s.add_argument("--max-seqs-per-request", type=int, default=1024,
                   help="sequences (prompts x n) one request may start; more get 400 (default: 1024)")
    s.add_argument("--max-queued-requests", type=int, default=2048,
                   help="sequences that may wait for the engine; a request past it gets 503 with Retry-After "
                        "(default: 2048; 0 = unbounded)")
    s.add_argument("--metrics-require-api-key", action="store_true",
                   help="with an API key, /metrics needs it too (default: /metrics is open)")
    s.add_argument("--disable-access-log", action="store_true", help="do not log one line per HTTP request")
    s.add_argument("--reasoning-parser", default=None, metavar="{deepseek_r1,deepseek_v4,qwen3}",
                   help="split a reasoning model's output into reasoning_content and content (chat completions)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto" (the default with tools): the model decides, and its calls are parsed '
                        "with --tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, metavar="{hermes,llama3_json,mistral,deepseek_v4}",
                   help="the model's tool-call format, for --enable-auto-tool-choice")
    add_engine_args(s)
    s.set_defaults(func=_serve)

    f = sub.add_parser("fleet", help="several `serve` replicas sharing a Redis storage tier behind sglang-router",
                       description="Start N `hybridkv serve` replicas on free loopback ports with the Redis storage "
                                   "tier, and SGLang's router in front of them on --port; stop them all on Ctrl-C. "
                                   "Flags after `--` go to every replica's `hybridkv serve`.")
    f.add_argument("model_tag", nargs="?", default=None, help="HF checkpoint folder (default: the demo model)")
    f.add_argument("--replicas", type=int, default=2)
    f.add_argument("--host", default="127.0.0.1", help="the router's bind address (default: loopback only)")
    f.add_argument("--port", type=int, default=8000, help="the router's port")
    f.add_argument("--policy", default="cache_aware", choices=["cache_aware", "round_robin", "power_of_two", "random"],
                   help="the router's policy (default: cache_aware)")
    f.add_argument("--redis-url", default=None,
                   help="a shared Redis for the storage tier (default: start a private redis-server)")
    f.set_defaults(func=_fleet, serve_args=[])  # what follows `--` (split off in main)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    passed_on: list[str] = []
    if argv[:1] == ["fleet"] and "--" in argv:  # `hybridkv fleet ... -- <flags for every replica>`
        cut = argv.index("--")
        argv, passed_on = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if passed_on:
        args.serve_args = passed_on
    try:
        return args.func(args)
    except ValueError as e:
        print(f"hybridkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the server's own handler is installed (model loading)
        return 130


if __name__ == "__main__":
    sys.exit(main())
