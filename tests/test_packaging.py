"""Packaging: the install adds exactly one top-level import package, `hybridkv`.

Checked in a fresh interpreter started outside the checkout (so the repository root is not on
sys.path, as for a user), against the installed distribution (`pip install -e .` in CI)."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUBPACKAGES = ("engine", "entrypoints", "block_manager", "model_executor", "attention_backends")


def test_one_import_package_and_no_top_level_subpackages(tmp_path):
    code = (
        "import importlib.util, sys\n"
        "import hybridkv\n"
        "from hybridkv import LLM, SamplingParams\n"
        "assert LLM.__module__ == 'hybridkv.entrypoints.llm', LLM.__module__\n"
        "assert SamplingParams(max_tokens=3).max_tokens == 3\n"
        f"leaked = [m for m in {SUBPACKAGES!r} if importlib.util.find_spec(m) is not None]\n"
        "assert not leaked, f'top-level modules importable: {leaked}'\n"
        "import hybridkv.block_manager.shadow_index, hybridkv.engine.scheduler\n"
        "print('ok')\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_python_dash_m_hybridkv_runs_the_cli(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "hybridkv", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and "generate" in res.stdout and "serve" in res.stdout, res.stderr[-2000:]


def test_no_module_imports_a_subpackage_by_its_top_level_name():
    """Every import inside the package, tests and benchmarks spells `hybridkv.<subpackage>`."""
    bad = []
    for folder in (*SUBPACKAGES, "hybridkv", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in SUBPACKAGES]
    assert not bad, "imports by top-level name: " + ", ".join(bad[:10])


def test_the_executor_reads_only_the_block_managers_hand_over():
    """model_executor and attention_backends import from block_manager only its vocabulary
    (space_spec) and its hand-over (kv_plan): the index, the tiers and the manager decide, and
    state the forward drives (HiSparse's hot buffers) lives on the executor side."""
    allowed = {"hybridkv.block_manager.space_spec", "hybridkv.block_manager.kv_plan"}
    bad = []
    for folder in ("model_executor", "attention_backends"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                        if n.startswith("hybridkv.block_manager") and n not in allowed]
    assert not bad, "executor imports of the block manager: " + ", ".join(bad)


def test_lower_layers_do_not_import_the_engine(tmp_path):
    """block_manager, model_executor and attention_backends load without hybridkv.engine."""
    code = (
        "import sys\n"
        "import hybridkv.block_manager.kv_cache_manager, hybridkv.model_executor.model_runner\n"
        "import hybridkv.attention_backends.torch_native\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('hybridkv.engine', 'hybridkv.entrypoints')))\n"
        "assert not loaded, loaded\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_every_cpu_kernel_source_ships_in_package_data():
    """The C++ kernels compile on the user's machine from the installed sources: a .cpp or .h that
    setup.py's package_data misses would leave a non-editable install on the torch fallback."""
    import fnmatch

    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    package_data = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "package_data"))
    sources = [p for top in SUBPACKAGES for ext in ("*.cpp", "*.h") for p in (ROOT / top).rglob(ext)]
    assert sources, "no kernel sources found: the test looks in the wrong place"
    for src in sources:
        rel = src.relative_to(ROOT)
        pkg = "hybridkv." + ".".join(rel.parts[:-1])
        assert any(fnmatch.fnmatch(src.name, g) for g in package_data.get(pkg, [])), f"{rel} is not in package_data[{pkg!r}]"
