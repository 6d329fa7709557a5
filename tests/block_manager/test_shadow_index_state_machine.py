"""Stateful property test of the shadow prefix index, driven through KVCacheManager.

Rules admit requests (random tokens over a tiny alphabet, often extending or branching off an
earlier sequence at a random page: the page-granular tree's equivalent of a split), advance
them (allocate, "compute" pages, record them, release out-of-window pages), finish or drop
them, pin/unpin arbitrary nodes with their own receipts, and evict from a chosen space. With a
host tier also: abort a request whose load-back is still pending, swap a request out (swap
preemption), resume or abort a swapped-out one, pin/unpin host-only nodes (storage reads).

Checked after every step:
  * KVCacheManager.check_invariants(): per-space free/cached/in-use and evictable/protected
    ledgers, lock counts == what the live receipts put there, receipts' boundary stamps, an
    indexed page held by a request is locked, a request's recorded pages are the tree's.
  * data tags: every page carries the (namespace, token prefix) it was computed for; every
    page a request reads (whole history; the window of windowed spaces) carries its own
    prefix's tag, so a wrong hit, a stale page or a double free shows up as a wrong tag.
  * a reference model of what is cached (set of page prefixes with per-space liveness):
    inserts update it deterministically (tombstone where the request had released the page,
    heal where it holds it); evictions may only remove unlocked nodes/shadows; and `match`
    must return exactly the brute-force SWA-valid longest prefix of the reference.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from hybridkv.block_manager.kv_events import HOST_MEDIUM, BlockRemoved, BlockStored, block_hash
from hybridkv.block_manager.kv_cache_manager import NULL_PAGE, KVCacheManager
from hybridkv.block_manager.space_spec import SpaceSpec

P = 4

V4_LIKE = [
    SpaceSpec("swa", 1, 8, window=6),
    SpaceSpec("c4", 2, 8),
    SpaceSpec("full", 1, 8),
    SpaceSpec("state", 1, 8, window=3),
]
MISTRAL_LIKE = [SpaceSpec("swa", 1, 8, window=5)]
GEMMA_LIKE = [SpaceSpec("full", 1, 8), SpaceSpec("swa", 1, 8, window=9)]


class ShadowIndexMachine(RuleBasedStateMachine):
    specs = V4_LIKE
    pages = 14
    policy = "lru"
    host_pages: int | None = None  # a host tier (HiCache L2) of this many pages per space
    write_policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        host = {s.name: self.host_pages for s in self.specs} if self.host_pages else None
        self.kv = KVCacheManager(self.specs, {s.name: self.pages for s in self.specs}, P, True, self.policy,
                                 host_pages=host, hicache_write_policy=self.write_policy, kv_events=True)
        self.published: dict[str | None, set[int]] = {None: set(), HOST_MEDIUM: set()}  # replayed KV events
        self.windowed = {s.name: s.window for s in self.specs if s.windowed}
        self.tags = {s.name: [None] * (self.pages + 1) for s in self.specs}
        # Host tier: the tag each host page holds, moved by the copies exactly as the runner would.
        self.host_tags = {s.name: [None] * (self.host_pages or 0) for s in self.specs}
        self.live: dict[str, dict] = {}  # rid -> {"tokens", "computed", "ns", "hit"}
        self.history: list[tuple[object, list[int]]] = []
        self.pins: list = []
        self.host_pins: list = []  # nodes pinned on the host (a waiting request's storage read)
        self.swapped: dict[str, dict] = {}  # swap-preempted requests (host tier): rid -> live entry
        self.ref: dict[tuple, dict[str, bool]] = {}  # (ns, prefix tokens) -> windowed space -> live
        self.counter = 0

    # -- helpers ---------------------------------------------------------------------------
    def _key(self, ns, toks, i):
        return (ns, tuple(toks[: (i + 1) * P]))

    def _walk(self):
        """Every node of the index as ((namespace, its whole token prefix), node)."""
        for ns, root in self.kv.index._roots.items():
            stack = [(root, ())]
            while stack:
                node, prefix = stack.pop()
                for key, child in node.children.items():
                    p = prefix + key
                    yield (ns, p), child
                    stack.append((child, p))

    def _index_view(self) -> dict[tuple, dict[str, bool]]:
        """Per node, whether each windowed shadow is live (on the device or the host)."""
        return {k: {s: n.shadows[s] is not None or n.host.get(s) is not None for s in self.windowed}
                for k, n in self._walk()}

    def _flush(self, t=None) -> None:
        """Execute tier copies (the step plan's, or those decided so far) on the data tags:
        device -> host first, then host -> device (the runner's order)."""
        t = self.kv.take_transfers() if t is None else t
        for s, copies in t.to_host.items():
            for h, d in copies.items():
                assert self.tags[s][d] is not None, f"{s}: writing never-computed device page {d} to the host"
                self.host_tags[s][h] = self.tags[s][d]
        for s, copies in t.to_device.items():
            for d, h in copies.items():
                assert self.host_tags[s][h] is not None, f"{s}: loading never-written host page {h}"
                self.tags[s][d] = self.host_tags[s][h]

    def _locks(self):
        full, swa = set(), set()
        for k, child in self._walk():
            if child.full_lock_ref:
                full.add(k)
            if child.swa_lock_ref:
                swa.add(k)
        return full, swa

    def _ref_match(self, ns, toks) -> int:
        """Brute force: largest d <= (len-1)//P with every prefix page cached and, per windowed
        space, pages [first_window_page, d) live."""
        best = 0
        limit = (len(toks) - 1) // P
        for d in range(1, limit + 1):
            if self._key(ns, toks, d - 1) not in self.ref:
                break
            ok = True
            for s, w in self.windowed.items():
                first = max(0, d * P - w + 1) // P
                if not all(self.ref[self._key(ns, toks, i)][s] for i in range(first, d)):
                    ok = False
            if ok:
                best = d
        return best

    def _check_reads(self, rid: str, start: int, end: int, plan=None) -> None:
        """The request is about to compute positions [start, end): every page it reads has its tag
        (read from the step plan's tables when given: what the executor reads)."""
        r = self.live[rid]
        if plan is not None:
            rows = plan.step_tables([rid], 1 << 30)  # every column the tables have
            tables = {s: rows[s][0].tolist() for s in self.tags}
            for s, table in tables.items():
                own = self.kv.page_table(rid, s)
                assert table[: len(own)] == own, f"{s}: the plan's block-table row differs from the request's pages"
        else:
            tables = {s: self.kv.page_table(rid, s) for s in self.tags}
        for s, table in tables.items():
            spec = self.kv.specs[s]
            lo = 0 if spec.window is None else max(0, start - spec.window + 1)
            # complete pages strictly before `start` that hold read positions
            for i in range(lo // P, start // P):
                page = table[i]
                assert page != NULL_PAGE, f"{s}: request {rid} reads released page {i}"
                assert self.tags[s][page] == self._key(r["ns"], r["tokens"], i), f"{s}: wrong data in page {i}"

    def _compute(self, rid: str, upto: int) -> None:
        plan = self.kv.plan([rid])  # the step's plan: the load-backs its allocation decided run first
        self._flush(plan.copies)
        full_locked, _ = self._locks()
        before_view = self._index_view()
        self._compute_pages(rid, upto, plan)
        self._flush()  # write-through of what it recorded
        # Recording may evict on the host (write-through needs room): only unlocked nodes go.
        view = self._index_view()
        gone = set(before_view) - set(view)
        assert not gone & full_locked, "host eviction removed a locked node"
        self.ref = {k: v for k, v in self.ref.items() if k in view}

    def _compute_pages(self, rid: str, upto: int, plan=None) -> None:
        r = self.live[rid]
        start = r["computed"]
        self._check_reads(rid, start, upto, plan)
        for s in self.tags:
            table = self.kv.page_table(rid, s)
            # The partial last page too (a swap-out moves it), where the space has one yet (a
            # compressed space has none until its first entry).
            for i in range(start // P, min(-(-upto // P), len(table))):
                page = table[i]
                assert page != NULL_PAGE
                space = self.kv.spaces[s]
                assert space.refcount[page] == 1 and not space.in_index[page], f"{s}: writing a shared page"
                self.tags[s][page] = (r["ns"], tuple(r["tokens"][: min(upto, (i + 1) * P)]))
        r["computed"] = upto
        first_new = r["inserted"]
        before = {i: {s: self.kv.page_table(rid, s)[i] for s in self.windowed} for i in range(upto // P)}
        self.kv.cache_computed_pages(rid, r["tokens"], upto)
        r["inserted"] = max(first_new, upto // P)
        for i in range(first_new, upto // P):
            k = self._key(r["ns"], r["tokens"], i)
            held = {s: before[i][s] != NULL_PAGE for s in self.windowed}
            if k not in self.ref:
                self.ref[k] = held
            else:
                self.ref[k] = {s: self.ref[k][s] or held[s] for s in self.windowed}
        self.kv.release_out_of_window(rid, upto)

    # -- rules ------------------------------------------------------------------------------
    @rule(
        data=st.data(),
        extend=st.booleans(),
        ns=st.sampled_from([None, None, None, "salt"]),
        n_new=st.integers(1, 14),
    )
    def admit(self, data, extend, ns, n_new):
        if len(self.live) >= 4:
            return
        base: list[int] = []
        if extend and self.history:
            ns, old = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.integers(0, len(old) // P)) * P  # branch at a page boundary
            base = list(old[:cut])
        toks = base + data.draw(st.lists(st.integers(0, 2), min_size=n_new, max_size=n_new))
        hit = self.kv.match_prefix(toks, ns)
        assert hit.num_tokens % P == 0 and hit.num_tokens < len(toks), "a hit must never cover the last token"
        assert hit.num_tokens // P == self._ref_match(ns, toks), "match differs from the reference"
        self.counter += 1
        rid = f"r{self.counter}"
        first = data.draw(st.integers(hit.num_tokens + 1, len(toks)))
        if not self._observed(lambda: self.kv.allocate(rid, first, hit, ns)):
            return
        self.live[rid] = {"tokens": toks, "computed": hit.num_tokens, "ns": ns, "inserted": hit.num_tokens // P}
        self._compute(rid, first)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), grow=st.integers(0, 6))
    def advance(self, data, grow):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live[rid]
        r["tokens"] += data.draw(st.lists(st.integers(0, 2), min_size=grow, max_size=grow))
        if r["computed"] >= len(r["tokens"]):
            return
        upto = data.draw(st.integers(r["computed"] + 1, len(r["tokens"])))
        if self._observed(lambda: self.kv.allocate(rid, upto)):
            self._compute(rid, upto)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), record=st.booleans())
    def finish(self, data, record):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        if record:
            self.kv.mark_boundary(rid)
            self.history.append((r["ns"], r["tokens"][: r["computed"]]))
        self._observed(lambda: self.kv.free(rid), unlocking=True)

    @precondition(lambda self: self.kv.index.num_nodes > 0)
    @rule(data=st.data(), swa_tokens=st.integers(0, 12))
    def pin(self, data, swa_tokens):
        node = data.draw(st.sampled_from(sorted(self.kv.index.nodes(), key=lambda n: (n.depth, n.key, n.seq))))
        self.pins.append(self.kv.index.lock(node, swa_tokens))

    @precondition(lambda self: self.pins)
    @rule(data=st.data(), swa_tokens=st.integers(0, 12))
    def move_pin(self, data, swa_tokens):
        """Slide a pin to a node below it (the O(1) lock move), or anywhere (relock fallback)."""
        i = data.draw(st.integers(0, len(self.pins) - 1))
        old = self.pins[i]
        below = [n for n in self.kv.index.nodes() if old.anchor in set(n.path())]
        pool = below if below and data.draw(st.booleans()) else list(self.kv.index.nodes())
        target = data.draw(st.sampled_from(sorted(pool, key=lambda n: (n.depth, n.key, n.seq))))
        moved = self._observed(lambda: self.kv.index.move(old, target, swa_tokens), unlocking=True)
        assert moved.anchor is target and moved.swa_tokens == swa_tokens
        self.pins[i] = moved

    @precondition(lambda self: self.pins)
    @rule(data=st.data(), early_swa=st.booleans())
    def unpin(self, data, early_swa):
        receipt = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        if early_swa:
            self.kv.index.release_swa(receipt)
            self.kv.index.release_swa(receipt)  # idempotent
        self._observed(lambda: self.kv.index.unlock(receipt), unlocking=True)
        with pytest.raises(AssertionError, match="not live"):
            self.kv.index.unlock(receipt)  # a receipt unlocks once

    def _host_only(self) -> list:
        if self.kv.index.tier is None:
            return []
        return sorted((n for n in self.kv.index.nodes() if all(p is None for p in n.shadows.values())),
                      key=lambda n: (n.depth, n.key, n.seq))

    @precondition(lambda self: self._host_only())
    @rule(data=st.data())
    def host_pin(self, data):
        """Pin a host-only node as a storage read does: host eviction must go around it (device
        eviction may still take it when nothing else is left)."""
        node = data.draw(st.sampled_from(self._host_only()))
        self.kv.index.pin_host(node)
        self.host_pins.append(node)

    @precondition(lambda self: self.host_pins)
    @rule(data=st.data())
    def host_unpin(self, data):
        node = self.host_pins.pop(data.draw(st.integers(0, len(self.host_pins) - 1)))
        self.kv.index.unpin_host(node)

    # -- host-tier races (HiCache L2): an abort while a load-back is pending, swap preemption ---
    @precondition(lambda self: self.kv.host_tier is not None and self.history and len(self.live) < 4)
    @rule(data=st.data())
    def abort_during_load_back(self, data):
        """Admitted with a hit whose load-backs are decided, then aborted before the copies ran:
        the copies still run (into pages the index now owns), nothing is leaked or locked."""
        ns, old = data.draw(st.sampled_from(self.history))
        toks = list(old) + [0]
        hit = self.kv.match_prefix(toks, ns, touch=False)
        self.counter += 1
        rid = f"r{self.counter}"
        if not self._observed(lambda: self.kv.allocate(rid, len(toks), hit, ns), flush=False):
            return
        if any(self.kv.host_tier.transfers.to_device.values()):
            TIER_COVERAGE["abort_pending_load"] = TIER_COVERAGE.get("abort_pending_load", 0) + 1
        self._observed(lambda: self.kv.free(rid), unlocking=True)

    @precondition(lambda self: self.kv.host_tier is not None and self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        """Swap preemption: recorded pages to the host, the partial last page held for the resume."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        self._observed(lambda: self.kv.retire(rid, r["tokens"], r["computed"], turn_done=False, swap=True),
                       mixed=True)
        self.history.append((r["ns"], r["tokens"][: r["computed"] // P * P]))
        self.swapped[rid] = r
        TIER_COVERAGE["swap_out"] = TIER_COVERAGE.get("swap_out", 0) + 1

    @precondition(lambda self: self.swapped and len(self.live) < 4)
    @rule(data=st.data())
    def resume_swapped(self, data):
        """The resume goes through the ordinary match -> allocate (load-back) path."""
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        r = self.swapped[rid]
        toks = r["tokens"] + [0]  # the token its next step would add: a hit never covers the last
        hit = self.kv.match_prefix(toks, r["ns"], touch=False, request_id=rid)
        assert len(hit.nodes) == self._ref_match(r["ns"], toks), "a resume's match differs from the reference"
        assert hit.num_tokens < len(toks)
        first = data.draw(st.integers(hit.num_tokens + 1, len(toks)))
        if not self._observed(lambda: self.kv.allocate(rid, first, hit, r["ns"])):
            return
        del self.swapped[rid]
        self.live[rid] = {"tokens": toks, "computed": hit.num_tokens, "ns": r["ns"], "inserted": len(hit.nodes)}
        if hit.tail is not None:  # its partial last page came back from the host: the same data
            TIER_COVERAGE["swap_in_tail"] = TIER_COVERAGE.get("swap_in_tail", 0) + 1
            self._flush()
            for s in hit.tail.host_pages:
                page = self.kv.page_table(rid, s)[len(hit.nodes)]
                assert self.tags[s][page] == (r["ns"], tuple(toks[: hit.num_tokens])), f"{s}: wrong swapped-in tail"
        self._compute(rid, first)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def abort_swapped(self, data):
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        del self.swapped[rid]
        self._observed(lambda: self.kv.free(rid), unlocking=True)

    @rule(space=st.sampled_from([s.name for s in V4_LIKE + MISTRAL_LIKE]), n=st.integers(1, 6))
    def evict(self, space, n):
        if space not in self.kv.spaces:
            return
        free_before = self.kv.spaces[space].num_free
        index = self.kv.index
        expected = None
        if space not in index.windows and index.tier is None:  # differential check of the O(1) queues against a sort
            leaves = [nd for nd in index.nodes() if not nd.children and nd.full_lock_ref == 0]
            if leaves:
                expected = min(leaves, key=index.policy.key)
        freed = self._observed(lambda: self.kv.index.evict(space, n))
        assert self.kv.spaces[space].num_free - free_before == freed
        if expected is not None:
            assert expected not in set(index.nodes()), "eviction skipped the policy's first victim"

    def _observed(self, op, unlocking: bool = False, flush: bool = True, mixed: bool = False):
        """Run op (which may evict); check it only removed unlocked nodes / tombstoned unlocked
        windowed shadows, then bring the reference up to date with what was evicted. An unlock
        may only remove nodes that hold no data at all (every shadow tombstoned). mixed: an op
        that both evicts and unlocks (a swap-out): each removed node must satisfy one of the two.
        flush=False leaves the decided tier copies pending (an abort before they ran)."""
        full_locked, swa_locked = self._locks()
        before = self._index_view()
        result = op()
        if flush:
            self._flush()
        after = self._index_view()
        for k, live in before.items():
            if k not in after:
                dead = bool(self.windowed) and not all(live.values())
                if mixed:
                    assert k not in full_locked or dead, "a swap-out dropped a locked node that serves hits"
                elif unlocking:  # only a leaf that can serve no hit (a windowed shadow tombstoned) may go
                    assert dead, "unlock dropped a node that serves hits"
                else:
                    assert k not in full_locked, "evicted a full-locked node"
            else:
                for s in self.windowed:
                    if live[s] and not after[k][s]:
                        assert k not in swa_locked, "tombstoned an SWA-locked shadow"
                    assert not (not live[s] and after[k][s]), "eviction revived a shadow"
        assert set(after) <= set(before)
        self.ref = {k: dict(after[k]) for k in self.ref if k in after}
        return result

    @invariant()
    def ledgers_exact(self):
        self.kv.check_invariants()
        assert self._index_view() == self.ref, "the index differs from the reference model"

    @invariant()
    def kv_events_replay_to_the_index(self):
        """Replaying every KV cache event gives the index's pages on each tier (a router that
        follows the events knows exactly what this engine holds)."""
        for e in self.kv.take_kv_events():
            if isinstance(e, BlockStored):
                assert not self.published[e.medium] & set(e.block_hashes), "a page was announced twice"
                self.published[e.medium] |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.published[e.medium], "a removal of a page never announced"
                self.published[e.medium] -= set(e.block_hashes)
            else:
                assert self.kv.index.num_nodes == 0, "AllBlocksCleared while pages remain"
                self.published = {m: set() for m in self.published}
        index = self.kv.index
        ref = index.whole[0] if index.whole else None
        want = {None: set(), HOST_MEDIUM: set()}
        for nd in index.nodes() if ref is not None else ():
            if nd.shadows[ref] is not None:
                want[None].add(block_hash(nd.chain))
            if nd.host.get(ref) is not None:
                want[HOST_MEDIUM].add(block_hash(nd.chain))
        assert self.published == want, "the KV cache events disagree with the index"

    def teardown(self):
        for rid in list(self.live):
            self.kv.free(rid)
        for receipt in self.pins:
            self.kv.index.unlock(receipt)
        for node in self.host_pins:
            self.kv.index.unpin_host(node)
        for rid in list(self.swapped):
            self.kv.free(rid)
        self._flush()
        self.kv.assert_idle()
        self.kv.reset_prefix_cache()
        assert self.kv.index.num_nodes == 0
        for space in self.kv.spaces.values():
            assert space.num_free == space.num_pages
        if self.kv.host_tier is not None:
            self.kv.take_transfers()
            st_ = self.kv.host_tier.stats
            for k, v in (("loaded", sum(st_.loaded_pages.values())), ("written", sum(st_.written_pages.values())),
                         ("demoted", st_.demoted_nodes), ("host_evicted", st_.host_evicted_nodes + st_.host_copies_dropped)):
                TIER_COVERAGE[k] = TIER_COVERAGE.get(k, 0) + v
            for pool in self.kv.host_tier.pools.values():
                assert pool.num_free == pool.num_pages, f"host pool {pool.name!r} leaked pages"


class MistralLikeMachine(ShadowIndexMachine):
    specs = MISTRAL_LIKE
    pages = 10


class GemmaLikeMachine(ShadowIndexMachine):
    specs = GEMMA_LIKE
    pages = 12


class LfuGemmaLikeMachine(GemmaLikeMachine):
    policy = "lfu"


class SlruV4LikeMachine(ShadowIndexMachine):
    policy = "slru"


TIER_COVERAGE: dict[str, int] = {}  # tier events seen by the host-tier machines (coverage check)


class HostTierV4LikeMachine(ShadowIndexMachine):
    """The same rules over a host tier smaller than the device pool: device eviction demotes,
    admission loads back (the data tags travel with the copies), write-through fills the host and
    host eviction deletes host-only leaves or drops duplicate host copies."""

    host_pages = 10


class WriteBackGemmaLikeMachine(GemmaLikeMachine):
    host_pages = 16
    write_policy = "write_back"


class SelectiveMistralLikeMachine(MistralLikeMachine):
    host_pages = 8
    write_policy = "write_through_selective"


FAST = settings(max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=400, stateful_step_count=80, deadline=None, suppress_health_check=list(HealthCheck))

TestV4Like = ShadowIndexMachine.TestCase
TestV4Like.settings = FAST
TestMistralLike = MistralLikeMachine.TestCase
TestMistralLike.settings = FAST
TestGemmaLike = GemmaLikeMachine.TestCase
TestGemmaLike.settings = FAST
TestLfuGemmaLike = LfuGemmaLikeMachine.TestCase
TestLfuGemmaLike.settings = FAST
TestSlruV4Like = SlruV4LikeMachine.TestCase
TestSlruV4Like.settings = FAST
TestHostTierV4Like = HostTierV4LikeMachine.TestCase
TestHostTierV4Like.settings = FAST
TestWriteBackGemmaLike = WriteBackGemmaLikeMachine.TestCase
TestWriteBackGemmaLike.settings = FAST
TestSelectiveMistralLike = SelectiveMistralLikeMachine.TestCase
TestSelectiveMistralLike.settings = FAST


def test_host_tier_machine_reaches_every_tier_transition():
    """The host-tier rules are not vacuous: over a run the machine loads back, writes, demotes
    and evicts on the host, aborts a request whose load-back is still pending, swaps requests
    out and resumes one with its partial last page loaded back (each checked against the data
    tags and the ledgers as it happens)."""
    TIER_COVERAGE.clear()
    # Derandomized: the same examples on every run, so whether they cover every transition does
    # not depend on the seed (random runs reached no load-back now and then).
    run_state_machine_as_test(HostTierV4LikeMachine, settings=settings(FAST, max_examples=80, derandomize=True,
                                                                        database=None))
    assert all(TIER_COVERAGE.get(k, 0) > 0 for k in (
        "loaded", "written", "demoted", "host_evicted", "abort_pending_load", "swap_out", "swap_in_tail")), TIER_COVERAGE


class _SlowV4(ShadowIndexMachine):
    pass


class _SlowMistral(MistralLikeMachine):
    pass


TestV4LikeSlow = pytest.mark.slow(_SlowV4.TestCase)
TestV4LikeSlow.settings = SLOW
TestMistralLikeSlow = pytest.mark.slow(_SlowMistral.TestCase)
TestMistralLikeSlow.settings = SLOW
