"""hybridkv/openmp_runtime.py: `import hybridkv` before torch puts torch's (and the kernels') OpenMP
calls on Intel's runtime; torch imported first, HYBRIDKV_OPENMP=gnu or a missing library keep GNU
libgomp; a bad switch value is an error naming it; and the engine's greedy tokens and logprobs do
not depend on which runtime runs the threads.

Each case runs in a fresh interpreter: the choice is made once per process, at import."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from hybridkv import openmp_runtime
import subprocess_probe  # tests/ is on sys.path (conftest's folder)
from subprocess_probe import result

INTEL_EXPECTED = sys.platform == "linux" and platform.machine() == "x86_64"

PROBE = '''
import ctypes, json, sys
{imports}
rt = hybridkv.OPENMP_RUNTIME
with open("/proc/self/maps") as f:
    mapped = "libiomp5.so" in f.read()
info = {{"name": rt.name, "reason": rt.reason, "iomp_mapped": mapped}}
if rt.name == "intel":
    iomp = ctypes.CDLL(rt.library)
    follow = []
    for n in (1, 2, 1):
        torch.set_num_threads(n)
        follow.append(iomp.omp_get_max_threads())
    info["iomp_follows_torch"] = follow
    process_wide = ctypes.cast(ctypes.CDLL(None).GOMP_parallel, ctypes.c_void_p).value
    info["gomp_parallel_is_intel"] = process_wide == ctypes.cast(iomp.GOMP_parallel, ctypes.c_void_p).value
    torch.set_num_threads(2)  # a parallel region on Intel's runtime, exact in integers
    n = 1 << 22
    info["parallel_sum_ok"] = int((torch.arange(n, dtype=torch.int64) * 3).sum()) == 3 * n * (n - 1) // 2
print("RESULT " + json.dumps(info))
'''


def run_python(script: str, env_extra: dict[str, str] | None = None, cwd: str | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """A fresh interpreter without this process's runtime switch or preload."""
    return subprocess_probe.run_python(script, env_extra, drop=("HYBRIDKV_OPENMP", "LD_PRELOAD"), cwd=cwd,
                                       timeout=timeout)


@pytest.mark.skipif(not INTEL_EXPECTED, reason="intel-openmp is installed on x86-64 Linux only")
def test_importing_hybridkv_first_puts_torch_on_intel_openmp():
    assert openmp_runtime.intel_library() is not None, \
        "libiomp5.so missing: `pip install -e .` installs intel-openmp on x86-64 Linux"
    info = result(run_python(PROBE.format(imports="import hybridkv\nimport torch")))
    assert info["name"] == "intel" and info["iomp_mapped"], info
    # torch's omp_set_num_threads reaches Intel's runtime, and the process resolves GOMP_parallel
    # (what torch's and the kernels' parallel regions call) to it: one runtime serves them all.
    assert info["iomp_follows_torch"] == [1, 2, 1], info
    assert info["gomp_parallel_is_intel"], info
    assert info["parallel_sum_ok"], info


def test_torch_imported_first_keeps_gnu_openmp():
    info = result(run_python(PROBE.format(imports="import torch\nimport hybridkv")))
    assert info["name"] == "gnu" and not info["iomp_mapped"], info
    assert "torch was imported before hybridkv" in info["reason"], info


def test_switch_gnu_keeps_gnu_openmp():
    info = result(run_python(PROBE.format(imports="import hybridkv\nimport torch"), {"HYBRIDKV_OPENMP": "gnu"}))
    assert info == {"name": "gnu", "reason": "HYBRIDKV_OPENMP=gnu", "iomp_mapped": False}, info


def test_bad_switch_value_is_an_error_naming_it():
    proc = run_python("import hybridkv", {"HYBRIDKV_OPENMP": "llvm"})
    assert proc.returncode != 0
    assert "HYBRIDKV_OPENMP='llvm': expected 'intel' or 'gnu'" in proc.stderr, proc.stderr[-2000:]


GENERATE = '''
import json, sys
import hybridkv
from hybridkv import LLM, SamplingParams
llm = LLM({path!r}, dtype={dtype!r}, max_model_len=256, num_threads=2, seed=0)
prompts = ["the quick brown fox", "a lighthouse keeper named Ada found " * 6, "numbers 0 1 2 3"]
outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True),
                    use_tqdm=False)
assert not llm.engine.has_unfinished_requests()
llm.engine.kv.assert_idle()  # conftest's end-of-test invariant, which does not reach this process
print("RESULT " + json.dumps({{"runtime": hybridkv.OPENMP_RUNTIME.name,
                               "tokens": [o.outputs[0].token_ids for o in outs],
                               "logprobs": [o.outputs[0].cumulative_logprob for o in outs]}}))
'''


@pytest.mark.skipif(not INTEL_EXPECTED, reason="intel-openmp is installed on x86-64 Linux only")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_outputs_do_not_depend_on_the_openmp_runtime(tiny_ckpt, tmp_path, dtype):
    path = tiny_ckpt("llama")
    script = GENERATE.format(path=path, dtype=dtype)
    intel = result(run_python(script, cwd=str(tmp_path)))
    gnu = result(run_python(script, {"HYBRIDKV_OPENMP": "gnu"}, cwd=str(tmp_path)))
    assert (intel["runtime"], gnu["runtime"]) == ("intel", "gnu")
    assert intel["tokens"] == gnu["tokens"]
    # Both runtimes split every parallel loop the same way (torch's static chunks over the same
    # thread count), so the sums are the same sums and the logprobs come out bit for bit equal.
    assert intel["logprobs"] == gnu["logprobs"]


ALONE = '''
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("openmp_runtime_alone", {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module  # dataclasses looks its module up there
spec.loader.exec_module(module)
module.intel_library = lambda: None  # as on a CPU or install without the intel-openmp wheel
rt = module.select()
print("RESULT " + json.dumps({{"name": rt.name, "reason": rt.reason, "torch": "torch" in sys.modules}}))
'''


def test_missing_intel_library_keeps_gnu_openmp():
    info = result(run_python(ALONE.format(path=openmp_runtime.__file__)))
    assert info["name"] == "gnu" and not info["torch"], info
    assert "libiomp5.so not installed" in info["reason"], info


@pytest.mark.skipif(not INTEL_EXPECTED, reason="intel-openmp is installed on x86-64 Linux only")
def test_preloaded_intel_library_is_reported_not_loaded_twice():
    library = str(openmp_runtime.intel_library())
    info = result(run_python(PROBE.format(imports="import torch\nimport hybridkv"), {"LD_PRELOAD": library}))
    assert info["name"] == "intel" and info["reason"] == "already loaded in this process", info
    assert info["gomp_parallel_is_intel"] and info["iomp_follows_torch"] == [1, 2, 1], info
