"""HiCache part 2, end to end: a storage tier (L3) under the host tier, file and Redis backends.

Invariants checked:
- a prefix that comes back from the store gives the no-cache run's greedy tokens and logprobs
  (Llama and a V4 config; file and Redis backends), and the report says "from storage";
- a second LLM on the same store -- and a second OS process, on a directory and on Redis --
  serves a prompt the first computed (num_cached_tokens > 0, identical output); another dtype
  or page size on the same directory or Redis gets no hits;
- a corrupted stored value (a file, a Redis value) or a truncated file is a miss, counted, and
  the output is unchanged;
- prefetch reservations go back to zero on every exit (done, timeout, abort, a read that raises);
  best_effort admits without waiting for a read;
- pages read for waiting requests stay on the host until they are admitted (host pins);
- a request whose cached prefix was evicted while it waited reads it from the store again;
- every test ends idle (conftest), with the store's background writes drained.
"""
from __future__ import annotations

import logging

import os
import time

import pytest
import torch

from hybridkv.entrypoints import LLM, SamplingParams
from prefix_hit_helpers import LOGPROB_ATOL, greedy, run_one, sampled_logprobs
from tiny_deepseek_v4 import build_v4_checkpoint, single_thread


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _stored(llm: LLM) -> None:
    """Wait until everything the engine handed to the store is written."""
    llm.engine.storage.drain()


def _file_llm(path: str, store: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    return LLM(path, enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=store,
               hicache_storage_prefetch_policy="wait_complete", **kw)


def _same(out, want) -> None:
    assert out.outputs[0].token_ids == want.outputs[0].token_ids, "a storage hit changed the tokens"
    torch.testing.assert_close(torch.tensor(sampled_logprobs(out)), torch.tensor(sampled_logprobs(want)),
                               atol=LOGPROB_ATOL, rtol=0)


def test_second_llm_on_the_same_directory_gets_storage_hits(tiny_ckpt, tmp_path):
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=3)
    want = run_one(ref, prompt, 10)
    first = _file_llm(path, str(tmp_path))
    _same(run_one(first, prompt, 10), want)
    _stored(first)
    assert first.engine.storage.stats.writes_queued > 0
    second = _file_llm(path, str(tmp_path))  # a new process's view: empty device and host
    out = run_one(second, prompt, 10)
    assert out.num_cached_tokens == 96, out.metrics
    assert out.metrics["prompt_tokens_from_storage"] == 96 and out.metrics["prompt_tokens_from_host"] == 0
    _same(out, want)
    assert second.engine.storage.num_outstanding == 0


