"""tensor_parallel_size=2 on the CPU (gloo): the same greedy tokens and prompt logprobs as one
process across prefix hits, chunked prefill and preemption; fewer KV heads than ranks; a worker
that dies fails generate naming its rank, an idle engine fails nothing; tensor_parallel_size=1
starts nothing."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch.distributed as dist

from hybridkv.entrypoints import LLM, SamplingParams
from tp_helpers import (  # noqa: F401 - shut_down: a fixture
    GREEDY, assert_logprobs_close, kv_bytes, no_workers_left, prompts_with_prefix, run_passes, shut_down,
)


@pytest.mark.slow
# pages: a few sequences at a time, so decodes preempt each other (Gemma-3's sliding space is
# sized for max_num_seqs windows first: 18 pages of budget leave the full space fewer).
@pytest.mark.parametrize("arch,overrides,pages", [
    ("llama", {"num_key_value_heads": 4, "attention_bias": True}, 10),  # GQA: 2 KV heads per rank; row-parallel bias
    ("llama", {"num_key_value_heads": 1}, 10),  # fewer KV heads than ranks: replicated
    ("qwen3", {}, 10),  # per-head q/k norms
    ("mistral", {}, 10),  # every layer sliding: the "swa" space
    ("gemma3_text", {}, 18),  # full and sliding spaces, tied vocab-parallel head, softcap
], ids=["llama-gqa", "llama-one-kv-head", "qwen3", "mistral", "gemma3"])
def test_two_ranks_match_one_process(tiny_ckpt, shut_down, arch, overrides, pages):
    path = tiny_ckpt(arch, **overrides)
    common = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8)
    one = LLM(path, kv_cache_memory_bytes=kv_bytes(path, 1, pages), **common)
    prompts = prompts_with_prefix(one.engine.runner.config.vocab_size, 8)
    want = run_passes(one, prompts)
    two = LLM(path, kv_cache_memory_bytes=kv_bytes(path, 2, pages), tensor_parallel_size=2, **common)
    shut_down(two)
    got = run_passes(two, prompts)
    two.shutdown()
    assert [p.exitcode for p in two.engine.runner.workers.processes] == [0], "a worker did not stop cleanly"
    assert got["pages"] == want["pages"]
    assert want["preemptions"] > 0 and want["cached"] > 0, "the setting should preempt and hit the prefix cache"
    assert got["tokens"] == want["tokens"]
    assert (got["preemptions"], got["cached"]) == (want["preemptions"], want["cached"])
    assert_logprobs_close(got["prompt_logprobs"], want["prompt_logprobs"])


@pytest.mark.slow
def test_a_killed_worker_fails_generate_naming_its_rank(tiny_ckpt, shut_down):
    llm = LLM(tiny_ckpt("llama", num_key_value_heads=4), dtype="float32", tensor_parallel_size=2)
    shut_down(llm)
    runner = llm.engine.runner
    worker = runner.workers.processes[0]
    execute, calls = runner.execute, []

    def execute_then_kill(batch, plan):
        calls.append(1)
        if len(calls) == 3:  # mid-generation: prompts computed, decodes running
            os.kill(worker.pid, signal.SIGKILL)
        return execute(batch, plan)

    runner.execute = execute_then_kill
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 exited with code -9"):
        llm.generate(prompts_with_prefix(320, 4), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert no_workers_left()
    with pytest.raises(RuntimeError, match="rank 1"):  # the engine stays failed, and says why
        llm.generate(prompts_with_prefix(320, 1), GREEDY, use_tqdm=False)


@pytest.mark.slow
def test_an_idle_gap_longer_than_the_step_timeout_does_not_fail_the_workers(tiny_ckpt, shut_down, monkeypatch):
    """The workers wait for the driver's next step as long as the engine is idle (a server with
    no traffic); only the model's collectives are held to HYBRIDKV_TP_TIMEOUT_S."""
    monkeypatch.setenv("HYBRIDKV_TP_TIMEOUT_S", "2")
    llm = LLM(tiny_ckpt("llama", num_key_value_heads=4), dtype="float32", tensor_parallel_size=2)
    shut_down(llm)
    first = llm.generate(prompts_with_prefix(320, 2), GREEDY, use_tqdm=False)
    time.sleep(5)
    assert [p.exitcode for p in llm.engine.runner.workers.processes] == [None]
    again = llm.generate(prompts_with_prefix(320, 2), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


@pytest.mark.slow
def test_an_idle_async_engine_dies_naming_a_killed_worker(tiny_ckpt):
    """No request needs to fail first: the engine thread looks at its workers while idle, so a
    server's /health turns 503 (and `hybridkv serve` exits) within a few seconds."""
    from hybridkv.engine.async_llm_engine import AsyncLLMEngine
    from hybridkv.engine.config import EngineConfig

    engine = AsyncLLMEngine.from_config(EngineConfig(model=tiny_ckpt("llama", num_key_value_heads=4),
                                                     dtype="float32", tensor_parallel_size=2))
    try:
        assert engine.is_healthy
        os.kill(engine.engine.runner.workers.processes[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.is_healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_healthy
        assert "worker rank 1 exited with code -9" in str(engine.dead_error)
    finally:
        engine.shutdown()
    assert no_workers_left()


def test_one_rank_starts_no_process_and_no_process_group(tiny_ckpt):
    llm = LLM(tiny_ckpt("llama"), dtype="float32", tensor_parallel_size=1)
    assert llm.generate(prompts_with_prefix(320, 1), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert not multiprocessing.active_children()
    assert not dist.is_initialized()
    assert llm.engine.runner.parallel is None


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be"),
])
def test_unsupported_settings_are_refused_before_any_process_starts(tiny_ckpt, kwargs, match):
    kwargs = {"tensor_parallel_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        LLM(tiny_ckpt("llama"), dtype="float32", **kwargs)
    assert no_workers_left()


def test_heads_that_do_not_split_are_refused_naming_the_count(tiny_ckpt):
    with pytest.raises(ValueError, match="3 attention heads"):
        LLM(tiny_ckpt("llama", num_attention_heads=3, num_key_value_heads=3, hidden_size=48), dtype="float32",
            tensor_parallel_size=2)
    assert no_workers_left()


EXIT_WITHOUT_SHUTDOWN = """
import sys
from hybridkv.entrypoints import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    print(llm.engine.runner.workers.processes[0].pid, flush=True)
"""


def _running(pid: int) -> bool:
    """Whether pid is a live process (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_interpreter_exit_stops_the_workers(tiny_ckpt, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exit_without_shutdown.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    done = subprocess.run([sys.executable, str(script), tiny_ckpt("llama", num_key_value_heads=4)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid), f"worker {pid} outlived its driver"


@pytest.mark.slow
def test_a_shut_down_engine_says_so(tiny_ckpt, shut_down):
    llm = LLM(tiny_ckpt("llama", num_key_value_heads=4), dtype="float32", tensor_parallel_size=2)
    shut_down(llm)
    llm.shutdown()
    assert no_workers_left()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompts_with_prefix(320, 1), GREEDY, use_tqdm=False)


def test_quantized_dense_checkpoints_are_refused_before_any_process_starts(tmp_path):
    from tiny_quantized import build_hf_fp8_checkpoint

    path = build_hf_fp8_checkpoint(str(tmp_path / "fp8"), "llama", num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"quantized \(FP8/FP4\) LlamaForCausalLM checkpoints are not supported yet"):
        LLM(path, dtype="float32", tensor_parallel_size=2)
    assert no_workers_left()
