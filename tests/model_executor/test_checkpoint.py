"""Tests for model_executor.checkpoint: finding, validating and reading checkpoint files.

Every test builds a tiny Llama checkpoint in tmp_path with transformers, so
nothing is downloaded.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridkv.model_executor.checkpoint import (
    GenerationDefaults,
    iter_weights,
    load_config,
    load_generation_config,
    resolve_dtype,
    weight_files,
)


def _tiny_config(**overrides) -> LlamaConfig:
    kwargs = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=128)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def _save_tiny(path, max_shard_size: str | None = None, **config_overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config(**config_overrides))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return model


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("single")
    model = _save_tiny(path, tie_word_embeddings=False)
    return str(path), {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    model = _save_tiny(path, max_shard_size="20KB", tie_word_embeddings=False)
    return str(path), {k: v.clone() for k, v in model.state_dict().items()}


def _copy_dir(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, str(dst))
    return str(dst)


# ----------------------------------------------------------------------------- config


def test_load_config_reads_llama_config(single_dir):
    """config.json of a saved checkpoint loads as the matching transformers config class."""
    config = load_config(single_dir[0])
    assert config.model_type == "llama"
    assert config.hidden_size == 32 and config.num_key_value_heads == 2


def test_load_config_missing_folder_explains_demo_model(tmp_path):
    """A nonexistent folder is a ValueError that names the path and mentions the built-in demo model."""
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError) as err:
        load_config(missing)
    msg = str(err.value)
    assert f"Model folder '{missing}' does not exist" in msg
    assert "built-in demo model" in msg


def test_load_config_missing_config_json_names_file(tmp_path):
    """A folder without config.json is a ValueError naming <dir>/config.json."""
    with pytest.raises(ValueError, match="config.json is missing") as err:
        load_config(str(tmp_path))
    assert os.path.join(str(tmp_path), "config.json") in str(err.value)


def test_load_config_broken_json_names_file(tmp_path):
    """Invalid JSON in config.json is a ValueError naming the file and saying it is not valid JSON."""
    (tmp_path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ValueError, match="not valid JSON") as err:
        load_config(str(tmp_path))
    assert os.path.join(str(tmp_path), "config.json") in str(err.value)


def test_load_config_unknown_model_type_names_file_and_type(tmp_path):
    """An unknown model_type is a ValueError naming config.json and the bad model_type."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-real-arch"}))
    with pytest.raises(ValueError, match="unknown model_type 'not-a-real-arch'") as err:
        load_config(str(tmp_path))
    assert os.path.join(str(tmp_path), "config.json") in str(err.value)


