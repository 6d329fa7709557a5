"""Two `hybridkv serve` instances running at once and sharing one Redis (HiCache L3): a prompt
instance A served is a prefix hit on instance B (usage.prompt_tokens_details.cached_tokens > 0)
with the same text, and the other way round."""
from __future__ import annotations

from server_harness import MODEL, launch

PROMPT = "a shared store lets a fleet of servers reuse prefixes " * 3


def test_instance_b_hits_what_instance_a_served(tiny_ckpt, redis_server):
    """Both instances run at once (a fleet, not a restart): B serves A's prompt from Redis while
    A is still up, then A serves B's new prompt the same way."""
    kw = dict(enable_hierarchical_cache=True, hicache_storage_backend="redis",
              hicache_storage_backend_extra_config={"url": redis_server.url},
              hicache_storage_prefetch_policy="wait_complete", dtype="float32")
    a = launch(tiny_ckpt("llama"), api_key=None, **kw)
    try:
        b = launch(tiny_ckpt("llama"), api_key=None, **kw)
        try:
            ca, cb = a.client(), b.client()
            first = ca.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            a.engine.call_threadsafe(lambda e: e.storage.drain()).result(30)
            second = cb.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
            assert second.usage.prompt_tokens_details.cached_tokens > 0, second.usage
            assert second.choices[0].text == first.choices[0].text
            # The other way round, while both still run.
            other = "and the other way round, a second prompt long enough for whole pages " * 3
            from_b = cb.completions.create(model=MODEL, prompt=other, max_tokens=8, temperature=0)
            b.engine.call_threadsafe(lambda e: e.storage.drain()).result(30)
            from_a = ca.completions.create(model=MODEL, prompt=other, max_tokens=8, temperature=0)
            assert from_a.usage.prompt_tokens_details.cached_tokens > 0, from_a.usage
            assert from_a.choices[0].text == from_b.choices[0].text
            status, _, raw = b.request("GET", "/metrics", auth=False)
            metrics = {}
            for line in raw.decode().splitlines():
                if line and not line.startswith("#"):
                    name, value = line.rsplit(" ", 1)
                    metrics[name.split("{")[0]] = metrics.get(name.split("{")[0], 0.0) + float(value)
            assert metrics["hybridkv:storage_prefetch_pages_total"] > 0, "storage metrics did not move"
            assert metrics["hybridkv:storage_prefetch_outstanding"] == 0, "a prefetch reservation leaked"
            assert metrics["hybridkv:storage_prefetch_pinned_pages"] == 0, "a host pin leaked"
            assert metrics["hybridkv:storage_hits_total"] > 0
            ca.close()
            cb.close()
            a.engine.check_idle()
            b.engine.check_idle()
        finally:
            b.stop()
    finally:
        a.stop()
