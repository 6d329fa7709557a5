"""/metrics: Prometheus text that prometheus-client's parser reads, vLLM's names under `hybridkv:`,
and counters that move with traffic."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from server_harness import MODEL

PROMPT = "hybrid attention keeps a sliding window and compressed entries " * 2


def scrape(srv) -> dict[tuple[str, tuple], float]:
    status, headers, raw = srv.request("GET", "/metrics", auth=False)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    labels = {"model_name": MODEL, **labels}
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_counters_move(srv, client):
    before = scrape(srv)
    for name in ("hybridkv:num_requests_running", "hybridkv:num_requests_waiting"):
        assert (name, (("model_name", MODEL),)) in before
    assert ("hybridkv:kv_cache_usage_perc", (("model_name", MODEL), ("space", "full"))) in before

    for _ in range(2):  # the second run hits the first's cached pages
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True}))
    after = scrape(srv)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("hybridkv:generation_tokens_total") == 12
    assert delta("hybridkv:prompt_tokens_total") > 0
    assert delta("hybridkv:prefix_cache_queries_total") > 0
    assert delta("hybridkv:prefix_cache_hits_total") > 0
    assert delta("hybridkv:prefix_cache_hits_by_space_total", space="full") == delta("hybridkv:prefix_cache_hits_total")
    assert delta("hybridkv:request_success_total", finished_reason="length") == 3
    assert delta("hybridkv:time_to_first_token_seconds_count") == 3
    assert delta("hybridkv:e2e_request_latency_seconds_count") == 3
    assert delta("hybridkv:request_queue_time_seconds_count") == 3
    assert delta("hybridkv:inter_token_latency_seconds_count") == 9  # 3 requests x (4 - 1) gaps
    assert delta("hybridkv:request_time_per_output_token_seconds_count") == 3
    assert value(after, "hybridkv:num_preemptions_total") >= 0
    pages = {state: value(after, "hybridkv:kv_cache_pages", space="full", state=state)
             for state in ("free", "cached", "in_use")}
    assert pages["cached"] > 0  # the prompts' pages stay in the prefix cache


def test_two_apps_in_one_process_have_separate_registries(srv, tiny_ckpt):
    from server_harness import launch

    ours_before = value(scrape(srv), "hybridkv:time_to_first_token_seconds_count")
    other = launch(tiny_ckpt("llama"), api_key=None)
    try:
        other.client().completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert value(scrape(other), "hybridkv:time_to_first_token_seconds_count") == 1
        assert value(scrape(srv), "hybridkv:time_to_first_token_seconds_count") == ours_before
        other.engine.check_idle()
    finally:
        other.stop()


def test_admission_limits_and_rejections_are_exported(srv):
    before = scrape(srv)
    assert value(before, "hybridkv:admission_limit", limit="max_seqs_per_request") == 1024
    assert value(before, "hybridkv:admission_limit", limit="max_connections") > 0
    assert value(before, "hybridkv:prefix_cache_locks") == 0
    status, _, _ = srv.request("POST", "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 64, "n": 32,
                                                           "max_tokens": 1})
    assert status == 400
    after = scrape(srv)
    assert value(after, "hybridkv:requests_rejected_total", reason="too_many_sequences") - value(
        before, "hybridkv:requests_rejected_total", reason="too_many_sequences") == 1


def test_the_parallel_layout_is_exported(srv):
    """One engine process, no collectives: hybridkv:parallel_layout says so in its labels (the
    tensor-parallel server's is checked in tests/entrypoints/test_serve_tensor_parallel.py)."""
    layout = {"tensor_parallel_size": "1", "nnodes": "1", "backend": "none", "expert_parallel": "false"}
    assert value(scrape(srv), "hybridkv:parallel_layout", **layout) == 1
    assert srv.engine.parallel_layout == layout


def test_host_tier_metrics_move_with_a_load_back(tiny_ckpt):
    """With --enable-hierarchical-cache: host pool usage per space, host hit tokens, load-back and
    write-back bytes and copy seconds are exported, and move when a prefix comes back from the host."""
    from server_harness import launch

    other = launch(tiny_ckpt("llama"), api_key=None, enable_hierarchical_cache=True)
    try:
        c = other.client()
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
        mid = scrape(other)
        assert value(mid, "hybridkv:host_cache_pages", space="full", state="used") > 0  # write-through
        assert value(mid, "hybridkv:host_write_back_bytes_total") > 0

        def evict(engine):
            for name, space in engine.kv.spaces.items():
                engine.kv.index.evict(name, space.num_pages)
            engine.executor.flush_copies()

        other.engine.call_threadsafe(evict).result(30)
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
        after = scrape(other)
        assert value(after, "hybridkv:prefix_cache_hits_host_total") > 0
        assert value(after, "hybridkv:host_load_back_bytes_total") > 0
        assert value(after, "hybridkv:host_transfer_seconds_total") > 0
        assert value(after, "hybridkv:swap_outs_total") == 0
        c.close()
        other.engine.check_idle()
    finally:
        other.stop()


def test_gc_pauses_are_timed_while_the_app_runs(srv):
    """Invariant: every garbage collection while the server runs is counted and timed on
    /metrics (a full one can stall every stream); the monitor leaves gc.callbacks on cleanup."""
    import gc

    before = scrape(srv)
    gc.collect()  # a full collection, on this thread: the callback is process-wide
    after = scrape(srv)
    full = value(after, "hybridkv:gc_collections_total", generation="2") - value(
        before, "hybridkv:gc_collections_total", generation="2")
    assert full >= 1
    paused = value(after, "hybridkv:gc_pause_seconds_total", generation="2") - value(
        before, "hybridkv:gc_pause_seconds_total", generation="2")
    assert paused > 0
    assert value(after, "hybridkv:gc_longest_pause_seconds") >= paused / full


def test_gc_monitor_uninstalls_and_freeze_moves_the_heap_out_of_collections():
    import gc

    from hybridkv.entrypoints.openai.gc_pauses import GcPauses, freeze_startup_heap

    pauses = GcPauses()
    pauses.install()
    pauses.install()  # idempotent: one callback
    gc.collect()
    assert pauses.collections[2] == 1
    pauses.uninstall()
    gc.collect()
    assert pauses.collections[2] == 1 and pauses._callback not in gc.callbacks
    try:
        frozen = freeze_startup_heap()
        assert frozen > 1000 and len(gc.get_objects(generation=2)) < frozen
    finally:
        gc.unfreeze()
