"""KVCacheManager + ShadowIndex: sharing, eviction order, namespaces, exact ledgers."""
import random


from hybridkv.block_manager.kv_cache_manager import NULL_PAGE, KVCacheManager
from hybridkv.block_manager.space_spec import SpaceSpec

P = 4


def manager(pages=16, caching=True, specs=None):
    specs = specs or [SpaceSpec("full", bytes_per_slot=8)]
    return KVCacheManager(specs, {s.name: pages for s in specs}, P, caching)


def run(kv, rid, tokens, namespace=None):
    """Admit, 'compute' and finish a request: returns the tokens its prefix hit covered."""
    hit = kv.match_prefix(tokens, namespace)
    assert kv.allocate(rid, len(tokens), hit, namespace)
    kv.cache_computed_pages(rid, tokens, len(tokens))
    kv.free(rid)
    kv.check_invariants()
    return hit.num_tokens


def test_second_request_hits_whole_pages_but_never_the_last_token():
    kv = manager()
    toks = list(range(12))  # exactly 3 pages
    assert run(kv, "a", toks) == 0
    # The last token must be recomputed, so only 2 of 3 pages can be served.
    assert run(kv, "b", toks) == 8
    assert run(kv, "c", toks + [99]) == 12


def test_shared_pages_are_refcounted_and_not_evicted_while_held():
    kv = manager(pages=4)
    toks = list(range(8))
    run(kv, "a", toks)
    hit = kv.match_prefix(toks + [1])
    assert kv.allocate("b", 9, hit)
    assert kv.page_table("b", "full")[:2] == [n.shadows["full"] for n in hit.nodes]
    # Only 1 free page + nothing evictable: a 3-page request cannot fit now.
    assert not kv.allocate("c", 12)
    kv.check_invariants()
    kv.free("b")
    assert kv.allocate("c", 12)  # now the cached pages can be evicted
    kv.free("c")
    kv.assert_idle()


def test_eviction_is_lru_leaf_first():
    kv = manager(pages=6)
    a, b = [1] * 8, [2] * 8
    run(kv, "a", a)
    run(kv, "b", b)
    kv.match_prefix(a + [0])  # touch a: b is now least recently used
    assert kv.allocate("c", 8)  # 2 free pages, no eviction needed
    assert kv.allocate("d", 4)  # needs 1 more page: evicts b's leaf
    assert run(kv, "a2", a + [0]) == 8
    kv.free("c"), kv.free("d")
    kv.assert_idle()


def test_namespaces_never_share_pages():
    kv = manager()
    toks = list(range(9))
    run(kv, "a", toks, namespace="salt-1")
    assert run(kv, "b", toks, namespace="salt-2") == 0
    assert run(kv, "c", toks, namespace="salt-1") == 8


def test_failed_allocation_changes_nothing():
    kv = manager(pages=2)
    assert not kv.allocate("a", 12)
    kv.assert_idle()


def test_windowed_space_releases_out_of_window_pages():
    kv = manager(pages=8, specs=[SpaceSpec("swa", bytes_per_slot=8, window=6)])
    assert kv.allocate("a", 20)
    kv.release_out_of_window("a", 20)
    # next query at position 20 reads [15, 20]: pages 0..2 (tokens 0..11) are not needed
    assert kv.page_table("a", "swa")[:3] == [NULL_PAGE] * 3
    assert kv.spaces["swa"].num_free == 8 - 2
    kv.free("a")
    kv.assert_idle()


