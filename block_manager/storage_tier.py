"""StorageTier: the HiCache L3 controller (prefetch from a store into host pages, write-behind).

Reads: when a new request's prefix ends on the device/host before its prompt does, a background
thread asks the store for the following pages (`exists`, then `get`) and decodes them. The
request waits in the queue meanwhile (never the step loop), as the prefetch policy says:
  best_effort    it is admitted whenever the scheduler gets to it; whatever arrived by then counts
  wait_complete  it waits until the read finished
  timeout        it waits until the read finished or base + per-1k-tokens x prompt length passed
The engine thread then records what arrived as host-only nodes of the shadow index (host pages
filled from the bytes), so the ordinary match -> load-back path serves them. A waiting request
holds no pages, so while it waits other requests may evict what it matched on arrival (its
previous turn, still on the device then, or the pages its prefetch recorded); when the scheduler
reaches it and its match has shrunk, it reads again from where the match now ends (at most
MAX_REFETCHES times: a request is never starved by its own cache). Pages a read recorded are
host-pinned until their request is admitted (SGLang protects a prefetch's host pages the same
way): host eviction -- the reads of requests queued behind it, write-through -- skips them;
pins cover at most half the host pool, and no device page. A reservation is the read of one
request and its pin; it is released on every exit (admitted, aborted, timed out, store error)
and `num_outstanding` is its gauge.

Writes: every page that gets a host copy is also stored (the host tier's write policy decides
which pages those are). After the engine ran a step's copies it reads those host pages' bytes
and a background thread puts them, batched; a failed write is dropped and counted.

Never a wrong token: a value whose header (fingerprint, space, size) or checksum does not match
is a miss, counted as an error. One background thread does every store call, so backends need
no locking and reads and writes of one key are ordered.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Protocol, Sequence

from hybridkv.block_manager.kv_plan import TierTransfers
from hybridkv.block_manager.page_keys import next_chain, root_chain, storage_key
from hybridkv.block_manager.storage import page_record
from hybridkv.block_manager.storage.backend import RateLimitedWarnings, StorageBackend
from hybridkv.block_manager.storage.kv_fingerprint import KVFingerprint

if TYPE_CHECKING:
    from hybridkv.block_manager.kv_cache_manager import KVCacheManager

logger = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
TIMEOUT_BASE_S = 1.0  # SGLang's prefetch_timeout_base
TIMEOUT_PER_1K_TOKENS_S = 0.25  # SGLang's prefetch_timeout_per_ki_token
MAX_REFETCHES = 2  # reads started again for one request whose match shrank while it waited
MAX_PENDING_WRITES = 256  # write batches queued for the store; more are dropped (counted)


class HostPages(Protocol):
    """The host tier's page bytes (the executor's host buffers): what the store reads and fills."""

    bytes_per_page: dict[str, int]

    def read_pages(self, space: str, pages: list[int]) -> list[bytes]: ...

    def write_pages(self, space: str, pages: list[int], payloads: list[bytes]) -> None: ...


@dataclass
class StorageTierStats:
    prefetches_started: int = 0
    prefetches_completed: int = 0  # read finished and was recorded (pages or none)
    prefetches_timed_out: int = 0
    prefetches_aborted: int = 0
    prefetches_failed: int = 0  # the read raised (a backend bug: backends count their own errors)
    prefetches_restarted: int = 0  # reads started again at admission: the match shrank while waiting
    prefetch_pages: int = 0  # pages recorded from the store
    corrupt_values: int = 0  # values whose header or checksum did not match (misses)
    writes_queued: int = 0  # pages handed to the store
    writes_dropped: int = 0  # pages not written (queue full, or the put failed)


@dataclass
class _Prefetch:
    request_id: str
    token_ids: list[int]
    namespace: Hashable
    first_page: int
    future: concurrent.futures.Future
    deadline: float | None
    recorded: int = 0  # tokens it recorded (the per-request "from storage" report)
    done: bool = False
    pinned: object | None = None  # the index node its recorded chain ends at, host-pinned until release
    pinned_pages: int = 0


@dataclass
class _ReadResult:
    num_pages: int = 0
    pages: dict[str, list[bytes | None]] = field(default_factory=dict)


class StorageTier:
    def __init__(self, backend: StorageBackend, kv: KVCacheManager, host_cache: HostPages,
                 fingerprint: KVFingerprint, prefetch_policy: str = "timeout",
                 timeout_base: float = TIMEOUT_BASE_S, timeout_per_1k_tokens: float = TIMEOUT_PER_1K_TOKENS_S) -> None:
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown hicache_storage_prefetch_policy {prefetch_policy!r}; "
                             f"choose one of {list(PREFETCH_POLICIES)}")
        if kv.host_tier is None or kv.index is None:
            raise ValueError("a storage tier needs the host tier (enable_hierarchical_cache=True)")
        self.backend, self.kv, self.host_cache, self.fp = backend, kv, host_cache, fingerprint
        self.policy = prefetch_policy
        self.timeout_base, self.timeout_per_1k = timeout_base, timeout_per_1k_tokens
        self.P = kv.page_size
        self.whole = [n for n, s in kv.specs.items() if not s.windowed]
        self.windowed = [n for n, s in kv.specs.items() if s.windowed]
        self.stats = StorageTierStats()
        self._warnings = RateLimitedWarnings(logger)
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridkv-storage")
        self._prefetches: dict[str, _Prefetch] = {}
        self._pending_writes: list[concurrent.futures.Future] = []
        self._recorded_tokens: dict[str, int] = {}  # request id -> tokens its prefetches recorded
        # request id -> pages it could hit so far (its match on arrival, or what a read recorded),
        # and how many reads were restarted for it; both dropped on admission / abort.
        self._known_pages: dict[str, int] = {}
        self._restarts: dict[str, int] = {}
        # Pages a read recorded stay on the host until their request is admitted (host pins),
        # up to half the smallest host pool: the rest of the pool stays free for the running
        # requests' write-through and swaps, so pins can delay but never starve them.
        self.max_pinned_pages = min(p.num_pages for p in kv.host_tier.pools.values()) // 2
        self.num_pinned_pages = 0
        kv.host_tier.storage_writes = True

    def snapshot(self) -> dict[str, float]:
        """Counters for /metrics (the backend's and this controller's), one flat dict."""
        b = self.backend.stats
        out = {f"backend_{k}": float(v) for k, v in vars(b).items() if isinstance(v, (int, float))}
        out.update({k: float(v) for k, v in vars(self.stats).items()})
        out["prefetch_outstanding"] = float(self.num_outstanding)
        out["prefetch_pinned_pages"] = float(self.num_pinned_pages)
        return out

    @property
    def num_outstanding(self) -> int:
        """Prefetch reservations held (0 when idle)."""
        return len(self._prefetches)

    # -- reads ------------------------------------------------------------------------------------
    def begin(self, request_id: str, token_ids: Sequence[int], namespace: Hashable = None) -> None:
        """Start reading what the store holds past the request's device/host prefix."""
        max_pages = (len(token_ids) - 1) // self.P
        m = self.kv.index.match(token_ids, namespace, max_pages=max_pages, touch=False)
        self._known_pages[request_id] = len(m.nodes)
        self._start(request_id, token_ids, namespace, m.nodes, max_pages)

    def _start(self, request_id: str, token_ids: Sequence[int], namespace: Hashable, nodes: list,
               max_pages: int) -> None:
        P = self.P
        d = len(nodes)
        if d >= max_pages:
            return
        chain = nodes[-1].chain if d else root_chain(self.fp.seed, namespace)
        chains = []
        for i in range(d, max_pages):
            chain = next_chain(chain, token_ids[i * P : (i + 1) * P])
            chains.append(chain)
        deadline = None
        if self.policy == "timeout":
            deadline = time.monotonic() + self.timeout_base + self.timeout_per_1k * len(token_ids) / 1000
        future = self._io.submit(self._read, d, chains)
        self._prefetches[request_id] = _Prefetch(request_id, list(token_ids), namespace, d, future, deadline)
        self.stats.prefetches_started += 1

    def ready(self, request_id: str, token_ids: Sequence[int], namespace: Hashable = None) -> bool:
        """The scheduler is about to admit this request: whether it may go now (the prefetch
        policy). If its match shrank since it arrived (evicted while it waited), a read from the
        new end starts first, and the request waits for it as for any prefetch."""
        pf = self._prefetches.get(request_id)
        known = self._known_pages.get(request_id, 0)
        if (pf is None or pf.done) and known and self._restarts.get(request_id, 0) < MAX_REFETCHES:
            max_pages = (len(token_ids) - 1) // self.P
            m = self.kv.index.match(token_ids, namespace, max_pages=max_pages, touch=False)
            if len(m.nodes) < known:
                self._restarts[request_id] = self._restarts.get(request_id, 0) + 1
                self.stats.prefetches_restarted += 1
                self._release(request_id)
                self._start(request_id, token_ids, namespace, m.nodes, max_pages)
        return not self.blocks(request_id)

    def _decode(self, space: str, blob: bytes | None, key: str) -> bytes | None:
        if blob is None:
            return None
        payload = page_record.decode(blob, self.fp.spaces[space], space)
        if payload is None or len(payload) != self.host_cache.bytes_per_page[space]:
            self.stats.corrupt_values += 1
            # Rate-limited: a store full of another configuration's pages must not flood the log.
            self._warnings.warn("corrupt", f"hicache storage: value of key {key} rejected (header, "
                                           f"fingerprint or checksum mismatch, or wrong size): read as a miss")
            return None
        return payload

    def _read(self, first_page: int, chains: list[bytes]) -> _ReadResult:
        """Background thread: the longest run of pages the store holds intact after first_page
        (every whole-history page, and the trailing window of the windowed spaces)."""
        lead = self.whole or self.windowed  # all-windowed models (Mistral) need every page
        keys = [storage_key(c, s) for c in chains for s in lead]
        n = self.backend.exists(keys) // len(lead)
        if n == 0:
            return _ReadResult()
        blobs = self.backend.get(keys[: n * len(lead)])
        pages: dict[str, list[bytes | None]] = {s: [] for s in lead}
        for j in range(n):
            row = [self._decode(s, blobs[j * len(lead) + k], keys[j * len(lead) + k]) for k, s in enumerate(lead)]
            if any(r is None for r in row):
                n = j
                break
            for s, r in zip(lead, row):
                pages[s].append(r)
        for s in lead:
            del pages[s][n:]
        if lead is self.windowed or not self.windowed:
            return _ReadResult(n, pages)
        # Windowed spaces: only the trailing window before the end is read; shorten the run until
        # that window is intact (usually the first try).
        while n > 0:
            end = first_page + n
            got: dict[str, list[bytes | None]] = {}
            ok = True
            for s in self.windowed:
                lo = max(first_page, self.kv.index.first_window_page(s, end))
                idx = list(range(lo - first_page, n))
                wkeys = [storage_key(chains[j], s) for j in idx]
                vals = [self._decode(s, b, k) for b, k in zip(self.backend.get(wkeys), wkeys)]
                if any(v is None for v in vals):
                    ok = False
                    break
                got[s] = [None] * (lo - first_page) + vals
            if ok:
                for s in lead:
                    del pages[s][n:]
                pages.update(got)
                return _ReadResult(n, pages)
            n -= 1
        return _ReadResult()

    def poll(self) -> None:
        """Engine thread, once per step: record finished reads; drop timed-out ones."""
        now = time.monotonic()
        for rid, pf in list(self._prefetches.items()):
            if pf.done:
                continue
            if pf.future.done():
                self._record(pf)
            elif pf.deadline is not None and now > pf.deadline:
                self.stats.prefetches_timed_out += 1
                self._release(rid)

    def wait_reads(self, timeout: float = 30.0) -> None:
        """Block until every outstanding read has finished (tests and benchmarks that need the
        reads to land before a step; the engine itself never blocks on them)."""
        futures = [pf.future for pf in self._prefetches.values() if not pf.done]
        concurrent.futures.wait(futures, timeout=timeout)

    def wait(self, longest: float = 0.01) -> None:
        """The engine's idle wait while every waiting request waits for its read: block until
        one read finishes or the nearest prefetch deadline passes (at most `longest` seconds),
        instead of spinning the step loop."""
        live = [pf for pf in self._prefetches.values() if not pf.done]
        if not live or any(pf.future.done() for pf in live):
            return  # nothing to wait for, or a finished read for the next poll to record
        now = time.monotonic()
        timeout = min([longest] + [pf.deadline - now for pf in live if pf.deadline is not None])
        if timeout > 0:
            concurrent.futures.wait([pf.future for pf in live], timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _record(self, pf: _Prefetch) -> None:
        pf.done = True
        try:
            result = pf.future.result()
        except Exception:  # noqa: BLE001 - a backend bug must not take the engine down
            logger.exception("storage prefetch for %s failed", pf.request_id)
            self.stats.prefetches_failed += 1
            return
        self.stats.prefetches_completed += 1
        if not result.num_pages:
            return
        index = self.kv.index
        P = self.P
        # Hold the path the pages continue while host pages are found (host eviction may run).
        m = index.match(pf.token_ids, pf.namespace, max_pages=pf.first_page, touch=False)
        if len(m.nodes) != pf.first_page:
            return  # the prefix it continues is gone: nothing to attach the pages to
        receipt = index.lock(m.nodes[-1]) if m.nodes else None
        try:
            host_pages: dict[str, list[int | None]] = {}
            n = result.num_pages
            for s, vals in result.pages.items():
                ids: list[int | None] = []
                for v in vals[:n]:
                    h = index.host_page(s) if v is not None else None
                    if v is not None and h is None:  # no host room: keep what fits
                        n = min(n, len(ids))
                        break
                    ids.append(h)
                host_pages[s] = ids
            for s, ids in host_pages.items():
                for h in ids[n:]:
                    if h is not None:
                        index.free_host_page(s, h)
                del ids[n:]
                real = [(h, v) for h, v in zip(ids, result.pages[s]) if h is not None]
                self.host_cache.write_pages(s, [h for h, _ in real], [v for _, v in real])
            if n == 0:
                return
            recorded, unused = index.insert_host(pf.token_ids, pf.namespace, pf.first_page, host_pages)
            for s, h in unused:
                index.free_host_page(s, h)
            pf.recorded = recorded * P
            if recorded and self.num_pinned_pages + recorded <= self.max_pinned_pages:
                node = index.node_at(pf.token_ids, pf.namespace, pf.first_page + recorded)
                if node is not None:  # (None: a dead tail was dropped and nothing is left)
                    index.pin_host(node)
                    pf.pinned, pf.pinned_pages = node, recorded
                    self.num_pinned_pages += recorded
            rid = pf.request_id
            self._recorded_tokens[rid] = self._recorded_tokens.get(rid, 0) + recorded * P
            self._known_pages[rid] = max(self._known_pages.get(rid, 0), pf.first_page + recorded)
            self.stats.prefetch_pages += recorded
        finally:
            if receipt is not None:
                index.unlock(receipt)

    def blocks(self, request_id: str) -> bool:
        """Whether admission must wait for this request's read (the prefetch policy)."""
        pf = self._prefetches.get(request_id)
        if pf is None or pf.done:
            return False
        if self.policy == "best_effort":
            return False
        return not pf.future.done() or not pf.done

    def admitted(self, request_id: str) -> int:
        """The request is being admitted: its reservation ends. Returns the tokens its prefetch
        recorded (an upper bound of what its hit took from storage)."""
        pf = self._prefetches.get(request_id)
        if pf is not None and not pf.done and pf.future.done():
            self._record(pf)
        self._release(request_id)
        self._known_pages.pop(request_id, None)
        self._restarts.pop(request_id, None)
        return self._recorded_tokens.pop(request_id, 0)

    def abort(self, request_id: str) -> None:
        if request_id in self._prefetches:
            if not self._prefetches[request_id].done:
                self.stats.prefetches_aborted += 1
            self._release(request_id)
        self._recorded_tokens.pop(request_id, None)
        self._known_pages.pop(request_id, None)
        self._restarts.pop(request_id, None)

    def _release(self, request_id: str) -> None:
        pf = self._prefetches.pop(request_id, None)
        if pf is None:
            return
        if not pf.done:
            pf.future.cancel()  # a read already running just finishes into nothing
        if pf.pinned is not None:
            self.kv.index.unpin_host(pf.pinned)
            self.num_pinned_pages -= pf.pinned_pages
            pf.pinned = None

    # -- writes -----------------------------------------------------------------------------------
    def store(self, transfers: TierTransfers) -> None:
        """Engine thread, after the step's copies ran: hand the new host copies to the store."""
        keys: list[str] = []
        values: list[bytes] = []
        for s, pages in transfers.to_storage.items():
            if not pages:
                continue
            ids = list(pages)
            for h, payload in zip(ids, self.host_cache.read_pages(s, ids)):
                keys.append(pages[h])
                values.append(page_record.encode(self.fp.spaces[s], s, (len(payload),), payload))
        if not keys:
            return
        self._pending_writes = [f for f in self._pending_writes if not f.done()]
        if len(self._pending_writes) >= MAX_PENDING_WRITES:
            self.stats.writes_dropped += len(keys)
            return
        self.stats.writes_queued += len(keys)
        self._pending_writes.append(self._io.submit(self._put, keys, values))

    def _put(self, keys: list[str], values: list[bytes]) -> None:
        stored = self.backend.put(keys, values)
        if stored < len(keys):
            self.stats.writes_dropped += len(keys) - stored

    def drain(self, timeout: float = 30.0) -> None:
        """Wait for queued writes (tests, shutdown)."""
        concurrent.futures.wait(self._pending_writes, timeout=timeout)
        self._pending_writes = [f for f in self._pending_writes if not f.done()]

    def close(self) -> None:
        self.drain()
        for rid in list(self._prefetches):
            self._release(rid)
        self._io.shutdown(wait=True, cancel_futures=True)
        self.backend.close()