@pytest.mark.parametrize("change", [dict(dtype="bfloat16"), dict(block_size=32)], ids=["dtype", "page_size"])
def test_another_configuration_on_the_same_store_gets_no_hits(tiny_ckpt, tmp_path, change):
    path = tiny_ckpt("llama")
    prompt = _prompt(100, 300, seed=4)
    first = _file_llm(path, str(tmp_path))
    run_one(first, prompt, 2)
    _stored(first)
    other = _file_llm(path, str(tmp_path), **change)
    out = run_one(other, prompt, 2)
    assert out.num_cached_tokens == 0, "a foreign configuration's pages were served"
    assert other.engine.storage.stats.corrupt_values == 0, "keys should differ, not only headers"


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_stored_pages_are_misses_and_outputs_unchanged(tiny_ckpt, tmp_path, damage, kv):
    """A flipped byte or a cut file, in the model dtype's pages or an FP8 cache's."""
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False, kv_cache_dtype=kv)
    prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=5)
    want = run_one(ref, prompt, 6)
    first = _file_llm(path, str(tmp_path), kv_cache_dtype=kv)
    run_one(first, prompt, 1)
    _stored(first)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs)
    assert files, "nothing was stored"
    # Damage the third page's file: the hit must stop before it.
    third = [f for f in files if f.endswith("-full")]
    victim = third[len(third) // 2]
    with open(victim, "r+b") as f:
        data = bytearray(f.read())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
            f.seek(0)
            f.write(data)
        else:
            f.truncate(len(data) // 2)
    second = _file_llm(path, str(tmp_path), kv_cache_dtype=kv)
    out = run_one(second, prompt, 6)
    assert out.num_cached_tokens < 96, "a damaged page was served"
    assert second.engine.storage.stats.corrupt_values + second.engine.storage.backend.stats.errors > 0, \
        "a damaged page was not counted as an error"
    _same(out, want)


def test_v4_prefix_from_storage_equals_no_cache(tmp_path_factory, tmp_path):
    """DeepSeek-V4: whole-history spaces stored page by page, the SWA and compress-state spaces'
    trailing window read back; the hit is exact."""
    with single_thread():
        path = build_v4_checkpoint(str(tmp_path_factory.mktemp("v4st")), sliding_window=40, index_topk=5)
        kw = dict(dtype="float32", block_size=32, max_model_len=256, max_num_seqs=2)
        ref = LLM(path, enable_prefix_caching=False, **kw)
        prompt = _prompt(110, ref.engine.runner.config.vocab_size, seed=6)
        want = run_one(ref, prompt, 12)
        first = _file_llm(path, str(tmp_path), **kw)
        _same(run_one(first, prompt, 12), want)
        _stored(first)
        second = _file_llm(path, str(tmp_path), **kw)
        out = run_one(second, prompt, 12)
        assert out.metrics["prompt_tokens_from_storage"] == 96, out.metrics
        _same(out, want)


def test_prefetch_timeout_and_abort_release_their_reservations(tiny_ckpt, tmp_path):
    """A store that answers slowly: with the timeout policy the request goes ahead without it
    (reservation released, counted); an aborted request's prefetch is released too."""
    path = tiny_ckpt("llama")
    prompt = _prompt(100, 300, seed=7)
    first = _file_llm(path, str(tmp_path))
    run_one(first, prompt, 1)
    _stored(first)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True,
              hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
              hicache_storage_prefetch_policy="timeout")
    storage = llm.engine.storage
    storage.timeout_base, storage.timeout_per_1k = 0.05, 0.0
    slow_get = storage.backend.get

    def slow(keys):
        time.sleep(0.5)
        return slow_get(keys)

    storage.backend.get = slow
    out = run_one(llm, prompt, 2)
    assert storage.stats.prefetches_timed_out == 1 and out.metrics["prompt_tokens_from_storage"] == 0
    assert storage.num_outstanding == 0
    eng = llm.engine
    eng.add_request("gone", {"prompt_token_ids": _prompt(100, 300, seed=8)}, SamplingParams(max_tokens=2))
    assert storage.num_outstanding == 1
    eng.abort_request("gone")
    assert storage.num_outstanding == 0 and storage.stats.prefetches_aborted == 1
    storage.backend.get = slow_get
    _stored(llm)


def test_a_prefetch_that_raises_is_counted_released_and_changes_nothing(tiny_ckpt, tmp_path):
    """A backend bug inside the read (not a counted miss, an exception): the request runs without
    the store, the failure is counted, the reservation is released, the engine goes on."""
    path = tiny_ckpt("llama")
    prompt = _prompt(100, 300, seed=9)
    first = _file_llm(path, str(tmp_path))
    want = run_one(first, prompt, 4)
    _stored(first)
    llm = _file_llm(path, str(tmp_path))
    storage = llm.engine.storage

    def broken(keys):
        raise RuntimeError("backend bug")

    storage.backend.get = broken
    out = run_one(llm, prompt, 4)
    assert storage.stats.prefetches_failed == 1 and storage.num_outstanding == 0
    assert out.metrics["prompt_tokens_from_storage"] == 0 and out.num_cached_tokens == 0
    _same(out, want)


def test_a_request_whose_match_shrank_while_waiting_reads_it_from_storage(tiny_ckpt, tmp_path):
    """On arrival its whole prefix is cached (no read); while it waits, the device and host
    caches are emptied. When the scheduler reaches it, it reads the prefix from the store
    instead of recomputing it."""
    path = tiny_ckpt("llama")
    prompt = _prompt(100, 300, seed=10)
    llm = _file_llm(path, str(tmp_path))
    want = run_one(llm, prompt, 4)
    _stored(llm)
    eng, storage = llm.engine, llm.engine.storage
    eng.add_request("again", {"prompt_token_ids": prompt}, greedy(4))
    assert storage.num_outstanding == 0, "the whole prefix was cached: nothing to read on arrival"
    assert eng.reset_prefix_cache() > 0
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    out = outs[0]
    assert storage.stats.prefetches_restarted == 1
    assert out.metrics["prompt_tokens_from_storage"] == 96, out.metrics
    assert storage.num_outstanding == 0
    _same(out, want)


def _redis_llm(path: str, url: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    return LLM(path, enable_hierarchical_cache=True, hicache_storage_backend="redis",
               hicache_storage_backend_extra_config={"url": url, "socket_timeout": 0.5, "connect_timeout": 0.5},
               hicache_storage_prefetch_policy="wait_complete", **kw)


def test_second_llm_on_the_same_redis_gets_storage_hits(tiny_ckpt, redis_server):
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=9)
    want = run_one(ref, prompt, 10)
    first = _redis_llm(path, redis_server.url)
    _same(run_one(first, prompt, 10), want)
    _stored(first)
    second = _redis_llm(path, redis_server.url)
    out = run_one(second, prompt, 10)
    assert out.metrics["prompt_tokens_from_storage"] == 96, out.metrics
    _same(out, want)


def test_v4_prefix_from_redis_equals_no_cache(tmp_path_factory, redis_server):
    with single_thread():
        path = build_v4_checkpoint(str(tmp_path_factory.mktemp("v4rd")))
        kw = dict(dtype="float32", block_size=32, max_model_len=256, max_num_seqs=2)
        ref = LLM(path, enable_prefix_caching=False, **kw)
        prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=10)
        want = run_one(ref, prompt, 12)
        first = _redis_llm(path, redis_server.url, **kw)
        run_one(first, prompt, 1)
        _stored(first)
        second = _redis_llm(path, redis_server.url, **kw)
        out = run_one(second, prompt, 12)
        assert out.metrics["prompt_tokens_from_storage"] == 96, out.metrics
        _same(out, want)