def test_random_workload_keeps_ledgers_exact():
    """Invariant: after every operation free + cached + in use == capacity and refcounts match tables."""
    rng = random.Random(0)
    kv = manager(pages=24)
    live: dict[str, list[int]] = {}
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    for step in range(600):
        op = rng.random()
        if op < 0.5 and len(live) < 6:
            toks = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(1, 10))]
            rid = f"r{step}"
            if kv.allocate(rid, len(toks), kv.match_prefix(toks)):
                live[rid] = toks
        elif op < 0.8 and live:
            rid = rng.choice(list(live))
            toks = live[rid]
            toks += [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
            if kv.allocate(rid, len(toks)):
                kv.cache_computed_pages(rid, toks, len(toks))
            else:
                toks[:] = toks[: len(kv.page_table(rid, "full")) * P]
        elif live:
            rid = rng.choice(list(live))
            kv.cache_computed_pages(rid, live[rid], min(len(live[rid]), len(kv.page_table(rid, "full")) * P))
            kv.free(rid)
            del live[rid]
        kv.check_invariants()
    for rid in list(live):
        kv.free(rid)
    kv.assert_idle()
    kv.reset_prefix_cache()
    assert kv.spaces["full"].num_free == 24


def test_a_prompt_prefilled_in_short_chunks_beside_a_decode_gets_one_run_of_pages():
    """Invariant: a prompt that grows a few tokens per step while another request decodes keeps
    consecutive page ids (attention reads it in place instead of gathering it every step);
    the decode's pages come from elsewhere."""
    kv = manager(pages=64, caching=False)
    assert kv.allocate("stream", 3)
    long, n = list(range(120)), 3
    for start in range(0, len(long), 2):  # 2 prompt tokens and 1 decoded token per step
        assert kv.allocate("long", start + 2)
        n += 1
        assert kv.allocate("stream", n, decode=True)
        kv.check_invariants()
    pages = kv.page_table("long", "full")
    assert len(pages) == 30 and pages == list(range(pages[0], pages[0] + 30)), pages
    assert not set(pages) & set(kv.page_table("stream", "full"))
    kv.free("long")
    kv.free("stream")
    kv.assert_idle()


def test_a_decoding_request_publishes_its_pages_in_batches_and_all_of_them_at_retire():
    """Invariant: a prompt is matchable as soon as it is computed; a decoding request's whole
    pages join the index publish_pages at a time (a page crossing between batches costs only its
    allocation) and every pending page at retire."""
    kv = KVCacheManager([SpaceSpec("full", bytes_per_slot=8)], {"full": 32}, P, True, decode_publish_tokens=3 * P)
    assert kv.publish_pages == 3
    toks = list(range(100, 109))  # a 9-token prompt: 2 whole pages
    assert kv.allocate("a", len(toks))
    kv.commit("a", toks, len(toks), prompt_done=True)
    assert kv.match_prefix(toks + [0]).num_tokens == 8  # the prompt at once
    published = []
    for t in range(200, 220):  # decode 20 tokens, one per step
        toks.append(t)
        assert kv.allocate("a", len(toks), decode=True)
        kv.commit("a", toks, len(toks))
        kv.check_invariants()
        published.append(kv.match_prefix(toks + [0], touch=False).num_tokens)
    # Pages complete at 12, 16, 20, ... tokens and are published 3 at a time: at 20 and at 32.
    assert set(published) == {8, 20} and published.index(20) == 20 - 9 - 1, published
    assert kv.request_pages["a"].commit_at == 32, "the next batch is due at 32 tokens"
    kv.retire("a", toks, len(toks), turn_done=True)
    assert kv.match_prefix(toks + [0]).num_tokens == 28, "retire publishes every pending whole page"
    kv.assert_idle()


def test_a_windowed_layout_publishes_every_decoded_page_so_the_next_turn_hits_in_full():
    """Invariant: with a windowed space, decoded pages are published one by one: a page batched
    past its window would only be a tombstone and cut the next turn's hit short."""
    specs = [SpaceSpec("full", bytes_per_slot=8), SpaceSpec("swa", bytes_per_slot=8, window=6)]
    kv = KVCacheManager(specs, {"full": 32, "swa": 32}, P, True, decode_publish_tokens=3 * P)
    assert kv.publish_pages == 1
    toks = list(range(100, 109))
    assert kv.allocate("a", len(toks))
    kv.commit("a", toks, len(toks), prompt_done=True)
    for t in range(200, 220):
        toks.append(t)
        assert kv.allocate("a", len(toks), decode=True)
        kv.commit("a", toks, len(toks))
        kv.check_invariants()
    kv.retire("a", toks, len(toks), turn_done=True)
    assert kv.match_prefix(toks + [0]).num_tokens == 28
    kv.assert_idle()


def test_pages_publish_one_by_one_for_prefill_chunks_and_with_batches_of_one():
    """Invariant: prefill chunks (no prompt done yet) publish every whole page at once (in-batch
    groups share a prompt's pages chunk by chunk), and decode_publish_tokens below a page
    publishes every decoded page, the behaviour before batching."""
    kv = manager(pages=32)
    prompt = list(range(1, 21))
    for end in (5, 10, 15):  # three chunks of a 20-token prompt
        assert kv.allocate("a", end)
        kv.commit("a", prompt, end)
        assert kv.match_prefix(prompt[:end] + [0], touch=False).num_tokens == end // P * P
    kv.free("a")
    kv = KVCacheManager([SpaceSpec("full", bytes_per_slot=8)], {"full": 32}, P, True, decode_publish_tokens=1)
    toks = list(range(1, 6))
    assert kv.allocate("a", 5)
    kv.commit("a", toks, 5, prompt_done=True)
    for t in range(6, 14):
        toks.append(t)
        assert kv.allocate("a", len(toks), decode=True)
        kv.commit("a", toks, len(toks))
        assert kv.match_prefix(toks + [0], touch=False).num_tokens == len(toks) // P * P
    kv.free("a")
    kv.assert_idle()
