"""Reading a HuggingFace checkpoint folder: config, weight files, generation defaults, dtype.

This is the only place that touches the files of a checkpoint folder
(``config.json``, ``*.safetensors``, ``generation_config.json``). Everything
here works offline: a model is always a local folder, never a hub id, so every
``from_pretrained`` call passes ``local_files_only=True``.

Errors are ``ValueError`` whose message names the file at fault and says what
to fix, because these are the first thing a user sees when they point the
engine at the wrong folder.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.cpu_features import cpu_features

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_SINGLE_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
PICKLE_SINGLE_FILE = "pytorch_model.bin"
PICKLE_INDEX_FILE = "pytorch_model.bin.index.json"

# Pickle files commonly found next to weights that are *not* weights (Trainer
# output); globbing ``*.bin`` / ``*.pt`` must not pick them up.
_NON_WEIGHT_PICKLES = frozenset(
    {"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"}
)

# Sampling fields of generation_config.json that become per-model defaults
# (the same set vLLM honours). ``do_sample`` is deliberately ignored: the
# engine's sampling params decide greedy vs. random, as in vLLM.
SAMPLING_DEFAULT_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)
_INT_SAMPLING_KEYS = frozenset({"top_k", "max_new_tokens"})

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_OPTIONS = "'auto', 'float32' (or 'float'), 'bfloat16', 'float16' (or 'half'), or a torch dtype among those"


# --------------------------------------------------------------------------- config


def _require_folder(model_dir: str) -> None:
    if not os.path.isdir(model_dir):
        raise ValueError(
            f"Model folder '{model_dir}' does not exist; pass a path to a HuggingFace checkpoint folder "
            "(config.json + *.safetensors) or omit the model to use the built-in demo model"
        )


def _read_json(path: str, what: str) -> Any:
    """Parse a JSON file, turning syntax and encoding errors into a ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {what}") from e


def load_config(model_dir: str):
    """Load ``<model_dir>/config.json`` as a ``transformers.PretrainedConfig``.

    We parse the JSON ourselves first so that a missing file, a syntax error or
    an unknown ``model_type`` produce a message naming ``config.json`` instead
    of transformers' generic "is not a valid model identifier" errors, which
    talk about the hub. ``trust_remote_code`` is always False: a checkpoint
    must never run code on the server.
    """
    _require_folder(model_dir)
    path = os.path.join(model_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} is missing; a checkpoint folder needs a config.json describing the model "
            "(HuggingFace format, as written by save_pretrained)"
        )
    raw = _read_json(path, "fix or re-download the checkpoint's config.json")
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must contain a JSON object, found {type(raw).__name__}")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{path} has no 'model_type' field; add the model family (e.g. \"llama\")")

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import transformers

        raise ValueError(
            f"{path} has unknown model_type '{model_type}': transformers {transformers.__version__} does not "
            "know it, and remote code is not allowed (trust_remote_code=False); use a checkpoint of a "
            "supported architecture or a newer transformers"
        )
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"{path} could not be loaded by transformers: {e}") from e


# --------------------------------------------------------------------------- weight files


@dataclass(frozen=True)
class _WeightSource:
    """Where a folder's weights live, and how to check them.

    ``index_path``/``weight_map`` are set when a sharded index was used, so
    that ``iter_weights`` can report tensors the index promises but no shard
    holds.
    """

    files: list[str]
    is_pickle: bool
    index_path: str | None = None
    weight_map: dict[str, str] = field(default_factory=dict)


def _shards_from_index(model_dir: str, index_path: str) -> _WeightSource:
    raw = _read_json(index_path, "re-download the checkpoint's index file")
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(
            f"{index_path} is broken: it needs a non-empty 'weight_map' object mapping tensor names to shard files"
        )
    shards: list[str] = []
    for tensor_name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise ValueError(f"{index_path} is broken: tensor '{tensor_name}' maps to {shard!r}, not a file name")
        # Shards must sit in the folder itself; a name with a path could point anywhere on disk.
        if os.path.basename(shard) != shard or shard in (".", ".."):
            raise ValueError(
                f"{index_path} is broken: shard '{shard}' is not a plain file name inside the checkpoint folder"
            )
        if shard not in shards:
            shards.append(shard)
    files = []
    for shard in shards:
        path = os.path.join(model_dir, shard)
        if not os.path.isfile(path):
            raise ValueError(
                f"{index_path} lists shard '{shard}' but {path} is missing; the download is incomplete, "
                "fetch the missing shard"
            )
        files.append(path)
    return _WeightSource(files=files, is_pickle=index_path.endswith(PICKLE_INDEX_FILE), index_path=index_path,
                         weight_map=dict(weight_map))