def test_redis_killed_mid_run_gives_misses_then_hits_again(tiny_ckpt, redis_server):
    """Redis dies: requests are served (misses, counted errors, bounded by the timeouts), outputs
    unchanged; once it is back on the same port, new pages are stored and hit again."""
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    vocab = ref.engine.runner.config.vocab_size
    llm = _redis_llm(path, redis_server.url)
    redis_server.kill()
    prompt = _prompt(100, vocab, seed=11)
    t0 = time.monotonic()
    _same(run_one(llm, prompt, 4), run_one(ref, prompt, 4))
    _stored(llm)
    assert time.monotonic() - t0 < 20, "a dead Redis stalled the engine"
    assert llm.engine.storage.backend.stats.errors + llm.engine.storage.backend.stats.skipped_calls > 0
    redis_server.start()
    time.sleep(1.1)  # past the backend's down back-off
    again = _prompt(100, vocab, seed=12)
    run_one(llm, again, 1)
    _stored(llm)
    fresh = _redis_llm(path, redis_server.url)
    out = run_one(fresh, again, 4)
    assert out.metrics["prompt_tokens_from_storage"] == 96, "no hits after Redis came back"
    _same(out, run_one(ref, again, 4))


def test_pages_read_for_waiting_requests_stay_on_the_host_until_admission(tiny_ckpt, tmp_path):
    """Four requests arrive at once, one runs at a time, and their reads together need more
    host pages than the host tier has. Recorded pages are host-pinned until their request is
    admitted (up to half the host pool), so the reads of the requests queued behind do not
    evict them: the first request runs first and is served its whole prefix from storage. Every
    pin is released (assert_idle), and outputs equal the no-cache run."""
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    vocab = ref.engine.runner.config.vocab_size
    prompts = [_prompt(100, vocab, seed=40 + i) for i in range(4)]  # 6 whole pages each
    want = [run_one(ref, p, 3) for p in prompts]
    first = _file_llm(path, str(tmp_path))
    for p in prompts:
        run_one(first, p, 1)
    _stored(first)
    bpp = sum(first.engine.storage.host_cache.bytes_per_page.values())
    llm = _file_llm(path, str(tmp_path), max_num_seqs=1, hicache_size=16 * bpp)  # 16 host pages, 8 pinnable
    storage = llm.engine.storage
    assert storage.max_pinned_pages == 8
    eng = llm.engine
    pins = []
    pin_host = eng.kv.index.pin_host
    eng.kv.index.pin_host = lambda node: (pins.append(node.depth), pin_host(node))
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, greedy(3))
    storage.wait_reads()  # every read lands before the first step records them, in arrival order
    outs, order = {}, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
                order.append(o.request_id)
    # (Without pins, measured: the later reads evicted q0's pages, q3 ran first, one request
    # recomputed its whole prompt, five reads were restarted.)
    assert pins and pins[0] == 6, f"the first recorded read was not pinned whole: {pins}"
    assert order[0] == "q0", f"the first request lost its read to the ones queued behind it: order {order}"
    # The pinned read is served whole; the others (past the cap of half the host pool) may lose
    # pages to the host eviction of later reads, depending on when each read lands.
    assert outs["q0"].metrics["prompt_tokens_from_storage"] == 96, (
        "pages read for a waiting request were evicted before it was admitted", outs["q0"].metrics)
    assert storage.num_pinned_pages == 0 and storage.num_outstanding == 0
    assert eng.kv.index.num_host_pins == 0
    for i in range(4):
        _same(outs[f"q{i}"], want[i])


