"""Prometheus metrics of one server, with vLLM's metric names under a `hybridkv:` prefix.

Each app gets its own CollectorRegistry (never prometheus_client's global default), so several
servers in one process (tests) do not collide and nothing is module-level mutable state.

Two sources:
- per-request latencies (TTFT, inter-token latency, time per output token, e2e, queue time) and
  request_success{finished_reason} are observed by the serving layer as outputs reach the HTTP
  handler, i.e. the latency a client actually sees;
- engine state (running/waiting, KV usage per space, token/prefix-cache/preemption counters) is
  read at scrape time from the engine's published snapshot, so a scrape never waits on a step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from hybridkv.engine.async_llm_engine import EngineSnapshot
from hybridkv.engine.outputs import RequestOutput
from hybridkv.entrypoints.openai.gc_pauses import GcPauses

PREFIX = "hybridkv:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket edges (v1/metrics/loggers.py), so dashboards built for vLLM read the same.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]


class _EngineCollector(Collector):
    """Gauges and counters read from the engine snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str) -> None:
        self._snapshot = snapshot
        self._model = model_name

    def collect(self) -> Iterable[Metric]:
        s = self._snapshot()
        m = [self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled (new or preempted).", s.num_waiting)
        usage = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                  "Fraction of a KV space's pages held by requests (1 = full).",
                                  labels=["model_name", "space"])
        pages = GaugeMetricFamily(PREFIX + "kv_cache_pages", "Pages of a KV space by state.",
                                  labels=["model_name", "space", "state"])
        for name, sp in s.spaces.items():
            usage.add_metric([self._model, name], sp.usage)
            for state, n in (("free", sp.num_free), ("cached", sp.num_cached), ("in_use", sp.num_in_use)):
                pages.add_metric([self._model, name, state], n)
        yield usage
        yield pages
        if s.kv_cache_bytes:
            allocated = GaugeMetricFamily(PREFIX + "kv_cache_bytes",
                                          "Bytes allocated for the KV cache by tier (device, host) and space.",
                                          labels=["model_name", "tier", "space"])
            for tier, spaces in s.kv_cache_bytes.items():
                for name, n in spaces.items():
                    allocated.add_metric([self._model, tier, name], n)
            yield allocated
        yield counter("prompt_tokens", "Prompt tokens received.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        by_space = CounterMetricFamily(PREFIX + "prefix_cache_hits_by_space",
                                       "Prompt tokens whose data a block space served from the prefix cache.",
                                       labels=["model_name", "space"])
        for name, n in s.prefix_cache_hits_per_space.items():
            by_space.add_metric([self._model, name], n)
        yield by_space
        yield counter("num_preemptions", "Preemptions of running sequences.", s.num_preemptions)
        sp = s.speculative
        if sp:  # speculative decoding (n-gram drafts)
            yield counter("spec_decode_num_drafts", "Draft chunks verified.", sp["spec_drafts"])
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", sp["spec_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", sp["spec_accepted_tokens"])
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted at each draft position.",
                                          labels=["model_name", "position"])
            for i, n in enumerate(sp["spec_accepted_per_position"]):
                per_pos.add_metric([self._model, str(i)], n)
            yield per_pos
        yield gauge("prefix_cache_locks", "Prefix-cache locks held by requests (0 when idle).", s.num_lock_receipts)
        if s.max_queued_requests is not None:
            yield gauge("max_queued_requests", "Sequences that may wait for admission before adds get 503.",
                        s.max_queued_requests)
        yield counter("requests_rejected_queue_full", "Requests refused with 503 because the queue was full.",
                      s.num_rejected_queue_full)
        so = s.structured_outputs
        yield counter("structured_output_requests", "Requests with an output constraint (structured outputs).",
                      so.requests)
        compile_time = SummaryMetricFamily(PREFIX + "structured_output_compile_seconds",
                                           "Grammar compile time on the compile worker (cache misses).",
                                           labels=["model_name"])
        compile_time.add_metric(m, so.compiles, so.compile_seconds)
        yield compile_time
        yield counter("structured_output_compile_cache_hits", "Constraints found compiled in the grammar cache.",
                      so.cache_hits)
        yield counter("structured_output_compile_failures", "Constraints that could not be compiled (400s).",
                      so.compile_failures)
        if s.host_pages:  # the host tier (HiCache L2) is on
            host = GaugeMetricFamily(PREFIX + "host_cache_pages", "Host-tier pages of a KV space by state.",
                                     labels=["model_name", "space", "state"])
            for name, (used, total) in s.host_pages.items():
                host.add_metric([self._model, name, "used"], used)
                host.add_metric([self._model, name, "free"], total - used)
            yield host
            yield counter("prefix_cache_hits_host", "Prompt tokens served by a load-back from the host tier.",
                          s.prefix_cache_hits_host)
            yield counter("host_load_back_bytes", "Bytes copied from the host tier to the device.", s.load_back_bytes)
            yield counter("host_write_back_bytes", "Bytes copied from the device to the host tier.", s.write_back_bytes)
            yield counter("host_transfer_seconds", "Seconds spent copying between the device and host tiers.",
                          s.tier_transfer_seconds)
            yield counter("swap_outs", "Preempted requests whose pages were written to the host tier.", s.num_swap_outs)
            yield counter("swap_ins", "Resumed requests that loaded pages back from the host tier.", s.num_swap_ins)
        if s.storage:  # the storage tier (HiCache L3) is on
            st = s.storage
            yield gauge("storage_prefetch_outstanding", "Prefetch reservations held (0 when idle).",
                        st["prefetch_outstanding"])
            yield gauge("storage_prefetch_pinned_pages",
                        "Host pages read from storage and held for waiting requests (0 when idle).",
                        st["prefetch_pinned_pages"])
            outcomes = CounterMetricFamily(PREFIX + "storage_prefetches", "Storage prefetches by outcome.",
                                           labels=["model_name", "outcome"])
            for outcome in ("started", "completed", "timed_out", "aborted", "failed"):
                outcomes.add_metric([self._model, outcome], st[f"prefetches_{outcome}"])
            yield outcomes
            yield counter("storage_prefetch_pages", "Pages recorded from the store into the host tier.",
                          st["prefetch_pages"])
            yield counter("storage_corrupt_values", "Stored values rejected (header or checksum mismatch).",
                          st["corrupt_values"])
            yield counter("storage_writes", "Pages handed to the store.", st["writes_queued"])
            yield counter("storage_writes_dropped", "Pages not written (queue full or failed put).",
                          st["writes_dropped"])
            for key, doc in (("hits", "Keys the store returned."), ("misses", "Keys the store did not have."),
                             ("exists_keys_found", "Pages a lookup found in the store."),
                             ("exists_keys_missing", "Pages a lookup did not find (absent, evicted, or the store "
                                                     "did not answer)."),
                             ("errors", "Store operations that failed (counted as misses or dropped writes)."),
                             ("bytes_read", "Bytes read from the store."), ("bytes_written", "Bytes written to the store."),
                             ("get_seconds", "Seconds in store reads."), ("put_seconds", "Seconds in store writes.")):
                if f"backend_{key}" in st:
                    yield counter(f"storage_{key}", doc, st[f"backend_{key}"])
        if s.hisparse:  # HiSparse is on
            hs = s.hisparse
            yield counter("hisparse_lookups", "C4 entries the indexer selected in decode (per layer).", hs["lookups"])
            yield counter("hisparse_hits", "Of them, found in the request's hot buffer.", hs["hits"])
            yield counter("hisparse_loaded_entries", "Selected entries copied from the host mirror.", hs["loaded"])
            yield counter("hisparse_loaded_bytes", "Bytes copied from the host mirror into hot buffers.",
                          hs["loaded_bytes"])
            yield counter("hisparse_inserted_entries", "New and hand-off entries written into hot buffers.",
                          hs["inserted"])
            yield gauge("hisparse_hot_buffer_rows", "Hot-buffer rows held by decoding requests.", hs["rows_in_use"])
            yield gauge("hisparse_mirror_pages", "Pages of the C4 host mirror held (in use or cached).",
                        hs["mirror_pages_in_use"])