def _pickle_files(model_dir: str) -> _WeightSource | None:
    if os.path.isfile(os.path.join(model_dir, PICKLE_SINGLE_FILE)):
        return _WeightSource(files=[os.path.join(model_dir, PICKLE_SINGLE_FILE)], is_pickle=True)
    index = os.path.join(model_dir, PICKLE_INDEX_FILE)
    if os.path.isfile(index):
        return _shards_from_index(model_dir, index)
    names = sorted(
        n
        for n in os.listdir(model_dir)
        if n.endswith((".bin", ".pt")) and n not in _NON_WEIGHT_PICKLES and os.path.isfile(os.path.join(model_dir, n))
    )
    if names:
        return _WeightSource(files=[os.path.join(model_dir, n) for n in names], is_pickle=True)
    return None


def _resolve_weights(model_dir: str, allow_pickle: bool) -> _WeightSource:
    """Pick the weight files of a folder: safetensors first, pickle only when allowed."""
    _require_folder(model_dir)
    single = os.path.join(model_dir, SAFETENSORS_SINGLE_FILE)
    if os.path.isfile(single):
        return _WeightSource(files=[single], is_pickle=False)
    index = os.path.join(model_dir, SAFETENSORS_INDEX_FILE)
    if os.path.isfile(index):
        return _shards_from_index(model_dir, index)
    names = sorted(
        n for n in os.listdir(model_dir) if n.endswith(".safetensors") and os.path.isfile(os.path.join(model_dir, n))
    )
    if names:
        return _WeightSource(files=[os.path.join(model_dir, n) for n in names], is_pickle=False)

    pickles = _pickle_files(model_dir)
    if pickles is not None:
        if not allow_pickle:
            listed = ", ".join(os.path.basename(p) for p in pickles.files)
            raise ValueError(
                f"{model_dir} has only pickle weights ({listed}) and no *.safetensors. Pickle files can run "
                "arbitrary code when loaded, so they are refused by default. Convert the checkpoint to "
                "safetensors, or, if you trust it, pass allow_pickle_weights=True to load them with "
                "torch.load(weights_only=True), which only accepts tensors and plain containers"
            )
        return pickles
    raise ValueError(
        f"{model_dir} has no weights: expected {SAFETENSORS_SINGLE_FILE}, {SAFETENSORS_INDEX_FILE} with its "
        "shards, or other *.safetensors files"
    )


def weight_files(model_dir: str, allow_pickle: bool = False) -> list[str]:
    """Paths of the weight files of a checkpoint folder, in load order.

    Order of preference: ``model.safetensors``; the shards listed in
    ``model.safetensors.index.json``; any ``*.safetensors``; then (only with
    ``allow_pickle``) ``pytorch_model.bin``, its index's shards, or ``*.bin``/``*.pt``.
    """
    return list(_resolve_weights(model_dir, allow_pickle).files)


def safetensors_names(model_dir: str) -> set[str]:
    """The tensor names of a safetensors checkpoint, read from the index or the file headers (no
    tensor data): what a model asks before it loads, e.g. whether an optional layer ships."""
    from safetensors import safe_open

    source = _resolve_weights(model_dir, allow_pickle=False)
    if source.weight_map:
        return set(source.weight_map)
    names: set[str] = set()
    for path in source.files:
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


# Bytes read from one memory map of a safetensors file before it is closed and opened again.
REMAP_BYTES = 64 << 20