def test_load_config_without_model_type_names_file(tmp_path):
    """config.json lacking model_type is a ValueError naming the file and the missing field."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="no 'model_type'") as err:
        load_config(str(tmp_path))
    assert os.path.join(str(tmp_path), "config.json") in str(err.value)


# ----------------------------------------------------------------------------- weights


def test_single_safetensors_file_found_and_all_tensors_match(single_dir):
    """A single model.safetensors is the only weight file, and iter_weights yields the saved state dict exactly."""
    path, state = single_dir
    assert weight_files(path) == [os.path.join(path, "model.safetensors")]
    loaded = dict(iter_weights(path))
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def test_sharded_checkpoint_uses_index_and_loads_every_tensor(sharded_dir):
    """Sharded checkpoints are read through model.safetensors.index.json, in index order, with every tensor equal."""
    path, state = sharded_dir
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = list(dict.fromkeys(index["weight_map"].values()))
    assert len(shards) > 1, "max_shard_size=20KB should produce several shards"
    assert weight_files(path) == [os.path.join(path, s) for s in shards]
    loaded = dict(iter_weights(path))
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name


def test_iter_weights_is_lazy_generator(single_dir):
    """iter_weights returns an iterator that yields one (name, tensor) pair at a time."""
    it = iter_weights(single_dir[0])
    name, tensor = next(it)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)
    it.close()


def test_tied_embeddings_yield_what_is_on_disk(tmp_path):
    """With tied embeddings iter_weights yields exactly the tensors stored in the file (no synthesized lm_head)."""
    from safetensors import safe_open

    _save_tiny(tmp_path, tie_word_embeddings=True)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        on_disk = set(f.keys())
    names = [name for name, _ in iter_weights(str(tmp_path))]
    assert set(names) == on_disk
    assert len(names) == len(on_disk)
    assert "model.embed_tokens.weight" in on_disk


def _write_pickle_checkpoint(tmp_path) -> dict[str, torch.Tensor]:
    model = _save_tiny(tmp_path, tie_word_embeddings=False)
    os.remove(tmp_path / "model.safetensors")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    return state


def test_pickle_weights_refused_by_default_with_explanation(tmp_path):
    """Only pytorch_model.bin present: refused, and the message explains the risk and allow_pickle_weights."""
    _write_pickle_checkpoint(tmp_path)
    for call in (lambda: weight_files(str(tmp_path)), lambda: list(iter_weights(str(tmp_path)))):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert "pytorch_model.bin" in msg
        assert "run arbitrary code" in msg
        assert "allow_pickle_weights=True" in msg
        assert "weights_only=True" in msg


def test_pickle_weights_loaded_when_allowed(tmp_path):
    """With allow_pickle=True the pickle file is loaded (weights_only) and matches the saved tensors."""
    state = _write_pickle_checkpoint(tmp_path)
    assert weight_files(str(tmp_path), allow_pickle=True) == [str(tmp_path / "pytorch_model.bin")]
    loaded = dict(iter_weights(str(tmp_path), allow_pickle=True))
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_pickle_with_arbitrary_objects_rejected_even_when_allowed(tmp_path):
    """A pickle holding a non-tensor object is refused by weights_only loading, as a ValueError naming the file."""
    import collections

    _save_tiny(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    torch.save({"x": collections.Counter("abc")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        list(iter_weights(str(tmp_path), allow_pickle=True))
    assert str(tmp_path / "pytorch_model.bin") in str(err.value)


def test_no_weights_names_folder(tmp_path):
    """A folder with neither safetensors nor pickle weights is a ValueError naming the folder."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no weights") as err:
        weight_files(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_missing_folder_for_weights(tmp_path):
    """weight_files on a nonexistent folder is the same 'does not exist' ValueError as load_config."""
    with pytest.raises(ValueError, match="does not exist"):
        weight_files(str(tmp_path / "nope"))


def test_broken_index_names_index_file(sharded_dir, tmp_path):
    """A syntactically broken index is a ValueError naming model.safetensors.index.json."""
    path = _copy_dir(sharded_dir[0], tmp_path / "ckpt")
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index, "w") as f:
        f.write("{ not json")
    with pytest.raises(ValueError) as err:
        weight_files(path)
    assert index in str(err.value)


def test_index_without_weight_map_names_index_file(sharded_dir, tmp_path):
    """An index that is valid JSON but has no weight_map is a ValueError naming the index and the field."""
    path = _copy_dir(sharded_dir[0], tmp_path / "ckpt")
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(ValueError, match="weight_map") as err:
        weight_files(path)
    assert index in str(err.value)


def test_index_shard_outside_folder_rejected(sharded_dir, tmp_path):
    """A shard name with a path component (e.g. ../x) is rejected, so an index cannot point outside the folder."""
    path = _copy_dir(sharded_dir[0], tmp_path / "ckpt")
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = "../elsewhere.safetensors"
    with open(index, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match="not a plain file name"):
        weight_files(path)


def test_missing_shard_names_index_and_shard(sharded_dir, tmp_path):
    """A shard listed in the index but absent on disk is a ValueError naming the index and the shard path."""
    path = _copy_dir(sharded_dir[0], tmp_path / "ckpt")
    shard = weight_files(path)[-1]
    os.remove(shard)
    with pytest.raises(ValueError) as err:
        weight_files(path)
    msg = str(err.value)
    assert os.path.join(path, "model.safetensors.index.json") in msg
    assert shard in msg


