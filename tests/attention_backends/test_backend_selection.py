"""attention_backend="auto" | "torch_native" | "triton" | "xformers": what each resolves to, and
the clear error (before the model is loaded) for one that cannot run on this machine."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hybridkv.attention_backends import registry
from hybridkv.attention_backends.registry import (
    ATTENTION_BACKEND_CHOICES, get_attention_backend, resolve_attention_backend,
)
from hybridkv.attention_backends.torch_native import TorchNativeAttention
from hybridkv.engine.config import EngineConfig
from hybridkv.entrypoints import LLM
from hybridkv.entrypoints.cli import build_parser, engine_kwargs
from hybridkv.model_executor import model_runner

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the model class is even resolved: the backend check comes first."""
    def refuse(config):
        raise AssertionError("the model was about to be loaded before the backend was checked")

    monkeypatch.setattr(model_runner, "resolve_model_class", refuse)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda.is_available() -> True, for the registry's checks only (nothing is run on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_choices_and_defaults():
    assert ATTENTION_BACKEND_CHOICES == ("auto", "torch_native", "triton", "xformers")
    assert EngineConfig().attention_backend == "auto"
    args = build_parser().parse_args(["generate"])
    assert engine_kwargs(args)["attention_backend"] == "auto"
    for name in ATTENTION_BACKEND_CHOICES:
        assert engine_kwargs(build_parser().parse_args(["serve", "--attention-backend", name]))["attention_backend"] == name


def test_unknown_names_are_refused_everywhere(capsys):
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; choose one of: auto, torch_native"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_attention_backend("Triton")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--attention-backend", "flash"])
    assert "invalid choice" in capsys.readouterr().err


def test_auto_is_torch_native_on_cpu_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="hybridkv.attention_backends.registry"):
        assert resolve_attention_backend("auto", "cpu") == "torch_native"
    assert "auto -> torch_native" in caplog.text
    assert isinstance(get_attention_backend("auto"), TorchNativeAttention)


def test_auto_on_cuda_is_triton_when_it_imports(fake_cuda, monkeypatch):
    pytest.importorskip("triton")
    assert resolve_attention_backend("auto", "cuda") == "triton"
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    assert resolve_attention_backend("auto", "cuda") == "torch_native"


def test_llm_auto_on_cpu_runs_torch_native(tiny_ckpt):
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64)
    runner = llm.engine.runner
    assert runner.attention_backend_name == "torch_native" == runner.backend.name
    assert runner.model.attention_backend_name == "torch_native"  # what a model binding its own backend reads


@pytest.mark.parametrize("name, message", [
    ("xformers", "attention_backend='xformers' needs a CUDA device; this runner is on cpu"),
    ("triton", "attention_backend='triton' needs a CUDA device; this runner is on cpu"),
])
def test_gpu_backends_on_cpu_fail_before_the_model_loads(name, message, tiny_ckpt, no_model_load, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if name == "triton":
        pytest.importorskip("triton")  # without the package the error names the package instead
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(")):
        LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64, attention_backend=name)


def test_triton_without_the_package_names_it(monkeypatch, no_model_load, tiny_ckpt):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(RuntimeError, match=r"needs the `triton` package: pip install triton"):
        LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64, attention_backend="triton")


def test_xformers_without_the_package_names_it(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers", None)
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    with pytest.raises(RuntimeError, match=r"needs the `xformers` package: pip install xformers"):
        resolve_attention_backend("xformers", "cuda")


def test_xformers_backend_refuses_to_be_built_on_cpu():
    from hybridkv.attention_backends.xformers_attention import XformersAttention

    with pytest.raises(RuntimeError, match="needs a CUDA device; this runner is on cpu"):
        XformersAttention(device="cpu")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        get_attention_backend("xformers", "cpu")


def test_registry_imports_neither_triton_nor_xformers():
    code = textwrap.dedent("""
        import sys
        import hybridkv, hybridkv.attention_backends.registry as r
        import hybridkv.attention_backends.xformers_attention
        from hybridkv.engine.config import EngineConfig
        from hybridkv.entrypoints import LLM
        r.resolve_attention_backend("auto", "cpu")
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "xformers"))
        assert not loaded, loaded
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]


def test_triton_on_cpu_under_the_interpreter(tiny_ckpt):
    """TRITON_INTERPRET=1 (how CI checks the kernels) lets "triton" run on the CPU: the engine
    picks TritonAttention and greedy decoding equals torch-native's (float32). A subprocess:
    the interpreter must be on before the kernels are imported."""
    pytest.importorskip("triton")
    path = tiny_ckpt("llama")
    code = textwrap.dedent(f"""
        from hybridkv import LLM, SamplingParams
        params = SamplingParams(max_tokens=6, temperature=0)
        prompts = ["the quick brown", "a lighthouse keeper named Ada found"]
        out = {{}}
        for name in ("triton", "torch_native"):
            llm = LLM({path!r}, dtype="float32", max_model_len=64, attention_backend=name)
            assert llm.engine.runner.backend.name == name
            out[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert out["triton"] == out["torch_native"], out
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-3000:]


# -- the engine's device (LLM(device=...), --device) -------------------------------------------
@pytest.mark.parametrize("bad, message", [
    ("cuda", "needs a CUDA build of torch and a visible GPU"),
    ("cuda:1", "needs a CUDA build of torch and a visible GPU"),
    ("mps", "device must be 'cpu', 'cuda', 'cuda:N' or 'auto'"),
    ("gpu0", "device must be 'cpu', 'cuda', 'cuda:N' or 'auto'"),
])
def test_a_device_this_machine_lacks_fails_before_the_model_loads(bad, message, tiny_ckpt, no_model_load):
    if torch.cuda.is_available() and bad.startswith("cuda"):
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=message):
        LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64, device=bad)


def test_device_auto_is_the_cpu_here_and_cpu_picks_torch_native(tiny_ckpt):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto means cuda")
    llm = LLM(tiny_ckpt("llama"), dtype="float32", max_model_len=64, device="auto")
    runner = llm.engine.runner
    assert runner.device == torch.device("cpu") and runner.attention_backend_name == "torch_native"
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids


def test_device_auto_resolves_to_cuda_when_torch_sees_one(fake_cuda):
    """The resolution rule alone (nothing runs on it): auto -> cuda, and with it attention auto ->
    triton when the package imports (what LLM(device="auto") does on a GPU machine)."""
    from hybridkv.engine.config import resolve_device
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    pytest.importorskip("triton")
    assert resolve_attention_backend("auto", resolve_device("auto")) == "triton"


def test_the_cli_device_flag_reaches_the_engine_config():
    args = build_parser().parse_args(["generate", "hi", "--device", "auto"])
    assert EngineConfig(**engine_kwargs(args)).device == "auto"
    assert EngineConfig(**engine_kwargs(build_parser().parse_args(["generate", "hi"]))).device == "cpu"