def _iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    def corrupt(e: Exception) -> ValueError:
        return ValueError(f"{path} is not a valid safetensors file ({e}); the file is corrupt or truncated, "
                          "re-download it")

    def open_file():
        try:
            return safe_open(path, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for bad headers
            raise corrupt(e) from e

    with open_file() as handle:
        try:
            names = list(handle.keys())
        except Exception as e:
            raise corrupt(e) from e
    # The file is memory-mapped, and every page a tensor was read from stays in the process's
    # resident memory until the map is closed: a shard read whole would hold its size on top of
    # the weights it filled. So the map is reopened after every REMAP_BYTES read.
    start = 0
    while start < len(names):
        with open_file() as handle:  # releases the memory map (also when the consumer stops early)
            read = 0
            while start < len(names) and read < REMAP_BYTES:
                name = names[start]
                start += 1
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise corrupt(e) from e
                read += tensor.numel() * tensor.element_size()
                # The yield stays outside the try: errors thrown in by the consumer are not ours to rename.
                yield name, tensor


def _iter_pickle(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    import pickle

    try:
        # weights_only=True: the unpickler only builds tensors and plain containers, never arbitrary objects.
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise ValueError(
            f"{path} could not be loaded with torch.load(weights_only=True) ({e}); it is corrupt or holds "
            "objects other than tensors"
        ) from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, expected a dict of tensor name -> tensor")
    for name, tensor in obj.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{path} holds entry {name!r} of type {type(tensor).__name__}; expected only tensors")
        yield name, tensor


def iter_weights(model_dir: str, allow_pickle: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, one at a time.

    Safetensors files are opened with ``safe_open`` and read lazily, so only one
    tensor is materialised at a time and a model larger than RAM can be loaded
    shard by shard. Names are yielded exactly as stored on disk (e.g. a tied
    ``lm_head.weight`` is absent when the checkpoint does not store it); the
    model loader decides what to do with them. A tensor name appearing in two
    files, or promised by the index and found in no shard, is an error.
    """
    source = _resolve_weights(model_dir, allow_pickle)
    seen: dict[str, str] = {}
    for path in source.files:
        reader = _iter_pickle(path) if source.is_pickle else _iter_safetensors(path)
        for name, tensor in reader:
            if name in seen:
                raise ValueError(f"tensor '{name}' is stored in both {seen[name]} and {path}; the checkpoint is "
                                 "inconsistent")
            seen[name] = path
            yield name, tensor
    missing = [name for name in source.weight_map if name not in seen]
    if missing:
        raise ValueError(
            f"{source.index_path} lists {len(missing)} tensor(s) that no shard contains "
            f"(first: '{missing[0]}'); the shards do not match the index, re-download the checkpoint"
        )


# --------------------------------------------------------------------------- generation defaults


@dataclass
class GenerationDefaults:
    """What a checkpoint says about generation: stop tokens and sampling defaults.

    ``defaults`` holds only the keys of ``SAMPLING_DEFAULT_KEYS`` that the
    checkpoint actually sets, so the engine can tell "model default" from
    "engine default".
    """

    eos_token_ids: list[int] = field(default_factory=list)
    defaults: dict[str, float | int] = field(default_factory=dict)


def _eos_list(value: Any, path: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    out: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{path} has eos_token_id {value!r}; expected a non-negative int or a list of them")
        if v not in out:
            out.append(v)
    return out


def _config_eos(model_dir: str) -> list[int]:
    """eos_token_id of config.json (top level, or a multimodal config's text_config)."""
    path = os.path.join(model_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return []
    raw = _read_json(path, "fix or re-download the checkpoint's config.json")
    if not isinstance(raw, dict):
        return []
    value = raw.get("eos_token_id")
    if value is None and isinstance(raw.get("text_config"), dict):
        value = raw["text_config"].get("eos_token_id")
    return _eos_list(value, path)


def load_generation_config(model_dir: str) -> GenerationDefaults:
    """Read ``generation_config.json``: eos ids and the sampling defaults it sets.

    Without the file (or without an ``eos_token_id`` in it) the eos ids come
    from ``config.json``'s ``eos_token_id``. Plain JSON is read rather than
    ``transformers.GenerationConfig`` so that validation messages are ours and
    name the file.
    """
    _require_folder(model_dir)
    path = os.path.join(model_dir, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return GenerationDefaults(eos_token_ids=_config_eos(model_dir))
    raw = _read_json(path, "fix or delete generation_config.json")
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must contain a JSON object, found {type(raw).__name__}")
    eos = _eos_list(raw.get("eos_token_id"), path) or _config_eos(model_dir)
    defaults: dict[str, float | int] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = raw.get(key)
        if value is None:
            continue
        expected = (int,) if key in _INT_SAMPLING_KEYS else (int, float)
        if isinstance(value, bool) or not isinstance(value, expected):
            kind = "an integer" if key in _INT_SAMPLING_KEYS else "a number"
            raise ValueError(f"{path} has {key}={value!r}; expected {kind}")
        defaults[key] = value
    return GenerationDefaults(eos_token_ids=eos, defaults=defaults)


# --------------------------------------------------------------------------- dtype


def _dtype_from_name(name: str) -> torch.dtype | None:
    key = name.strip().lower()
    if key.startswith("torch."):
        key = key[len("torch."):]
    return _DTYPE_NAMES.get(key)


def resolve_dtype(dtype: str | torch.dtype, config, device: torch.device | str | None = None) -> torch.dtype:
    """The torch dtype to run the model in.

    ``"auto"`` takes the checkpoint's own dtype (``config.dtype``, or the older
    ``torch_dtype``) and falls back to float32 when the config does not say. On a CPU device
    (when ``device`` is given), ``"auto"`` keeps a bfloat16 / float16 checkpoint in float32
    unless the CPU computes that dtype natively (AVX-512 BF16 / AMX): without it torch's bf16
    matmuls run 7-100x slower than float32 (AVX2-only CPUs such as AMD Zen 3). The choice is
    logged. An explicit dtype is always honoured (with a warning where it is slow here).
    Only float32, bfloat16 and float16 are supported.
    """
    resolved = _resolve_checkpoint_dtype(dtype, config)
    if device is None or torch.device(device).type != "cpu":
        return resolved
    cpu = cpu_features()
    if resolved == torch.float32:
        logger.info("dtype float32 on %s", cpu.describe())
        return resolved
    name = str(resolved).replace("torch.", "")
    if cpu.native(resolved):
        logger.info("dtype %s: %s computes it natively", name, cpu.describe())
        return resolved
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":
        logger.info("dtype auto: the checkpoint is %s, but %s has no native %s compute, so the model runs in "
                    "float32 (pass dtype=%r to force it)", name, cpu.describe(), name, name)
        return torch.float32
    logger.warning("dtype %s on %s, which has no native %s compute: weights stay %s and inputs of many rows "
                   "widen them to float32 inside the matmul, so single-stream decode is faster than float32 "
                   "(half the bytes) and prefill about as fast, but batched decode of a few to ~30 sequences "
                   "is slower (dtype='auto' picks float32)", name, cpu.describe(), name, name)
    return resolved


def _resolve_checkpoint_dtype(dtype: str | torch.dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in _SUPPORTED_DTYPES:
            return dtype
        raise ValueError(f"Unsupported dtype {dtype}; use {_DTYPE_OPTIONS}")
    if not isinstance(dtype, str):
        raise ValueError(f"Unsupported dtype {dtype!r}; use {_DTYPE_OPTIONS}")
    if dtype.strip().lower() != "auto":
        resolved = _dtype_from_name(dtype)
        if resolved is None:
            raise ValueError(f"Unsupported dtype '{dtype}'; use {_DTYPE_OPTIONS}")
        return resolved

    # transformers 5 stores it as `dtype`; older configs (and v4) use `torch_dtype`.
    config_dtype = getattr(config, "dtype", None)
    if config_dtype is None:
        config_dtype = getattr(config, "__dict__", {}).get("torch_dtype")
    if config_dtype is None:
        return torch.float32
    if isinstance(config_dtype, torch.dtype):
        resolved = config_dtype if config_dtype in _SUPPORTED_DTYPES else None
    else:
        resolved = _dtype_from_name(str(config_dtype))
    if resolved is None:
        raise ValueError(
            f"config.json asks for dtype '{config_dtype}', which hybridkv does not run; pass dtype explicitly "
            f"({_DTYPE_OPTIONS})"
        )
    return resolved
