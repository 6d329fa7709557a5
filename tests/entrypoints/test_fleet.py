"""`hybridkv fleet` (entrypoints/fleet.py), all real processes: a redis-server, two `hybridkv
serve` replicas with the Redis storage tier, and SGLang's router in front. A prefix one replica
computed is a storage hit on the other; routed multi-turn conversations give the greedy text one
replica gives directly; after a replica is killed every new routed request succeeds; stopping
the fleet leaves no process behind."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from hybridkv.entrypoints.fleet import Fleet, free_port
from system_tools import require_program

pytestmark = pytest.mark.slow
SERVE = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "8", "--kv-cache-memory-bytes", "16MiB",
         "--served-model-name", "tiny", "--disable-access-log"]


def _post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        e.msg = f"{e.msg}: {e.read()[:500]!r}"  # the server's error body, in the failure message
        raise


def _chat(base: str, messages: list[dict]) -> tuple[str, int]:
    r = _post(f"{base}/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True})
    return r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def fleet(tiny_ckpt):
    require_program("redis-server", "apt-get install -y redis-server")
    require_program("sglang-router", "pip install sglang-router")
    f = Fleet(tiny_ckpt("llama"), replicas=2, port=free_port(), serve_args=SERVE)
    f.start()
    try:
        yield f
    finally:
        f.stop()
        left = [n for n, p in f.processes.items() if p.poll() is None]
        assert not left, f"processes left running after the fleet stopped: {left}"


def test_a_fleet_shares_prefixes_through_redis_and_survives_losing_a_replica(fleet):
    a, b = fleet.replica_urls
    doc = " ".join(f"fact {i}: hybrid attention keeps long contexts cheap." for i in range(10))
    first = _post(f"{a}/v1/completions", {"model": "tiny", "prompt": doc, "max_tokens": 2, "temperature": 0})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    pages = first["usage"]["prompt_tokens"] // 16
    import redis

    client = redis.Redis.from_url(fleet.redis_url)
    deadline = time.monotonic() + 15  # replica A's write-behind reaches Redis
    while client.dbsize() < pages and time.monotonic() < deadline:
        time.sleep(0.1)
    client.close()
    second = _post(f"{b}/v1/completions", {"model": "tiny", "prompt": doc, "max_tokens": 2, "temperature": 0})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (pages - 1) * 16, (
        "replica B did not hit the prefix replica A stored")
    assert second["choices"][0]["text"] == first["choices"][0]["text"]

    # 4 conversations x 6 turns through the router, each turn's answer appended to the history;
    # the same turns sent straight to replica A give the same greedy text.
    for c in range(4):
        routed_history: list[dict] = []
        for turn in range(6):
            routed_history.append({"role": "user", "content": f"conversation {c}, turn {turn}: tell me more"})
            routed, _ = _chat(fleet.url, routed_history)
            direct, _ = _chat(a, routed_history)
            assert routed == direct, f"conversation {c} turn {turn}: the routed answer differs from replica A's"
            routed_history.append({"role": "assistant", "content": routed})

    fleet.processes["replica 1"].kill()  # a replica dies; the router's health check drops it
    fleet.processes["replica 1"].wait()
    # At once, with no wait for the health check: conversations the cache-aware policy had sent
    # to the dead replica are retried until they reach the live one; every request succeeds.
    for c in range(4):
        text, _ = _chat(fleet.url, [{"role": "user", "content": f"conversation {c}, turn 0: tell me more"}])
        assert text is not None
        text, _ = _chat(fleet.url, [{"role": "user", "content": f"after the loss {c}"}])
        assert text is not None


def _wait_for_keys(url: str, at_least: int, timeout: float = 20) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + timeout
        while client.dbsize() < at_least:
            assert time.monotonic() < deadline, f"Redis holds {client.dbsize()} keys, expected {at_least}"
            time.sleep(0.1)
    finally:
        client.close()


def _num_keys(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return client.dbsize()
    finally:
        client.close()


def _doc(tag: str) -> str:
    return " ".join(f"{tag} fact {i}: hybrid attention keeps long contexts cheap." for i in range(10))


def test_a_fleet_keeps_serving_through_a_redis_outage_and_a_replica_restart(tiny_ckpt, redis_server):
    """Redis killed: every routed request still succeeds (reads miss, writes drop); Redis back
    (empty): a prefix one replica computes is again a hit on the other; a replica restarted with
    empty caches gets its prefix hits from Redis and the router takes it back."""
    require_program("sglang-router", "pip install sglang-router")
    fleet = Fleet(tiny_ckpt("llama"), replicas=2, port=free_port(), redis_url=redis_server.url, serve_args=SERVE)
    fleet.start()
    try:
        a, b = fleet.replica_urls
        redis_server.kill()
        for i in range(4):
            text, _ = _chat(fleet.url, [{"role": "user", "content": f"during the outage {i}"}])
            assert text is not None
        redis_server.start()  # same port, empty
        params = {"model": "tiny", "max_tokens": 2, "temperature": 0}
        deadline = time.monotonic() + 20
        while True:  # the replica's backend reconnects after its down-backoff
            first = _post(f"{a}/v1/completions", {**params, "prompt": _doc(f"back {time.monotonic():.3f}")})
            pages = first["usage"]["prompt_tokens"] // 16
            try:
                _wait_for_keys(redis_server.url, pages, timeout=3)
                break
            except AssertionError:
                assert time.monotonic() < deadline, "replica A never wrote to Redis after it came back"
        doc = _doc("shared")
        before = _num_keys(redis_server.url)
        first = _post(f"{a}/v1/completions", {**params, "prompt": doc})
        _wait_for_keys(redis_server.url, before + first["usage"]["prompt_tokens"] // 16)
        # A replica that failed a store call during the outage skips the store for its backend's
        # down_backoff_s (1 s by default) before it tries again.
        time.sleep(2.5)
        second = _post(f"{b}/v1/completions", {**params, "prompt": doc})
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "no hit on B after Redis came back"
        assert second["choices"][0]["text"] == first["choices"][0]["text"]

        fleet.restart_replica(1)  # empty caches: its hit comes from Redis
        again = _post(f"{b}/v1/completions", {**params, "prompt": doc})
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the restarted replica did not warm from Redis"
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        for i in range(4):  # routed requests keep succeeding with the replica back
            text, _ = _chat(fleet.url, [{"role": "user", "content": f"after the restart {i}"}])
            assert text is not None
    finally:
        fleet.stop()
        left = [n for n, p in fleet.processes.items() if p.poll() is None]
        assert not left, f"processes left running after the fleet stopped: {left}"
