"""Which waiting requests the scheduler tries to admit first (SGLang's schedule_policy, our code).

  fcfs        arrival order of client requests, round-robin between them: the sequences of one
              request (its prompts x n) take turns with other requests' sequences, so a
              request that fans out into hundreds cannot hold a later one back (cache-agnostic)
  lpm         longest cached prefix first: requests that compute the least go first
  dfs-weight  depth-first over the prefix tree, heavier subtrees (more waiting requests whose
              hit ends inside them) first, so requests sharing a prefix run back to back

Cache-aware policies also do *in-batch prefix grouping*: when several waiting requests share
a prefix that is not cached yet, only the first of the group is admitted in this pass; the
others wait one pass and then hit the pages the first one computed instead of computing the
same prefix side by side. Preempted requests always go first (they were admitted before).

Cost per step does not grow with the queue's matching work: each waiting request is matched
once when it arrives and its hit is kept (`_MatchCache`); at most `max_matches_per_step`
matches run per step (new arrivals first, then the stalest cached hits are refreshed), so a
queue of thousands stays cache-aware instead of falling back to fcfs. An ordering hit is only a
hint: admission matches again for real (engine/scheduler.py), so a stale hint never changes
outputs, only the order.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from hybridkv.block_manager.kv_cache_manager import KVCacheManager
from hybridkv.engine.request import Request, RequestStatus

POLICIES = ("fcfs", "lpm", "dfs-weight")


@dataclass
class ScheduleOrder:
    """Waiting requests in the order to try; `deferred` ones are skipped this pass unless
    nothing else can run (so a group never stalls)."""

    requests: list[Request]
    deferred: set[str] = field(default_factory=set)  # request ids
    hits: dict[str, int] = field(default_factory=dict)  # request id -> cached tokens at ordering time


def round_robin(reqs: list[Request]) -> list[Request]:
    """Interleave sequences by client request (Request.client_id), requests in order of their
    first waiting sequence, each request's sequences in their own order. O(len(reqs))."""
    by_client: dict[Hashable, list[Request]] = {}
    for r in reqs:
        by_client.setdefault(r.client_id, []).append(r)
    if len(by_client) <= 1 or len(by_client) == len(reqs):
        return reqs  # nothing to interleave
    turns = deque(iter(group) for group in by_client.values())
    out: list[Request] = []
    while turns:
        it = turns.popleft()
        r = next(it, None)
        if r is not None:
            out.append(r)
            turns.append(it)
    return out


@dataclass
class _CachedMatch:
    tokens: int  # cached tokens when last matched
    node: object  # the last matched ShadowNode (None: no hit)
    stamp: int  # when it was (re)matched: smaller = staler
    chain: list[int] | None = None  # page hash chain of the prompt (for in-batch grouping)


