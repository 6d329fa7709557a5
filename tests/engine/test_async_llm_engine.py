"""AsyncLLMEngine: outputs equal the offline engine's, every way out of a request frees its pages,
validation errors surface before any output, and a fatal step error fails requests cleanly."""
from __future__ import annotations

import asyncio
import time

import pytest

from hybridkv.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.sampling_params import RequestOutputKind, SamplingParams
from hybridkv.entrypoints import LLM

PROMPTS = ["the quick brown fox", "a lighthouse keeper named Ada", "numbers 0 1 2 3"]


def _params(kind: RequestOutputKind = RequestOutputKind.DELTA, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 8), ignore_eos=True, output_kind=kind, **kw)


def _slow_steps(engine: AsyncLLMEngine, seconds: float = 0.01) -> None:
    """Each step of `engine` takes `seconds` longer. The tiny model runs a 100-token stream in
    ~0.1 s, and on a loaded machine its engine thread once finished all of it before a shutdown
    sent after the first token got through (CI: "DID NOT RAISE"). Tests about what happens to a
    stream in flight use this so that it surely is."""
    def install(e):
        real = e.step
        e.step = lambda: time.sleep(seconds) or real()  # instance attribute: only this engine

    engine.call_threadsafe(install).result(10)


@pytest.fixture
def engine(tiny_ckpt):
    eng = AsyncLLMEngine.from_config(EngineConfig(model=tiny_ckpt("llama"), max_model_len=128))
    yield eng
    eng.shutdown()


async def _collect(eng: AsyncLLMEngine, prompt: str, params: SamplingParams, rid: str):
    return [out async for out in eng.generate(prompt, params, rid)]


def test_delta_and_cumulative_streams_equal_offline_generate(engine, tiny_ckpt):
    ref = LLM(tiny_ckpt("llama"), max_model_len=128).generate(PROMPTS, _params(RequestOutputKind.FINAL_ONLY),
                                                               use_tqdm=False)

    async def run():
        deltas = await asyncio.gather(*(_collect(engine, p, _params(), f"d{i}") for i, p in enumerate(PROMPTS)))
        cumul = await asyncio.gather(*(_collect(engine, p, _params(RequestOutputKind.CUMULATIVE), f"c{i}")
                                       for i, p in enumerate(PROMPTS)))
        return deltas, cumul

    deltas, cumul = asyncio.run(run())
    for r, d, c in zip(ref, deltas, cumul):
        assert d[-1].finished and c[-1].finished and not any(o.finished for o in d[:-1])
        assert "".join(o.outputs[0].text for o in d) == r.outputs[0].text
        assert [t for o in d for t in o.outputs[0].token_ids] == r.outputs[0].token_ids
        assert c[-1].outputs[0].text == r.outputs[0].text
        assert c[-1].outputs[0].token_ids == r.outputs[0].token_ids
    engine.check_idle()


def test_validation_error_raises_before_any_output(engine):
    async def run():
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate("", _params(), "bad"):
                pytest.fail("no output may precede a validation error")
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.add_request("long", "hello", _params(max_tokens=10_000))

    asyncio.run(run())
    engine.check_idle()


def test_duplicate_request_id_is_rejected_and_batch_add_is_all_or_nothing(engine):
    from hybridkv.engine.async_llm_engine import GenerateRequest

    async def run():
        stream = await engine.add_request("same", "hello", _params(max_tokens=50))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("same", "hello", _params())
        with pytest.raises(ValueError):
            await engine.add_requests([GenerateRequest("ok1", "hello", _params()), GenerateRequest("bad", "", _params())])
        assert engine.snapshot().num_unfinished_requests <= 1  # only "same"; ok1 was rolled back
        await stream.aclose()

    asyncio.run(run())
    engine.check_idle()


def test_dropping_the_iterator_aborts_and_frees_pages(engine):
    async def run():
        gen = engine.generate("the quick brown fox", _params(max_tokens=100), "drop")
        async for _ in gen:
            break
        await gen.aclose()  # what `async for ... break` + garbage collection does eventually
        await engine.wait_until_idle()

    asyncio.run(run())


def test_cancelled_consumer_task_aborts_its_request(engine):
    async def run():
        seen = asyncio.Event()

        async def consume():
            async for _ in engine.generate("the quick brown fox", _params(max_tokens=100), "cancel"):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.wait_until_idle()

    asyncio.run(run())


def test_abort_by_id_from_outside_ends_the_stream_with_request_aborted(engine):
    _slow_steps(engine)

    async def run():
        stream = await engine.add_request("ext", "the quick brown fox", _params(max_tokens=100))
        await stream.__anext__()
        engine.abort("ext")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        await engine.wait_until_idle()

    asyncio.run(run())


def test_fatal_step_error_fails_all_requests_and_marks_engine_dead(engine):
    calls = {"n": 0}

    def install(e):
        real = e.step

        def flaky():
            calls["n"] += 1
            if calls["n"] > 2:
                raise RuntimeError("boom")
            return real()

        e.step = flaky  # instance attribute: only this engine

    engine.call_threadsafe(install).result(10)

    async def run():
        streams = [engine.generate(p, _params(max_tokens=50), f"f{i}") for i, p in enumerate(PROMPTS)]

        async def drain(g):
            async for _ in g:
                pass

        results = await asyncio.gather(*(drain(g) for g in streams), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert engine.errored and not engine.is_healthy
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "hello", _params())

    asyncio.run(run())
    # The failed requests were aborted, so nothing leaks even though the engine is dead.
    engine.call_threadsafe(lambda e: e.kv.assert_idle()).result(10)
    assert not engine.call_threadsafe(lambda e: e.has_unfinished_requests()).result(10)


def test_shutdown_fails_in_flight_streams_and_joins_the_thread(engine):
    _slow_steps(engine)

    async def run():
        stream = await engine.add_request("s", "the quick brown fox", _params(max_tokens=100))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(run())
    assert not engine.is_running
    engine.engine.kv.assert_idle()  # the thread is gone: safe to inspect directly


def test_snapshot_counts_tokens_and_prefix_hits(engine):
    prompt = "the quick brown fox jumps over the lazy dog " * 3

    async def run():
        for rid in ("p1", "p2"):
            await _collect(engine, prompt, _params(max_tokens=2), rid)

    before = engine.snapshot()
    asyncio.run(run())
    engine.check_idle()
    after = engine.snapshot()
    assert after.prompt_tokens > before.prompt_tokens
    assert after.generation_tokens == before.generation_tokens + 4
    assert after.prefix_cache_hits > before.prefix_cache_hits  # the second prompt hit the first's pages
    assert set(after.spaces) and all(s.num_in_use == 0 for s in after.spaces.values())
