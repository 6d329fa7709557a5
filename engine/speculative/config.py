"""SpeculativeConfig: vLLM's `speculative_config`, validated before the model loads.

Two drafters: n-gram prompt lookup ("ngram": no second model; on copy-heavy outputs -- quoting,
code edits, summaries that reuse phrases -- its drafts are often right) and the checkpoint's own
multi-token prediction layer ("mtp": DeepSeek-V4; engine/speculative/mtp_proposer.py). Whatever
this engine cannot yet verify exactly is refused here or in check_speculation, not ignored: a
silently dropped flag would hide that outputs are decoded without it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from hybridkv.block_manager.space_spec import SpaceSpec
from hybridkv.engine.json_config import json_object

METHODS = ("ngram", "mtp")
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """None (off), a dict or its JSON (the CLI's --speculative-config): checked in full."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported; supported: {list(METHODS)} "
                             "(n-gram prompt lookup, the model's MTP layer; draft models are not implemented)")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        if method == "mtp" and any(key in value for key in _NGRAM_KEYS):
            raise ValueError(f"speculative_config {list(_NGRAM_KEYS)} apply to method 'ngram', not 'mtp'")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo, hi = 1, 3
        elif lo is None:
            lo = 1
        elif hi is None:
            hi = lo
        for name, v in (("num_speculative_tokens", value.get("num_speculative_tokens")),
                        ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config[{name!r}] must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
        return cls(method, value["num_speculative_tokens"], lo, hi)


def mtp_wanted(config) -> bool:
    """Whether EngineConfig.speculative_config drafts with the model's MTP layer: the model is then
    built with it (model_runner.model_skeleton, which refuses a model or checkpoint without one)."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    return spec is not None and spec.method == "mtp"


def speculation_config(config, space_specs: list[SpaceSpec]) -> tuple["SpeculativeConfig | None", list[SpaceSpec]]:
    """EngineConfig.speculative_config parsed and checked against the model's spaces (None: off),
    and the spaces as the engine must size them for it (draft_space_specs)."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None:
        return None, space_specs
    check_speculation(spec, config, space_specs)
    return spec, draft_space_specs(spec, space_specs)


def draft_space_specs(spec: SpeculativeConfig, space_specs: list[SpaceSpec]) -> list[SpaceSpec]:
    """A ring space (a compressor's state rows, DeepSeek-V4) widened by k slots. A verify step
    writes the rows of its k drafts before it knows which it keeps; in a ring of one window's N
    rows a rejected draft's row would overwrite the row N positions back, which the next windows
    still read. With N + k slots every row a later window reads survives any rejection (SGLang
    sizes these rings likewise: C4 8 -> 16 rows, C128 128 -> 256)."""
    k = spec.num_speculative_tokens
    return [replace(s, ring=s.ring + k) if s.ring is not None else s for s in space_specs]


def check_speculation(spec: SpeculativeConfig, config, space_specs: list[SpaceSpec]) -> None:
    """Refuse, before the weights load, what verification does not handle yet.

    Every space rolls back: a rejected draft's K/V in a raw-token space (whole history or a
    sliding window) is given back with its pages or overwritten later, and a window only releases
    pages behind the accepted tokens. A compressed space's entry that a rejected draft closed
    (C4/C128, the indexer's keys) is read by no query before an accepted token closes the same
    window again and overwrites it; the compressors' state rows survive in rings widened for the
    draft (draft_space_specs). The host and storage tiers copy only published pages (whole pages
    of accepted tokens); every tensor-parallel rank runs the verified rows alike
    (tp_worker.RunStep.verify). HiSparse's hot buffers take in only decode rows' entries, and a
    verified chunk is no decode: an entry a rejected draft closed reaches the host mirror alone,
    where the accepted token's closing overwrites it before any query can select it."""
    k = spec.num_speculative_tokens
    # A verify chunk writes all its rows to the ring only if it fits one window (its last rows are kept)
    short = sorted(f"{s.name} ({s.window} rows)" for s in space_specs if s.ring is not None and k + 1 > s.window)
    if short:
        raise ValueError(f"speculative_config num_speculative_tokens={k}: a verify step's {k + 1} rows must fit "
                         f"the compressor state window of {', '.join(short)}; use at most "
                         f"{min(s.window for s in space_specs if s.ring is not None) - 1}")
