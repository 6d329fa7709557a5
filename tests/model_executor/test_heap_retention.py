"""model_executor/heap_retention.py: on the CPU the model runner keeps freed step tensors in the heap
(a large block comes from the heap and its pages stay mapped after free, so the next layer does not
fault them in again), HYBRIDKV_RETAIN_HEAP=0 leaves glibc's malloc as it was, and outputs do not
depend on it.

The probes run in fresh interpreters: mallopt's thresholds are process state that cannot be put
back to glibc's adaptive defaults."""
from __future__ import annotations

import os
import sys

import pytest

from hybridkv.model_executor import heap_retention, model_runner
from subprocess_probe import result, run_python  # tests/ is on sys.path (conftest's folder)

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None

# What the thresholds decide, seen through /proc/self/maps: where a 30 MiB block (a large layer
# activation) is placed, and whether the heap keeps its pages once the block is freed. Under
# glibc's defaults at start (mmap threshold 128 KiB) it gets a fresh mapping of its own, unmapped
# again by free (the next allocation faults its pages in again); retained, it comes from the heap
# and the heap stays mapped after free. ctypes' malloc, so that no other allocator sits between.
PROBE = '''
import ctypes, json
from hybridkv.model_executor.heap_retention import retain_freed_heap
applied = retain_freed_heap().applied
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return lo, hi
    return 0, 0
size = 30 << 20
p = libc.malloc(size)
ctypes.memset(p, 1, size)
lo, hi = heap()
in_heap = lo <= p and p + size <= hi
libc.free(p)
lo2, hi2 = heap()
print("RESULT " + json.dumps({"applied": applied, "in_heap": in_heap, "heap_after_free": hi2 - lo2}))
'''


def probe(env_extra: dict[str, str]) -> dict:
    return result(run_python(PROBE, env_extra, drop=(heap_retention.ENV_SWITCH,)))


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_retained_heap_serves_large_blocks_and_keeps_their_pages_after_free():
    on = probe({})
    off = probe({heap_retention.ENV_SWITCH: "0"})
    assert on["applied"] and not off["applied"], (on, off)
    assert on["in_heap"] and on["heap_after_free"] >= 30 << 20, on
    assert not off["in_heap"], off  # glibc's default: a mapping of its own, returned on free


def test_switch_off_is_reported_with_its_reason(monkeypatch):
    monkeypatch.setenv(heap_retention.ENV_SWITCH, "0")
    got = heap_retention.retain_freed_heap()
    assert not got.applied and heap_retention.ENV_SWITCH in got.reason


def test_the_cpu_model_runner_retains_the_heap_at_start(monkeypatch, tiny_ckpt):
    calls = []
    monkeypatch.setattr(model_runner, "retain_freed_heap",
                        lambda: calls.append(1) or heap_retention.HeapRetention(True, "recorded"))
    model_runner.ModelRunner(tiny_ckpt("llama"))
    assert calls == [1]


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_greedy_outputs_do_not_depend_on_heap_retention(tiny_ckpt):
    """The same engine, float32, with and without the retained heap: identical tokens and logprobs."""
    script = f'''
    import json
    from hybridkv import LLM, SamplingParams
    llm = LLM({tiny_ckpt("llama")!r}, dtype="float32", max_model_len=256, num_threads=2)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{{"prompt_token_ids": list(range(3, 3 + n))}} for n in (5, 40, 97)], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv.assert_idle()  # conftest's end-of-test invariant does not reach this process
    print("RESULT " + json.dumps([[o.outputs[0].token_ids, o.outputs[0].cumulative_logprob] for o in outs]))
    '''
    results = [result(run_python(script, {heap_retention.ENV_SWITCH: value}, timeout=600)) for value in ("1", "0")]
    assert results[0] == results[1]