class _GcCollector(Collector):
    """The process's garbage-collector pauses (gc_pauses.py), read at scrape time."""

    def __init__(self, pauses: GcPauses, model_name: str) -> None:
        self._pauses, self._model = pauses, model_name

    def collect(self) -> Iterable[Metric]:
        p = self._pauses
        n = CounterMetricFamily(PREFIX + "gc_collections", "Garbage collections, by generation.",
                                labels=["model_name", "generation"])
        t = CounterMetricFamily(PREFIX + "gc_pause_seconds", "Seconds every thread stood still in "
                                "garbage collection, by generation.", labels=["model_name", "generation"])
        for gen in range(3):
            n.add_metric([self._model, str(gen)], p.collections[gen])
            t.add_metric([self._model, str(gen)], p.seconds[gen])
        longest = GaugeMetricFamily(PREFIX + "gc_longest_pause_seconds", "The longest garbage-collection pause.",
                                    labels=["model_name"])
        longest.add_metric([self._model], p.longest_seconds)
        return [n, t, longest]


class ServerMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot],
                 limits: dict[str, int] | None = None, gc_pauses: GcPauses | None = None,
                 parallel_layout: dict[str, str] | None = None) -> None:
        """limits: the server's admission limits by name (e.g. max_seqs_per_request), exported
        as hybridkv:admission_limit{limit=...} so dashboards can read them next to the counters.
        parallel_layout: how the model is split (LLMEngine.parallel_layout), exported as labels of
        hybridkv:parallel_layout = 1, so one query tells which deployments run over several nodes."""
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: list[float]):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time from request arrival to its first token.",
                         _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between two consecutive outputs of a request.",
                        _ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per sequence.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from request arrival to its last output.",
                        _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time a request waited before first scheduled.",
                               _REQUEST_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Finished sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        r.register(_EngineCollector(snapshot, model_name))
        if gc_pauses is not None:
            r.register(_GcCollector(gc_pauses, model_name))
        if limits:
            limit = Gauge(PREFIX + "admission_limit", "Admission limits of this server.", ["model_name", "limit"],
                          registry=r)
            for name, value in limits.items():
                limit.labels(model_name, name).set(value)
        if parallel_layout:
            names = sorted(parallel_layout)
            layout = Gauge(PREFIX + "parallel_layout", "How the model is split over processes and machines "
                           "(always 1; the labels say it).", ["model_name", *names], registry=r)
            layout.labels(model_name, *(parallel_layout[n] for n in names)).set(1)
        self._rejected = Counter(PREFIX + "requests_rejected", "Requests refused at admission, by reason.",
                                 ["model_name", "reason"], registry=r)

    def request_rejected(self, reason: str) -> None:
        """A request refused before it reached the engine (e.g. reason="too_many_sequences")."""
        self._rejected.labels(self.model_name, reason).inc()

    def request_finished(self, reason: str, count: int = 1) -> None:
        self._success.labels(self.model_name, reason).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self) -> "RequestTracker":
        return RequestTracker(self)


