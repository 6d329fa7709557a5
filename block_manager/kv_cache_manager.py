"""KVCacheManager: allocates every block space of a request together (docs/architecture.md).

The engine asks it four things: how much of a prompt is already cached (`match_prefix`),
to make room for the next tokens of a request (`allocate`, all-or-nothing), to record what a
step computed (`commit`: publish whole pages, mark a prompt end, release out-of-window
pages), and to let a request go (`retire`, or `free` without caching). Per request it keeps
one page table per space — a Python list for bookkeeping and a row of that space's int32
BlockTable for the kernels; page i of every space holds the data of tokens [i*P, (i+1)*P).
Pages of windowed spaces that fell out of the request's window are released early and their
entries set to NULL_PAGE (the reserved page 0, never allocated).

With prefix caching on, every request holds one lock receipt on the shadow index
(block_manager/shadow_index.py, locks in index_locks.py): a full lock on the path to its last recorded page (its
*anchor*) and an SWA lock on exactly the recorded pages it still holds in windowed spaces.
`_relock` moves that receipt (ShadowIndex.move: only the pages whose lock state changes) when
the anchor or the held window changes. Cross-invariant (check_invariants): an indexed page
some request holds is protected by a lock in the index.

"The index decides, the KV manager executes": the index changes metadata and says which pages
leave it; this class owns the pools and the tables and applies those decisions.
"""
from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Hashable, Mapping, Sequence

from hybridkv.block_manager.block_space import BlockSpace
from hybridkv.block_manager.block_table import BlockTable
from hybridkv.block_manager.eviction_policy import EvictionPolicy
from hybridkv.block_manager.host_pool import HostPool
from hybridkv.block_manager.host_tier import HostTier
from hybridkv.block_manager.shadow_index import ShadowIndex
from hybridkv.block_manager.space_spec import NULL_PAGE, SpaceSpec
from hybridkv.block_manager.storage_tier import StorageTier
from hybridkv.block_manager.kv_events import KVCacheEvent
from hybridkv.block_manager.kv_plan import HotBufferShape, KVCacheLayout, KVPlan, TierTransfers
from hybridkv.block_manager.request_pages import (
    PrefixHit, RequestPages, SwappedTail, TablePages, request_pages_needed, windowed_live_pages,
)

logger = logging.getLogger(__name__)

__all__ = ["NULL_PAGE", "KVCacheManager", "PrefixHit", "request_pages_needed", "windowed_live_pages"]