# -- a second OS process on the same store ------------------------------------------------------
SECOND_PROCESS = r'''
import json, sys
from hybridkv import LLM, SamplingParams
path, backend, where, prompt = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
kw = dict(hicache_storage_dir=where) if backend == "file" else dict(
    hicache_storage_backend_extra_config={"url": where, "socket_timeout": 0.5, "connect_timeout": 0.5})
llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True,
          hicache_storage_backend=backend, hicache_storage_prefetch_policy="wait_complete", **kw)
out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10, logprobs=0))[0]
c = out.outputs[0]
print("RESULT " + json.dumps({"cached": out.num_cached_tokens, "from_storage": out.metrics["prompt_tokens_from_storage"],
                             "tokens": list(c.token_ids), "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]}))
'''


def _second_process(path: str, backend: str, where: str, prompt: list[int]) -> dict:
    import json
    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SECOND_PROCESS, path, backend, where, json.dumps(prompt)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_second_os_process_on_the_same_store_gets_hits(tiny_ckpt, tmp_path, request, backend):
    """Not a second LLM in this process: a new interpreter (its own fingerprint computation,
    empty device and host tiers) on the directory / Redis the first process wrote."""
    redis_server = request.getfixturevalue("redis_server") if backend == "redis" else None
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=50)
    want = run_one(ref, prompt, 10)
    where = str(tmp_path) if backend == "file" else redis_server.url
    first = _file_llm(path, where) if backend == "file" else _redis_llm(path, where)
    _same(run_one(first, prompt, 10), want)
    _stored(first)
    got = _second_process(path, backend, where, prompt)
    assert got["cached"] == 96 and got["from_storage"] == 96, got
    assert got["tokens"] == want.outputs[0].token_ids, "the second process's storage hit changed the tokens"
    torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(sampled_logprobs(want)),
                               atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("change", [dict(dtype="bfloat16"), dict(block_size=32)], ids=["dtype", "page_size"])
def test_another_configuration_on_the_same_redis_gets_no_hits(tiny_ckpt, redis_server, change):
    path = tiny_ckpt("llama")
    prompt = _prompt(100, 300, seed=51)
    first = _redis_llm(path, redis_server.url)
    run_one(first, prompt, 2)
    _stored(first)
    assert first.engine.storage.stats.writes_queued > 0
    other = _redis_llm(path, redis_server.url, **change)
    out = run_one(other, prompt, 2)
    assert out.num_cached_tokens == 0, "a foreign configuration's pages were served from Redis"
    assert other.engine.storage.stats.corrupt_values == 0, "keys should differ, not only headers"
    assert other.engine.storage.backend.stats.errors == 0


