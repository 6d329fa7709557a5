"""The engine runs with neither triton nor xformers installed (CI installs both, so they are
hidden here): a subprocess whose PYTHONPATH puts a sitecustomize first that makes every
`import triton...` / `import xformers...` raise ModuleNotFoundError, as on a machine without
them. In it: hybridkv imports, a tiny Llama checkpoint is built, LLM(attention_backend="auto")
generates greedily (torch_native on this CPU), and asking for "triton" or "xformers" is a clear
error naming what is missing."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

SITECUSTOMIZE = '''
import sys


class _HideGpuPackages:
    """A meta-path finder, first on sys.meta_path: the packages below do not exist."""

    HIDDEN = ("triton", "xformers")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/test_without_gpu_packages.py)",
                                      name=name)
        return None


sys.meta_path.insert(0, _HideGpuPackages())
'''

SCRIPT = '''
import os, sys, tempfile
for pkg in ("triton", "xformers", "xformers.ops"):
    try:
        __import__(pkg)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{pkg} is not hidden")

import hybridkv
from hybridkv import LLM, SamplingParams
from tiny_checkpoints import build_checkpoint

path = build_checkpoint(tempfile.mkdtemp(), "llama")
llm = LLM(path, dtype="float32", max_model_len=64, attention_backend="auto")
assert llm.engine.runner.attention_backend_name == "torch_native"
out = llm.generate(["the quick brown", "numbers 0 1 2"], SamplingParams(max_tokens=6, temperature=0))
assert [len(o.outputs[0].token_ids) for o in out] == [6, 6], out

errors = {}
for name, env in (("triton", "0"), ("triton", "1"), ("xformers", "0")):
    os.environ["TRITON_INTERPRET"] = env
    try:
        LLM(path, dtype="float32", max_model_len=64, attention_backend=name)
    except RuntimeError as e:
        errors[(name, env)] = str(e)
    else:
        raise SystemExit(f"attention_backend={name!r} did not fail without its package")
assert "needs the `triton` package: pip install triton" in errors[("triton", "0")], errors
assert "needs the `triton` package: pip install triton" in errors[("triton", "1")], errors
assert "attention_backend='xformers' needs a CUDA device; this runner is on cpu" in errors[("xformers", "0")], errors

loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "xformers"))
assert not loaded, loaded
print("OK")
'''


def test_engine_runs_without_triton_and_xformers(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(hide), TESTS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), (res.stdout[-2000:], res.stderr[-3000:])