@dataclass
class SchedulingPolicy:
    name: str = "fcfs"
    max_matches_per_step: int = 64  # prefix matches the ordering may run per step
    group_min_tokens: int = 32  # a shared uncached prefix this long is worth running once first
    _cache: dict[str, _CachedMatch] = field(default_factory=dict, repr=False)
    _clock: itertools.count = field(default_factory=itertools.count, repr=False)

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.name!r}; choose one of {list(POLICIES)}")

    def _hits(self, fresh: list[Request], kv: KVCacheManager) -> dict[str, _CachedMatch]:
        """Cached matches for the fresh waiting requests, refreshing at most
        max_matches_per_step of them (never matched first, then the stalest)."""
        live = {r.request_id for r in fresh}
        for rid in [rid for rid in self._cache if rid not in live]:
            del self._cache[rid]  # admitted or aborted
        todo = [r for r in fresh if r.request_id not in self._cache]
        if len(todo) < self.max_matches_per_step:
            stale = sorted((c.stamp, i) for i, r in enumerate(fresh) if (c := self._cache.get(r.request_id)))
            todo += [fresh[i] for _, i in stale[: self.max_matches_per_step - len(todo)]]
        for r in todo[: self.max_matches_per_step]:
            old = self._cache.get(r.request_id)
            if r.wants_prompt_logprobs:  # never served from cache
                tokens, node = 0, None
            else:
                h = kv.match_prefix(r.all_token_ids, r.namespace, touch=False)
                tokens, node = h.num_tokens, (h.nodes[-1] if h.nodes else None)
            self._cache[r.request_id] = _CachedMatch(tokens, node, next(self._clock), old.chain if old else None)
        unmatched = _CachedMatch(0, None, -1)
        return {r.request_id: self._cache.get(r.request_id, unmatched) for r in fresh}

    def order(self, waiting: Sequence[Request], kv: KVCacheManager) -> ScheduleOrder:
        reqs = list(waiting)
        if self.name == "fcfs" or kv.index is None:
            resumed = [r for r in reqs if r.status == RequestStatus.PREEMPTED]  # admitted before: first
            fresh = [r for r in reqs if r.status != RequestStatus.PREEMPTED]
            return ScheduleOrder(resumed + round_robin(fresh))
        resumed = [r for r in reqs if r.status == RequestStatus.PREEMPTED]
        fresh = [r for r in reqs if r.status != RequestStatus.PREEMPTED]
        cached = self._hits(fresh, kv)
        hits = {rid: c.tokens for rid, c in cached.items()}
        match_node = {rid: c.node for rid, c in cached.items()}
        if self.name == "lpm":
            fresh.sort(key=lambda r: -hits[r.request_id])  # stable: ties keep arrival order
        else:
            fresh = self._dfs_weight(fresh, match_node)
        ordered = resumed + fresh
        deferred = self._group(fresh, hits, kv.page_size)
        return ScheduleOrder(ordered, deferred, hits)

    def _chain(self, r: Request, page_size: int) -> list[int]:
        """Hash chain over the prompt's whole pages (before the last token), computed once per
        waiting request: the prompt of a fresh request does not change while it waits."""
        c = self._cache.get(r.request_id)
        if c is not None and c.chain is not None:
            return c.chain
        toks = r.all_token_ids
        chain: list[int] = []
        h: Hashable = ("ns", r.namespace)
        for i in range((len(toks) - 1) // page_size):
            h = hash((h, tuple(toks[i * page_size : (i + 1) * page_size])))
            chain.append(h)
        if c is not None:
            c.chain = chain
        return chain

    @staticmethod
    def _dfs_weight(reqs: list[Request], match_node: dict) -> list[Request]:
        """Weight of a node = waiting requests whose hit ends in its subtree; visit heavier
        children first, emitting each node's own requests (arrival order) before its children."""
        weight: dict = {}
        at: dict = {}
        children: dict = {}
        for r in reqs:
            node = match_node[r.request_id]
            top: Hashable = ("namespace", r.namespace)
            key = top if node is None else node
            at.setdefault(key, []).append(r)
            chain = [] if node is None else list(node.path())
            chain.append(top)
            for i, nd in enumerate(chain):
                weight[nd] = weight.get(nd, 0) + 1
                if i + 1 < len(chain):
                    children.setdefault(chain[i + 1], set()).add(nd)
        tops = sorted({("namespace", r.namespace) for r in reqs}, key=lambda t: -weight[t])
        out: list[Request] = []
        stack = list(reversed(tops))
        while stack:
            nd = stack.pop()
            out.extend(at.get(nd, []))
            kids = sorted(children.get(nd, ()), key=lambda c: (-weight[c], c.depth, c.last_access))
            stack.extend(reversed(kids))
        return out

    def _group(self, reqs: list[Request], hits: dict[str, int], page_size: int) -> set[str]:
        """Simulated prefix tree over the waiting prompts (in the chosen order): a request with
        little real cache hit that shares >= group_min_tokens uncached tokens with an earlier
        request waits for that one to publish its pages."""
        seen: set = set()
        deferred: set[str] = set()
        for r in reqs:
            hit = hits[r.request_id]
            chain = self._chain(r, page_size)
            shared = 0
            while shared < len(chain) and chain[shared] in seen:
                shared += 1
            if shared * page_size - hit >= self.group_min_tokens and hit < self.group_min_tokens:
                deferred.add(r.request_id)
            else:
                seen.update(chain)
        return deferred