def test_a_corrupted_redis_value_is_a_miss_and_the_output_is_unchanged(tiny_ckpt, redis_server, caplog):
    """Flip one byte of one stored value inside Redis itself: the read of that page is a miss
    (counted), the hit stops before it, and the tokens are those of the no-cache run."""
    import redis
    path = tiny_ckpt("llama")
    ref = LLM(path, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompt = _prompt(100, ref.engine.runner.config.vocab_size, seed=52)
    want = run_one(ref, prompt, 6)
    first = _redis_llm(path, redis_server.url)
    run_one(first, prompt, 1)
    _stored(first)
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(client.keys("*"))
    assert len(keys) == 6, f"expected the prompt's 6 whole pages in Redis, found {len(keys)}"
    victim = keys[3]
    value = bytearray(client.get(victim))
    value[len(value) // 2] ^= 0xFF
    client.set(victim, bytes(value))
    client.close()
    second = _redis_llm(path, redis_server.url)
    with caplog.at_level(logging.WARNING, logger="hybridkv.block_manager"):
        out = run_one(second, prompt, 6)
    assert out.num_cached_tokens < 96, "a corrupted Redis value was served"
    assert second.engine.storage.stats.corrupt_values == 1, "the corrupted value was not counted"
    logged = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(logged) == 1 and victim.decode().split(":", 1)[1] in logged[0], f"the key was not logged: {logged}"
    _same(out, want)


def test_best_effort_prefetch_admits_without_waiting_for_the_read(tiny_ckpt, tmp_path):
    """best_effort: the request goes as soon as the scheduler reaches it; a read still running
    then is released (its reservation back to zero) and the prompt is computed; a read that
    finished first is used. Outputs are identical either way."""
    path = tiny_ckpt("llama")
    prompt = _prompt(100, 300, seed=53)
    first = _file_llm(path, str(tmp_path))
    want = run_one(first, prompt, 4)
    _stored(first)
    llm = LLM(path, dtype="float32", max_model_len=256, enable_hierarchical_cache=True,
              hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
              hicache_storage_prefetch_policy="best_effort")
    storage = llm.engine.storage
    slow_get = storage.backend.get

    def slow(keys):
        time.sleep(3.0)
        return slow_get(keys)

    storage.backend.get = slow
    t0 = time.monotonic()
    out = run_one(llm, prompt, 4)
    assert time.monotonic() - t0 < 2.5, "best_effort waited for the read"
    assert out.metrics["prompt_tokens_from_storage"] == 0 and storage.num_outstanding == 0
    _same(out, want)
    storage.backend.get = slow_get
    other = _prompt(100, 300, seed=54)  # a prompt the first engine stores now
    run_one(first, other, 1)
    _stored(first)
    eng = llm.engine
    eng.add_request("fast", {"prompt_token_ids": other}, greedy(2))
    assert storage.num_outstanding == 1
    # The read finishes before the first step (the released slow read runs first on the store's
    # one I/O thread).
    storage.wait(longest=10)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert outs[0].metrics["prompt_tokens_from_storage"] == 96, outs[0].metrics
    assert storage.num_outstanding == 0


def test_aborting_a_waiting_request_releases_its_host_pin(tiny_ckpt, tmp_path):
    """A request whose read was recorded and pinned waits behind a running one (max_num_seqs=1);
    aborted while it waits, its pin goes back (pinned pages 0, no pin left in the index) and the
    pages become ordinary host-cache pages."""
    path = tiny_ckpt("llama")
    prompts = [_prompt(100, 300, seed=70 + i) for i in range(2)]
    first = _file_llm(path, str(tmp_path))
    for p in prompts:
        run_one(first, p, 1)
    _stored(first)
    llm = _file_llm(path, str(tmp_path), max_num_seqs=1)
    eng, storage = llm.engine, llm.engine.storage
    eng.add_request("running", {"prompt_token_ids": _prompt(20, 300, seed=72)}, greedy(50))
    eng.step()  # it holds the only slot
    eng.add_request("waiting", {"prompt_token_ids": prompts[1]}, greedy(2))
    storage.wait_reads()
    eng.step()  # records the read: pinned, but no slot to admit it
    assert storage.num_pinned_pages == 6 and eng.kv.index.num_host_pins == 1
    eng.abort_request("waiting")
    assert storage.num_pinned_pages == 0 and eng.kv.index.num_host_pins == 0 and storage.num_outstanding == 0
    eng.abort_request("running")
    eng.kv.check_invariants()


def test_the_file_store_defaults_to_the_cache_directory(tiny_ckpt, tmp_path, monkeypatch):
    """Without hicache_storage_dir the file store lives under HYBRIDKV_CACHE_DIR, beside the
    demo model, so one variable moves everything hybridkv writes."""
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=128, enable_hierarchical_cache=True,
              hicache_storage_backend="file")
    assert llm.engine.storage.backend.root == str(tmp_path / "cache" / "kv_store")
