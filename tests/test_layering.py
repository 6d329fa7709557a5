"""The package's layering, checked on the source: dependencies point one way (entrypoints ->
engine -> block_manager, model_executor -> attention_backends), the model side sees the block
manager only through its hand-over types, tiers live behind the KV manager, and every module
stays readable in one sitting."""
from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("engine", "block_manager", "model_executor", "attention_backends", "entrypoints", "hybridkv")
MAX_MODULE_LINES = 700
# What the executor side may read of the block manager: the spaces' specs and the plan's types.
MODEL_SIDE_MAY_IMPORT = {"hybridkv.block_manager.space_spec", "hybridkv.block_manager.kv_plan"}


def modules(package: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    return sorted(out)


def imports_of(path: str) -> set[str]:
    """Every hybridkv module the file imports, at any depth (function-local imports too)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {m for m in found if m.startswith("hybridkv.")}


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


@pytest.mark.parametrize("package", ["model_executor", "attention_backends"])
def test_model_side_sees_the_block_manager_only_through_the_plan_types(package):
    bad = {rel(p): sorted(m for m in imports_of(p) if m.startswith("hybridkv.block_manager")
                          and m not in MODEL_SIDE_MAY_IMPORT)
           for p in modules(package)}
    bad = {p: ms for p, ms in bad.items() if ms}
    assert not bad, f"the model side imports block-manager internals (only {sorted(MODEL_SIDE_MAY_IMPORT)}): {bad}"


@pytest.mark.parametrize("package,forbidden", [
    ("block_manager", ("hybridkv.engine", "hybridkv.model_executor", "hybridkv.attention_backends",
                       "hybridkv.entrypoints")),
    ("model_executor", ("hybridkv.engine", "hybridkv.entrypoints")),
    ("attention_backends", ("hybridkv.engine", "hybridkv.model_executor", "hybridkv.entrypoints")),
    ("engine", ("hybridkv.entrypoints",)),
])
def test_dependencies_point_one_way(package, forbidden):
    bad = {rel(p): sorted(m for m in imports_of(p) if m.startswith(forbidden)) for p in modules(package)}
    bad = {p: ms for p, ms in bad.items() if ms}
    assert not bad, f"{package}/ imports a layer above it: {bad}"


def test_the_engine_does_no_tier_io():
    """Tier I/O (host page bytes, store reads and writes) lives under block_manager/ and the
    runner; the engine only wires the tiers and hands the runner its copies. (tp_host_pages.py
    is the tensor-parallel runner's side: every rank's host pages behind one HostPages.)"""
    assert not os.path.exists(os.path.join(ROOT, "engine", "storage_tier.py"))
    bad = {rel(p): sorted(m for m in imports_of(p) if m.endswith(("host_kv_cache", "storage_tier", ".storage.backend",
                                                                   "host_tier", "host_pool")))
           for p in modules("engine") if not p.endswith(("tier_factory.py", "tp_host_pages.py"))}
    bad = {p: ms for p, ms in bad.items() if ms}
    assert not bad, f"the engine reaches into the tiers: {bad}"


def test_the_scheduler_names_no_tier():
    """The scheduler asks the KV manager whether a request is ready; it never names a tier."""
    source = open(os.path.join(ROOT, "engine", "scheduler.py"), encoding="utf-8").read()
    words = ("storage", "StorageTier", "host_tier", "HostTier", "host_cache", "prefetch", "storage_tier")
    named = [w for w in words if re.search(rf"\b{w}\b", source)]
    assert not named, f"engine/scheduler.py names a tier: {named}"


def test_every_module_reads_in_one_sitting():
    long = {rel(p): n for pkg in PACKAGES for p in modules(pkg)
            if (n := sum(1 for _ in open(p, encoding="utf-8"))) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
    n = sum(1 for _ in open(os.path.join(ROOT, "engine", "llm_engine.py"), encoding="utf-8"))
    assert n <= 450, f"engine/llm_engine.py is {n} lines: its parts belong in their own modules"