class KVCacheManager:
    def __init__(
        self,
        specs: Sequence[SpaceSpec],
        num_pages: dict[str, int],
        page_size: int,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
        windowed_match: bool = True,
        max_pages_per_request: int = 64,
        max_requests: int = 16,
        host_pages: dict[str, int] | None = None,
        hicache_write_policy: str = "write_through",
        load_back_threshold: int = 0,
        report_freed: bool = False,
        decode_publish_tokens: int = 128,
        kv_events: bool = False,
    ) -> None:
        """max_pages_per_request / max_requests only size the block tables up front (they grow).

        report_freed: keep the ids of freed requests until take_freed() (the executor empties
        per-request device state of its own, HiSparse's hot-buffer rows, for them).

        decode_publish_tokens: a decoding request's whole pages are published to the prefix index
        once this many tokens' worth of them are pending (at least one page), not page by page:
        a page crossing then costs its allocation alone, and the insert + lock move is paid once
        per batch (at page 16, 8x fewer calls). Prompts and prefill chunks are published at once
        (siblings and in-batch groups match them), and retire/preemption publishes whatever is
        pending, so the only pages not yet matchable are the last few of a request still decoding.
        Layouts with a windowed space publish every page: a pending page that leaves the window
        could only be recorded as a tombstone, and the next turn's hit would stop short of it.

        host_pages: pages of the host tier (HiCache L2) per space; None = no host tier. A prefix
        hit whose load-back would be under load_back_threshold tokens is served from the device
        pages alone (recomputing the rest is cheaper than the copy).

        kv_events: record KV cache events (kv_events.py) for take_kv_events(); needs prefix caching."""
        if page_size < 1:
            raise ValueError(f"block_size must be >= 1, got {page_size}")
        if host_pages is not None and not enable_prefix_caching:
            raise ValueError("the host tier (enable_hierarchical_cache) needs enable_prefix_caching=True")
        self.page_size = page_size
        self.specs = {s.name: s for s in specs}
        self.spaces = {s.name: BlockSpace(s, num_pages[s.name], page_size) for s in specs}
        self.block_tables = {s.name: BlockTable(max_pages_per_request, max_requests) for s in specs}
        # (name, tokens_per_slot, entries_per_page, space) per space: what the page-count
        # arithmetic of the hot paths reads (entries a page stands for, not its ring slots).
        self._layout = [(s.name, s.tokens_per_slot, s.entries_per_page(page_size), self.spaces[s.name]) for s in specs]
        self.enable_prefix_caching = enable_prefix_caching
        self.host_tier = (
            HostTier({s.name: HostPool(s.name, host_pages[s.name]) for s in specs}, hicache_write_policy)
            if host_pages is not None
            else None
        )
        self.load_back_threshold = load_back_threshold
        if decode_publish_tokens < 1:
            raise ValueError(f"decode_publish_tokens must be >= 1, got {decode_publish_tokens}")
        windowed = any(s.windowed for s in specs)
        self.publish_pages = 1 if windowed else max(1, decode_publish_tokens // page_size)
        self._freed: list[str] | None = [] if report_freed else None
        self.index = (
            ShadowIndex(self.spaces, page_size, EvictionPolicy(eviction_policy), windowed_match, self.host_tier,
                        kv_events=kv_events)
            if enable_prefix_caching
            else None
        )
        self.storage: StorageTier | None = None  # the L3 store under the host tier (attach_storage)
        self.num_swap_outs = 0  # preempted requests whose pages were written to the host
        self._swapped: dict[str, SwappedTail] = {}  # request id -> its partial page on the host
        self.prefix_hits_host = 0  # prompt tokens served by a load-back from the host
        self._requests: dict[str, RequestPages] = {}
        # Read-only view for the scheduler's per-request hot loops: a step whose token count is
        # below a request's grow_at / commit_at skips the allocate / commit call altogether.
        self.request_pages: Mapping[str, RequestPages] = MappingProxyType(self._requests)
        # Counters for metrics (tokens).
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefix_hits_per_space = {name: 0 for name in self.spaces}

    # -- prefix cache --------------------------------------------------------------------------
    def match_prefix(
        self, token_ids: Sequence[int], namespace: Hashable = None, touch: bool = True, request_id: str | None = None
    ) -> PrefixHit:
        """Longest cached SWA-valid page-aligned prefix, never covering the last token (its logits
        are needed). touch=False leaves hit counts and recency alone (the scheduler matches that
        way and lets `allocate(touch_hit=True)` count the hit once, when it is admitted).
        request_id: a swapped-out request resuming; its partial last page extends the hit when
        the hit reaches exactly the whole pages it continues."""
        if self.index is None:
            return PrefixHit([], 0, {name: 0 for name in self.spaces})
        max_pages = (len(token_ids) - 1) // self.page_size
        m = self.index.match(token_ids, namespace, max_pages=max_pages, touch=touch)
        if m.host_tokens and m.host_tokens < self.load_back_threshold:
            m = self.index.match(token_ids, namespace, max_pages=max_pages, touch=touch, device_only=True)
        n = len(m.nodes)
        per_space = {}
        for name, spec in self.specs.items():
            first = self.index.first_window_page(name, n) if spec.windowed else 0
            per_space[name] = (n - first) * self.page_size
        hit = PrefixHit(m.nodes, m.num_tokens, per_space, m.device_tokens, m.host_tokens, m.storage_tokens, m.loads)
        tail = self._swapped.get(request_id) if request_id is not None else None
        if tail is not None and tail.num_pages == n and n > 0:
            hit.tail = tail
            hit.num_tokens += tail.num_tokens
            hit.host_tokens += tail.num_tokens
        return hit

    def record_query(self, num_prompt_tokens: int, hit: PrefixHit | None) -> None:
        self.prefix_queries += num_prompt_tokens
        if hit is not None:
            self.prefix_hits += hit.num_tokens
            self.prefix_hits_host += hit.host_tokens
            for name, n in hit.per_space_tokens.items():
                self.prefix_hits_per_space[name] += n

    # -- lower tiers: a waiting request's prefix read from storage ---------------------------------
    def attach_storage(self, storage: StorageTier) -> None:
        self.storage = storage

    def request_arrived(self, request_id: str, token_ids: Sequence[int], namespace: Hashable = None,
                        cacheable: bool = True) -> None:
        """A request joined the queue: start reading what a lower tier holds past its cached prefix."""
        if self.storage is not None and cacheable:
            self.storage.begin(request_id, token_ids, namespace)

    def poll(self) -> None:
        """Once per step: record the reads that finished (host-only nodes a match then loads back)."""
        if self.storage is not None:
            self.storage.poll()

    def ready(self, request_id: str, token_ids: Sequence[int], namespace: Hashable = None) -> bool:
        """Whether a waiting request may be admitted now (its prefix reads, per the prefetch policy)."""
        return self.storage is None or self.storage.ready(request_id, token_ids, namespace)

    def admitted(self, request_id: str, hit: PrefixHit | None) -> tuple[int, int]:
        """The request is admitted with this hit: its reads end. Returns the hit's tokens loaded
        back from the host, and of those the ones its storage reads had brought there."""
        host = hit.host_tokens if hit is not None else 0
        read = self.storage.admitted(request_id) if self.storage is not None else 0
        return host, min(read, host)

    def waiting_for_reads(self) -> bool:
        return self.storage is not None and self.storage.num_outstanding > 0

    def wait_for_reads(self) -> None:
        """Nothing to run but requests waiting for their reads: sleep until one lands."""
        if self.storage is not None:
            self.storage.wait()

    def copies_done(self, copies: TierTransfers) -> None:
        """The executor ran these copies: the new host pages go on to the store (write-behind)."""
        if self.storage is not None:
            self.storage.store(copies)

    # -- allocation ----------------------------------------------------------------------------
    def _hit_pages(self, hit: PrefixHit) -> dict[str, list[int]]:
        """Per space, the table entries a request admitted with this hit starts with; entries to
        be loaded back from the host are None until their device pages are allocated."""
        n = len(hit.nodes)
        out = {}
        for name, spec in self.specs.items():
            first = self.index.first_window_page(name, n) if spec.windowed else 0
            loads = set(hit.loads.get(name, ()))
            pages = [NULL_PAGE] * first
            for i in range(first, n):
                page = hit.nodes[i].shadows[name]
                if page is None and i not in loads:
                    raise AssertionError(f"prefix hit reads a tombstoned {name!r} page {i}")
                pages.append(page)
            out[name] = pages
        return out

    def _newly_protected(self, hit: PrefixHit, hit_pages: dict[str, list[int]]) -> dict[str, int]:
        """Evictable pages per space that locking this hit would protect (they stop counting as
        room). O(hit pages), computed before anything changes."""
        out = {name: 0 for name in self.spaces}
        for name, pages in hit_pages.items():
            windowed = self.specs[name].windowed
            for node, page in zip(hit.nodes, pages):
                if page == NULL_PAGE or page is None:
                    continue
                if (node.swa_lock_ref if windowed else node.full_lock_ref) == 0:
                    out[name] += 1
        return out

    def can_allocate(self, needs: dict[str, int], protected: dict[str, int] | None = None) -> bool:
        """Every space can hand out its pages from free + evictable (after `protected` pages stop
        being evictable). Eviction in one space only ever frees pages elsewhere, so this per-space
        test is exact."""
        for name, n in needs.items():
            if n <= 0:
                continue
            space = self.spaces[name]
            room = space.num_free
            if self.index is not None:
                room += self.index.evictable[name] - (protected or {}).get(name, 0)
            if n > room:
                return False
        return True

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit: PrefixHit | None = None,
        namespace: Hashable = None,
        priority: int = 0,
        touch_hit: bool = False,
        decode: bool = False,
    ) -> bool:
        """Make the request's tables cover its first num_tokens tokens in every space.

        All-or-nothing: it first decides whether every space can be satisfied from free pages
        plus evictable cached ones; only then does it lock the hit (the first call for a request
        may pass one: its pages are shared, in a windowed space only the window's), evict exactly
        what is short and take the pages. Otherwise it changes nothing — no eviction, no lock,
        no hit count — and returns False: the scheduler then preempts someone or waits.
        touch_hit counts the hit for the eviction policy (once, on admission).
        New pages continue the run of the request's last page where they can (block_space.py);
        decode=True (it grows by one decoded token) takes them from the free list's back instead,
        out of the way of the runs that prefill chunks grow.
        """
        req = self._requests.get(request_id)
        if req is not None:
            if num_tokens < req.grow_at:
                return True  # the pages are already there (the common decode step)
            return self._grow(req, num_tokens, decode)
        hit_pages = None
        current = {name: 0 for name in self.spaces}
        if hit is not None and hit.nodes:
            hit_pages = self._hit_pages(hit)
            current = {name: len(p) for name, p in hit_pages.items()}
        needs = {
            name: self.specs[name].pages_for(num_tokens, self.page_size) - current[name] for name in self.spaces
        }
        if hit_pages is None:
            loads, tail, extra = {}, None, dict.fromkeys(needs, 0)
            if not self.can_allocate(needs):
                return False
        else:
            loads, tail = hit.loads, hit.tail
            if tail is not None:  # its page per space is loaded like a hit's, not allocated as new
                needs = {n: k - (n in tail.host_pages) for n, k in needs.items()}
            protected = self._newly_protected(hit, hit_pages)
            extra = {n: len(loads.get(n, ())) + (tail is not None and n in tail.host_pages) for n in needs}
            if not self.can_allocate({n: needs[n] + extra[n] for n in needs}, protected):
                return False
        req = RequestPages(
            tables={name: [] for name in self.spaces}, row=self._add_row(), namespace=namespace, priority=priority,
        )
        self._requests[request_id] = req
        stale = self._swapped.pop(request_id, None)
        if stale is not None and stale is not tail:  # its partial page no longer continues a hit
            for name, h in stale.host_pages.items():
                self.host_tier.release(name, h)
        if hit_pages is not None:
            # Lock first: the hit's nodes (host-only ones too) are then safe from the eviction
            # below, on both tiers.
            for name, pages in hit_pages.items():
                space = self.spaces[name]
                for page in pages:
                    if page != NULL_PAGE and page is not None:
                        space.incref(page)
                if self.specs[name].windowed:
                    req.num_released_pages[name] = pages.count(NULL_PAGE)
            req.num_inserted_pages = len(hit.nodes)
            req.anchor = hit.nodes[-1]
            self._relock(req)
            if touch_hit:
                self.index.touch(hit.nodes)
        for name, n in needs.items():
            short = n + extra[name] - self.spaces[name].num_free
            if short > 0:
                self.index.evict(name, short)
        if hit_pages is not None:
            for name, pages in hit_pages.items():
                idx = loads.get(name, ())
                if idx:  # load-back: fresh device pages, filled from the host before the forward
                    fresh = self.spaces[name].allocate(len(idx))
                    for i, page in zip(idx, fresh):
                        pages[i] = page
                        self.index.attach_loaded(hit.nodes[i], name, page)
                if tail is not None and name in tail.host_pages:  # the swapped-out partial page
                    page = self.spaces[name].allocate(1)[0]
                    pages.append(page)
                    self.host_tier.transfers.load(name, tail.host_pages[name], page)
                    self.host_tier.stats.loaded_pages[name] += 1
                    self.host_tier.release(name, tail.host_pages[name], after_copies=True)
                self._extend(req, name, pages)
        self._take_new_pages(req, [(name, n, self.spaces[name]) for name, n in needs.items() if n > 0], decode)
        return True

    def _grow(self, req: RequestPages, num_tokens: int, decode: bool) -> bool:
        """allocate() for a running request (a decode's page crossing, a prefill chunk): no hit to
        lock or load, so only the all-or-nothing room check, the eviction of what is short, and
        the new pages (continuing the run of its last page, or from the free list's back for a
        decode). A lean loop: at hundreds of running decodes, a dozen of these run every step."""
        index, grows = self.index, []
        for name, tokens_per_slot, entries_per_page, space in self._layout:
            n = -(-(num_tokens // tokens_per_slot) // entries_per_page) - len(req.tables[name])
            if n > 0:
                # can_allocate's rule (free + evictable), inline: no dict per call on this path
                if n > space.num_free + (index.evictable[name] if index is not None else 0):
                    return False  # nothing evicted, nothing taken
                grows.append((name, n, space))
        if decode:
            req.decoding = True  # also a request resumed past its prompt (it had no prompt_done)
        self._take_new_pages(req, grows, decode)
        return True

    def _take_new_pages(self, req: RequestPages, grows: list[tuple[str, int, BlockSpace]], decode: bool) -> None:
        """The last part of every allocate: evict what each space is still short of (the room
        was checked), take the new pages -- continuing the run of the request's last page, or
        from the free list's back for a decode -- and set grow_at."""
        for name, n, space in grows:
            if n > space.num_free:
                self.index.evict(name, n - space.num_free)
            table = req.tables[name]
            after = None if decode or not table else table[-1]
            self._extend(req, name, space.allocate(n, after=after, tail=decode))
        req.grow_at = min(
            (len(req.tables[name]) * entries_per_page + 1) * tokens_per_slot
            for name, tokens_per_slot, entries_per_page, _ in self._layout
        )

    def _add_row(self) -> int:
        """One row for a new request in every space's BlockTable. The tables are created alike and
        see the same add/free sequence, so they hand out (and grow to) the same row."""
        rows = {bt.add_row() for bt in self.block_tables.values()}
        if len(rows) != 1:
            raise AssertionError(f"block tables disagree on the next row: {sorted(rows)}")
        return rows.pop()

    def _extend(self, req: RequestPages, space: str, pages: list[int]) -> None:
        req.tables[space].extend(pages)
        self.block_tables[space].append(req.row, pages)

    def _set_entry(self, req: RequestPages, space: str, i: int, page: int) -> None:
        req.tables[space][i] = page
        self.block_tables[space].set(req.row, i, page)

    def pages_needed(self, num_tokens: int, max_chunk_tokens: int | None = None) -> dict[str, int]:
        """Most pages one request of num_tokens holds at once in each space, when it is
        computed in chunks of at most max_chunk_tokens (default: one page)."""
        return request_pages_needed(list(self.specs.values()), num_tokens, self.page_size,
                                    max_chunk_tokens or self.page_size, self.index is not None)

    # -- the per-step protocol -----------------------------------------------------------------
    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, prompt_done: bool = False) -> None:
        """A step computed the request up to num_computed_tokens: publish its new whole pages
        (a decoding request's in batches of publish_pages), mark the prompt's end as a likely
        match point when prompt_done, and release windowed pages no later token reads."""
        req = self._requests[request_id]
        if num_computed_tokens < req.commit_at and not prompt_done:
            return  # no page completed and no window moved past a page: nothing to record
        P = self.page_size
        if prompt_done:
            req.decoding = True
        batch = self.publish_pages if req.decoding else 1
        if prompt_done or num_computed_tokens >= (req.num_inserted_pages + batch) * P:
            self.cache_computed_pages(request_id, token_ids, num_computed_tokens)
        if prompt_done:
            self.mark_boundary(request_id)
        self.release_out_of_window(request_id, num_computed_tokens)
        nxt = (req.num_inserted_pages + batch) * P if self.index is not None else 1 << 62
        for name, spec in self.specs.items():
            if spec.windowed:  # first_kept_page grows past the released pages at this count
                nxt = min(nxt, spec.release_at(req.num_released_pages.get(name, 0), P))
        req.commit_at = nxt

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's pages past its first num_tokens tokens (speculative decoding:
        the positions of rejected drafts). Only raw-token spaces reach here (the engine refuses
        speculation otherwise); pages past the computed tokens are never in the prefix index, so
        they return to the free list, and a window released only pages behind them."""
        req = self._requests[request_id]
        for name, tokens_per_slot, entries_per_page, space in self._layout:
            keep = -(-(num_tokens // tokens_per_slot) // entries_per_page)
            table = req.tables[name]
            if len(table) <= keep:
                continue
            for page in reversed(table[keep:]):
                if page != NULL_PAGE:
                    space.decref(page)
            del table[keep:]
            self.block_tables[name].truncate(req.row, keep)
        req.grow_at = min(
            (len(req.tables[name]) * entries_per_page + 1) * tokens_per_slot
            for name, tokens_per_slot, entries_per_page, _ in self._layout
        )

    def retire(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, turn_done: bool, swap: bool = False
    ) -> None:
        """The request leaves (finished, aborted or preempted): its computed whole pages stay in
        the prefix cache (marked as a turn end when turn_done), then every page goes back.
        swap=True (swap preemption): its recorded pages are also written to the host tier now,
        so when the device evicts them they are demoted, and the resume loads them back."""
        req = self._requests.get(request_id)
        if req is not None:
            self.cache_computed_pages(request_id, token_ids, num_computed_tokens)
            if turn_done:
                self.mark_boundary(request_id)
            if swap and self.host_tier is not None:
                if req.anchor is not None:
                    for node in req.anchor.path():
                        self.index.write_node(node)
                self._swap_out_tail(request_id, req, num_computed_tokens)
                self.num_swap_outs += 1
        self.free(request_id)

    def _swap_out_tail(self, request_id: str, req: RequestPages, num_computed_tokens: int) -> None:
        """Write the partial last page (tokens past the last whole page) to the host, held for
        this request's resume; nothing when the host has no room (those tokens are recomputed)."""
        full, partial = divmod(num_computed_tokens, self.page_size)
        if not partial or req.num_inserted_pages != full:
            return
        taken: dict[str, int] = {}
        for name, table in req.tables.items():
            if len(table) <= full or table[full] == NULL_PAGE:
                continue  # a compressed space with no slot in it yet
            h = self.index.host_page(name)
            if h is None:
                for s, p in taken.items():
                    self.host_tier.release(s, p)
                return
            self.host_tier.hold(name, h)
            self.host_tier.transfers.write(name, table[full], h)
            self.host_tier.stats.written_pages[name] += 1
            taken[name] = h
        if taken:
            self._swapped[request_id] = SwappedTail(full, partial, taken)

    def layout(self, host_spaces: frozenset[str] = frozenset(), hot_buffers: HotBufferShape | None = None
               ) -> KVCacheLayout:
        """The shape the executor allocates the KV tensors from (host_spaces, hot_buffers:
        HiSparse's mirror in host memory and its device hot buffers)."""
        return KVCacheLayout(self.page_size, dict(self.specs),
                             {n: s.num_physical_pages for n, s in self.spaces.items()}, host_spaces, hot_buffers)

    def plan(self, request_ids: list[str], copies: bool = True) -> KVPlan:
        """The step's plan for these requests (allocated this step): their block-table rows, the
        tables, and the tier copies decided since the last plan or take_transfers (copies=False:
        none taken, for a forward between steps: the MTP drafter's)."""
        transfers = self.take_transfers() if copies else TierTransfers()
        return KVPlan({n: bt.tensor for n, bt in self.block_tables.items()},
                      {r: self._requests[r].row for r in request_ids}, transfers)

    def take_transfers(self) -> TierTransfers:
        """Device <-> host copies decided since the last call (execute before the next forward)."""
        return self.host_tier.take_transfers() if self.host_tier is not None else TierTransfers()

    def cache_computed_pages(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Record the request's whole computed pages in the prefix index (so others can share them).

        Pages the tree already holds replace the request's own copies (freed here); pages the
        request already released go in as tombstones; its live pages heal tombstones. Costs the
        new pages only (the walk resumes at the request's anchor)."""
        if self.index is None:
            return
        req = self._requests[request_id]
        full = num_computed_tokens // self.page_size
        if full <= req.num_inserted_pages:
            return
        start = req.num_inserted_pages
        res = self.index.insert(
            token_ids,  # not sliced: a copy would cost the whole context; TablePages bounds the pages read
            {name: TablePages(table, start, full) for name, table in req.tables.items()},
            req.namespace,
            start=req.anchor,
            priority=req.priority,
            lock_follows=True,  # _relock below moves the lock onto the new nodes
        )
        for name, dups in res.duplicates.items():
            table, space = req.tables[name], self.spaces[name]
            for i, tree_page in dups:
                space.incref(tree_page)  # take the tree's copy first, then drop ours
                space.decref(table[i])
                self._set_entry(req, name, i, tree_page)
        req.num_inserted_pages = full
        req.anchor = res.last_node
        self._relock(req)

    def mark_boundary(self, request_id: str) -> None:
        """The request's recorded prefix ends a prompt or a turn: a likely future match point,
        whose windowed tail eviction keeps as long as it can."""
        req = self._requests.get(request_id)
        if self.index is not None and req is not None and req.anchor is not None:
            self.index.mark_boundary(req.anchor)

    def release_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Free windowed-space pages no future token of this request can read."""
        req = self._requests[request_id]
        changed = False
        for name, table in req.tables.items():
            spec = self.specs[name]
            if not spec.windowed:
                continue
            upto = min(spec.first_kept_page(num_computed_tokens, self.page_size), len(table))
            start = req.num_released_pages.get(name, 0)
            for i in range(start, upto):
                if table[i] != NULL_PAGE:
                    self.spaces[name].decref(table[i])
                    self._set_entry(req, name, i, NULL_PAGE)
            if upto > start:
                req.num_released_pages[name] = upto
                changed = True
        if changed:
            self._relock(req)

    def _relock(self, req: RequestPages) -> None:
        """Point the request's lock at its anchor, SWA-locking exactly the recorded windowed
        pages it still holds (none: the SWA part is released early)."""
        if self.index is None or req.anchor is None:
            return
        end = req.anchor.depth
        held_from = min((req.num_released_pages.get(n, 0) for n in self.index.windows if n not in self.index.unread),
                        default=end)
        swa_tokens = max(0, end - held_from) * self.page_size
        if req.receipt is None:
            req.receipt = self.index.lock(req.anchor, swa_tokens)
            return
        held = req.receipt.swa_tokens if req.receipt.swa_held else 0
        if req.receipt.anchor is req.anchor and held == swa_tokens:
            return
        req.receipt = self.index.move(req.receipt, req.anchor, swa_tokens)

    def free(self, request_id: str) -> None:
        """Every page of the request goes back (nothing is published); its reads are dropped."""
        if self.storage is not None:
            self.storage.abort(request_id)
        if self._freed is not None:
            self._freed.append(request_id)
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._release(req)
        elif request_id in self._swapped:  # a swapped-out request that will not resume
            for name, h in self._swapped.pop(request_id).host_pages.items():
                self.host_tier.release(name, h)

    def take_freed(self) -> list[str]:
        """The requests freed since the last call (always [] without report_freed)."""
        if not self._freed:
            return []
        freed, self._freed = self._freed, []
        return freed

    def _release(self, req: RequestPages) -> None:
        if req.receipt is not None:
            self.index.unlock(req.receipt)
            req.receipt = None
        for name, table in req.tables.items():
            space = self.spaces[name]
            # Release in reverse so the tail of a sequence is evicted before its head.
            for page in reversed(table):
                if page != NULL_PAGE:
                    space.decref(page)
            table.clear()
            self.block_tables[name].free_row(req.row)

    # -- introspection ---------------------------------------------------------------------
    def page_table(self, request_id: str, space: str) -> list[int]:
        return self._requests[request_id].tables[space]

    def row_of(self, request_id: str) -> int:
        """The request's row in every space's BlockTable."""
        return self._requests[request_id].row

    def rows_of(self, request_ids: list[str]) -> list[int]:
        """row_of for a step's requests at once (one call per step, not per request)."""
        return [p.row for p in map(self._requests.__getitem__, request_ids)]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def num_requests(self) -> int:
        return len(self._requests)

    def usage(self) -> dict[str, float]:
        return {name: s.usage() for name, s in self.spaces.items()}

    def take_kv_events(self) -> list[KVCacheEvent]:
        """KV cache events recorded since the last call ([] when they are off)."""
        return self.index.take_events() if self.index is not None else []

    def reset_prefix_cache(self) -> int:
        return self.index.clear() if self.index is not None else 0

    def check_invariants(self) -> None:
        for space in self.spaces.values():
            space.check_invariants()
        if self.index is not None:
            self.index.check_invariants()
        held: dict[str, dict[int, int]] = {name: {} for name in self.spaces}
        rows = set()
        for rid, req in self._requests.items():
            assert req.row not in rows, f"request {rid} shares a block-table row"
            rows.add(req.row)
            for name, table in req.tables.items():
                bt = self.block_tables[name]
                assert bt.num_pages[req.row] == len(table), f"space {name!r}: block table row length drift"
                assert bt.tensor[req.row, : len(table)].tolist() == table, f"space {name!r}: block table differs"
                for page in table:
                    if page != NULL_PAGE:
                        held[name][page] = held[name].get(page, 0) + 1
            if self.index is not None:
                self._check_request_against_index(req)
        for name, space in self.spaces.items():
            for page in range(space.num_physical_pages):
                assert space.refcount[page] == held[name].get(page, 0), (
                    f"space {name!r}: page {page} refcount {space.refcount[page]} but "
                    f"{held[name].get(page, 0)} request tables hold it"
                )
        if self.index is not None:
            for node in self.index.nodes():
                for name, page in node.shadows.items():
                    if page is not None and self.spaces[name].refcount[page] > 0:
                        locked = node.swa_lock_ref if name in self.index.windows else node.full_lock_ref
                        assert locked, f"space {name!r}: page {page} is held by a request but unlocked in the index"

    def _check_request_against_index(self, req: RequestPages) -> None:
        """The request's recorded pages are the tree's pages, and its receipt covers them."""
        if req.anchor is None:
            assert req.num_inserted_pages == 0 and req.receipt is None
            return
        assert req.anchor.depth == req.num_inserted_pages, "anchor depth differs from the recorded page count"
        assert req.receipt is not None and req.receipt.anchor is req.anchor, "request lock is not on its anchor"
        for node in req.anchor.path():
            i = node.depth - 1
            for name, table in req.tables.items():
                if table[i] != NULL_PAGE:
                    assert node.shadows[name] == table[i], (
                        f"space {name!r}: request holds page {table[i]} for recorded page {i}, tree has {node.shadows[name]}"
                    )

    def assert_idle(self) -> None:
        """No request holds a page: every page is free or cached, every refcount and lock is zero."""
        self.check_invariants()
        assert not self._requests, f"requests still hold pages: {list(self._requests)}"
        assert not self._swapped, f"swapped-out partial pages still held for {list(self._swapped)}"
        for space in self.spaces.values():
            assert space.num_in_use == 0, f"space {space.name!r}: {space.num_in_use} pages still in use"
        if self.index is not None:
            assert self.index.num_live_receipts == 0, f"{self.index.num_live_receipts} lock receipts still live"
            assert self.index.num_host_pins == 0, f"{self.index.num_host_pins} host pins still held"
        if self.host_tier is not None:
            assert self.host_tier.transfers.empty, "tier copies were decided but never executed"
        assert not self._freed, f"freed requests never handed to the executor: {self._freed}"
