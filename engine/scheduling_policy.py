"""Which waiting requests the scheduler tries to admit first (SGLang's schedule_policy, our code).

  fcfs        arrival order (cache-agnostic; no prefix matching while ordering)
  lpm         longest cached prefix first: requests that compute the least go first
  dfs-weight  depth-first over the prefix tree, heavier subtrees (more waiting requests whose
              hit ends inside them) first, so requests sharing a prefix run back to back

Cache-aware policies also do *in-batch prefix grouping*: when several waiting requests share
a prefix that is not cached yet, only the first of the group is admitted in this pass; the
others wait one pass and then hit the pages the first one computed instead of computing the
same prefix side by side. Preempted requests always go first (they were admitted before).
Beyond `max_cache_aware` waiting requests the cost of matching every one of them each step
is not worth it and the order falls back to fcfs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from block_manager.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus

POLICIES = ("fcfs", "lpm", "dfs-weight")


@dataclass
class ScheduleOrder:
    """Waiting requests in the order to try; `deferred` ones are skipped this pass unless
    nothing else can run (so a group never stalls)."""

    requests: list[Request]
    deferred: set[str] = field(default_factory=set)  # request ids
    hits: dict[str, int] = field(default_factory=dict)  # request id -> cached tokens at ordering time


@dataclass
class SchedulingPolicy:
    name: str = "fcfs"
    max_cache_aware: int = 128
    group_min_tokens: int = 32  # a shared uncached prefix this long is worth running once first

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.name!r}; choose one of {list(POLICIES)}")

    def order(self, waiting: Sequence[Request], kv: KVCacheManager) -> ScheduleOrder:
        reqs = list(waiting)
        if self.name == "fcfs" or kv.index is None or len(reqs) > self.max_cache_aware:
            return ScheduleOrder(reqs)
        resumed = [r for r in reqs if r.status == RequestStatus.PREEMPTED]
        fresh = [r for r in reqs if r.status != RequestStatus.PREEMPTED]
        hits = {}
        match_node = {}
        for r in fresh:
            if r.wants_prompt_logprobs:  # never served from cache
                hits[r.request_id], match_node[r.request_id] = 0, None
                continue
            h = kv.match_prefix(r.all_token_ids, r.namespace, touch=False)
            hits[r.request_id] = h.num_tokens
            match_node[r.request_id] = h.nodes[-1] if h.nodes else None
        if self.name == "lpm":
            fresh.sort(key=lambda r: -hits[r.request_id])  # stable: ties keep arrival order
        else:
            fresh = self._dfs_weight(fresh, match_node)
        ordered = resumed + fresh
        deferred = self._group(fresh, hits, kv.page_size)
        return ScheduleOrder(ordered, deferred, hits)

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
            toks = r.all_token_ids
            hit = hits[r.request_id]
            chain: list[int] = []
            h: Hashable = ("ns", r.namespace)
            for i in range((len(toks) - 1) // page_size):
                h = hash((h, tuple(toks[i * page_size : (i + 1) * page_size])))
                chain.append(h)
            shared = 0
            while shared < len(chain) and chain[shared] in seen:
                shared += 1
            if shared * page_size - hit >= self.group_min_tokens and hit < self.group_min_tokens:
                deferred.add(r.request_id)
            else:
                seen.update(chain)
        return deferred