def test_index_promising_absent_tensor_is_error(sharded_dir, tmp_path):
    """A tensor listed in the index but found in no shard is reported (naming the index) after iteration."""
    path = _copy_dir(sharded_dir[0], tmp_path / "ckpt")
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    data["weight_map"]["model.ghost.weight"] = next(iter(data["weight_map"].values()))
    with open(index, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match="model.ghost.weight") as err:
        list(iter_weights(path))
    assert index in str(err.value)


def test_corrupt_safetensors_names_file(tmp_path):
    """A safetensors file with a garbage header is a ValueError naming the file."""
    _save_tiny(tmp_path)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="not a valid safetensors file") as err:
        list(iter_weights(str(tmp_path)))
    assert str(bad) in str(err.value)


def test_truncated_safetensors_names_file(tmp_path):
    """A safetensors file cut short (interrupted download) is a ValueError naming the file."""
    _save_tiny(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as err:
        list(iter_weights(str(tmp_path)))
    assert str(path) in str(err.value)


def test_glob_safetensors_without_index(single_dir, tmp_path):
    """Without model.safetensors or an index, any *.safetensors files are used (sorted)."""
    path = _copy_dir(single_dir[0], tmp_path / "ckpt")
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "weights.safetensors"))
    assert weight_files(path) == [os.path.join(path, "weights.safetensors")]
    assert set(dict(iter_weights(path))) == set(single_dir[1])


# ----------------------------------------------------------------------------- dtype


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize(
    "name, expected",
    [("float32", torch.float32), ("float", torch.float32), ("bfloat16", torch.bfloat16),
     ("float16", torch.float16), ("half", torch.float16), ("BF16", torch.bfloat16),
     ("torch.float16", torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)],
)
def test_resolve_dtype_explicit(name, expected):
    """Explicit dtype names and torch dtypes map to the matching torch dtype regardless of the config."""
    assert resolve_dtype(name, _Cfg(dtype=torch.bfloat16)) is expected


def test_resolve_dtype_auto_uses_config():
    """'auto' follows config.dtype (torch dtype or string), then legacy torch_dtype, else float32."""
    assert resolve_dtype("auto", _tiny_config(dtype="bfloat16")) is torch.bfloat16
    assert resolve_dtype("auto", _tiny_config(torch_dtype="float16")) is torch.float16
    assert resolve_dtype("auto", _Cfg(torch_dtype="float16")) is torch.float16
    assert resolve_dtype("auto", _tiny_config()) is torch.float32
    assert resolve_dtype("auto", _Cfg()) is torch.float32