@dataclass
class RequestTracker:
    """Latency bookkeeping for one HTTP request (which may hold several engine requests)."""

    metrics: ServerMetrics
    start: float = field(default_factory=time.monotonic)
    first_output: float | None = None
    last_output: float | None = None
    _first_by_seq: dict[tuple[str, int], float] = field(default_factory=dict)
    _tokens_by_seq: dict[tuple[str, int], int] = field(default_factory=dict)
    _done: bool = False

    def on_output(self, out: RequestOutput) -> None:
        if not any(o.token_ids for o in out.outputs):
            return
        now = time.monotonic()
        if self.first_output is None:
            self.first_output = now
            self.metrics.ttft.observe(now - self.start)
        elif self.last_output is not None:
            self.metrics.itl.observe(now - self.last_output)
        self.last_output = now
        for o in out.outputs:
            key = (out.request_id, o.index)
            self._first_by_seq.setdefault(key, now)
            self._tokens_by_seq[key] = self._tokens_by_seq.get(key, 0) + len(o.token_ids)
            if o.finish_reason is not None:
                self.metrics.request_finished(o.finish_reason)
                n = self._tokens_by_seq[key]
                if n > 1:
                    self.metrics.tpot.observe((now - self._first_by_seq[key]) / (n - 1))
        if out.finished:
            m = out.metrics or {}
            arrival, scheduled = m.get("arrival_time"), m.get("first_scheduled_time")
            if arrival is not None and scheduled is not None:
                self.metrics.queue_time.observe(max(0.0, scheduled - arrival))

    def on_complete(self) -> None:
        if not self._done:
            self._done = True
            self.metrics.e2e.observe(time.monotonic() - self.start)

    def on_abort(self, num_sequences: int) -> None:
        if not self._done and num_sequences:
            self._done = True
            self.metrics.request_finished("abort", num_sequences)
