"""model_executor/heap_retention.py: on the CPU the model runner keeps freed step tensors in the heap
(no page faults when the next layer allocates them again), HYBRIDKV_RETAIN_HEAP=0 leaves glibc's
malloc as it was, and outputs do not depend on it.

The fault counts are taken in fresh interpreters: mallopt's thresholds are process state that
cannot be put back to glibc's adaptive defaults."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hybridkv.model_executor import heap_retention, model_runner

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None

# Three 3 MiB activations live at once, then all freed, as a layer's are. Under glibc's defaults
# the first is mmapped (its free raises the mmap threshold to 3 MiB and the trim threshold to
# 6 MiB), the later ones grow the heap, and freeing 9 MiB at its top trims it: every round faults
# the pages in again. The probe counts minor faults over 20 rounds after six (the retained heap
# settles within four).
PROBE = '''
import json, resource, torch
from hybridkv.model_executor.heap_retention import retain_freed_heap
applied = retain_freed_heap().applied
def layer():
    xs = [torch.empty(3 << 18, dtype=torch.float32).fill_(1.0) for _ in range(3)]
    return sum(float(x[-1]) for x in xs)
for _ in range(6):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    layer()
print("RESULT " + json.dumps({"applied": applied,
                              "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
'''


def probe(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != heap_retention.ENV_SWITCH}
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:]
    return json.loads(line[-1][len("RESULT "):])


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_retained_heap_serves_the_next_layers_tensors_without_page_faults():
    on = probe({})
    off = probe({heap_retention.ENV_SWITCH: "0"})
    assert on["applied"] and not off["applied"], (on, off)
    # 20 rounds: glibc's defaults fault ~6 MiB of each round's 9 MiB in again (~1,500 faults of 4
    # KiB a round); the retained heap reuses its pages.
    assert off["faults"] > 20 * 1000, off
    assert on["faults"] < 200, on


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
    results = []
    for value in ("1", "0"):
        env = {k: v for k, v in os.environ.items() if k != heap_retention.ENV_SWITCH}
        env[heap_retention.ENV_SWITCH] = value
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    assert results[0] == results[1]