def test_resolve_dtype_auto_from_saved_checkpoint(tmp_path):
    """'auto' on a checkpoint saved in bfloat16 resolves to bfloat16 via load_config."""
    model = LlamaForCausalLM(_tiny_config()).to(torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    assert resolve_dtype("auto", load_config(str(tmp_path))) is torch.bfloat16


@pytest.mark.parametrize("bad", ["int8", "fp8", "", torch.float64, torch.int8, 3])
def test_resolve_dtype_rejects_unknown_listing_options(bad):
    """Unsupported dtypes are a ValueError that lists the accepted options."""
    with pytest.raises(ValueError) as err:
        resolve_dtype(bad, _Cfg())
    assert "'auto'" in str(err.value) and "bfloat16" in str(err.value) and "half" in str(err.value)


def test_resolve_dtype_auto_rejects_unsupported_config_dtype():
    """'auto' with a config dtype hybridkv cannot run (float64) asks for an explicit dtype."""
    with pytest.raises(ValueError, match="pass dtype explicitly"):
        resolve_dtype("auto", _Cfg(dtype=torch.float64))


_ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nmodel name\t: other\n"
_ZEN5 = _ZEN3.replace("cpu family\t: 25", "cpu family\t: 26").replace("avx2 fma", "avx2 fma avx512f avx512bw avx512_bf16")


def test_cpuinfo_parsing_tells_zen3_from_zen5():
    """The ISA, native bf16 and family come from the first processor block of /proc/cpuinfo."""
    from hybridkv.cpu_features import parse_cpuinfo

    zen3, zen5 = parse_cpuinfo(_ZEN3), parse_cpuinfo(_ZEN5)
    assert (zen3.isa, zen3.native_bf16, zen3.model_name, zen3.vendor) == ("AVX2", False, "AMD EPYC", "AuthenticAMD")
    assert (zen5.isa, zen5.native_bf16) == ("AVX-512", True)
    assert zen3.describe() == "AMD EPYC (family 25 model 1, AVX2)"
    assert "family 26" in zen5.describe() and "avx512_bf16" in zen5.describe()
    assert zen3.native(torch.float32) and not zen3.native(torch.float16)


@pytest.mark.parametrize("cpu, want", [(_ZEN3, torch.float32), (_ZEN5, torch.bfloat16)])
def test_auto_dtype_keeps_a_bf16_checkpoint_in_float32_without_native_bf16(cpu, want, monkeypatch, caplog):
    """On a CPU without native bf16 compute, dtype='auto' runs a bf16 checkpoint in float32 (bf16
    matmuls are 7-100x slower there) and logs why; where bf16 is native it stays bf16. An
    explicit dtype is honoured either way (with a warning where it is slow), and a non-CPU
    device keeps the checkpoint's dtype."""
    import logging

    from hybridkv.model_executor import checkpoint
    from hybridkv.cpu_features import parse_cpuinfo

    monkeypatch.setattr(checkpoint, "cpu_features", lambda: parse_cpuinfo(cpu))
    cfg = _tiny_config(dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="hybridkv"):
        assert resolve_dtype("auto", cfg, "cpu") is want
    assert "AMD EPYC" in caplog.text
    assert resolve_dtype("bfloat16", cfg, "cpu") is torch.bfloat16
    assert resolve_dtype("auto", cfg, "cuda") is torch.bfloat16
    assert resolve_dtype("auto", _tiny_config(), "cpu") is torch.float32
    if want is torch.float32:
        assert "runs in float32" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hybridkv"):
            resolve_dtype("bfloat16", cfg, "cpu")
        assert "no native bfloat16" in caplog.text


# ----------------------------------------------------------------------------- generation config


def test_generation_config_eos_list_and_sampling_defaults(tmp_path):
    """eos_token_id list and the known sampling keys are read from generation_config.json; others ignored."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [2, 5, 2], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 64, "do_sample": True, "bos_token_id": 1,
    }))
    gen = load_generation_config(str(tmp_path))
    assert isinstance(gen, GenerationDefaults)
    assert gen.eos_token_ids == [2, 5]
    assert gen.defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                            "repetition_penalty": 1.1, "max_new_tokens": 64}


def test_generation_config_missing_falls_back_to_config_eos(tmp_path):
    """Without generation_config.json, eos ids come from config.json (int or list) and defaults are empty."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 7}))
    assert load_generation_config(str(tmp_path)) == GenerationDefaults(eos_token_ids=[7], defaults={})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [7, 9]}))
    assert load_generation_config(str(tmp_path)).eos_token_ids == [7, 9]


def test_generation_config_without_eos_uses_config_eos(tmp_path):
    """A generation_config.json that omits eos_token_id still gets config.json's eos."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 3}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    gen = load_generation_config(str(tmp_path))
    assert gen.eos_token_ids == [3] and gen.defaults == {"temperature": 0.7}


def test_generation_config_from_saved_model(tmp_path):
    """A checkpoint written by save_pretrained yields the eos id transformers recorded."""
    model = _save_tiny(tmp_path, eos_token_id=2)
    assert load_generation_config(str(tmp_path)).eos_token_ids == [model.generation_config.eos_token_id]


def test_generation_config_broken_json_names_file(tmp_path):
    """Broken generation_config.json is a ValueError naming that file."""
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON") as err:
        load_generation_config(str(tmp_path))
    assert str(tmp_path / "generation_config.json") in str(err.value)


def test_generation_config_bad_values_name_file(tmp_path):
    """Wrongly typed sampling values or eos ids are a ValueError naming the file and the key."""
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature") as err:
        load_generation_config(str(tmp_path))
    assert str(path) in str(err.value)
    path.write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ValueError, match="eos_token_id"):
        load_generation_config(str(tmp_path))
