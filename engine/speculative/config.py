"""SpeculativeConfig: vLLM's `speculative_config`, validated before the model loads.

Only the n-gram (prompt-lookup) drafter exists: it needs no second model, and on copy-heavy
outputs (quoting, code edits, summaries that reuse phrases) its drafts are often right. Whatever
this engine cannot yet verify exactly is refused here or in check_speculation, not ignored: a
silently dropped flag would hide that outputs are decoded without it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)


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
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or its JSON, got {type(value).__name__}")
        value = dict(value)
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported; supported: {list(METHODS)} "
                             "(n-gram prompt lookup; draft models and MTP are not implemented)")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
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


def speculation_config(config, space_specs, hisparse) -> "SpeculativeConfig | None":
    """EngineConfig.speculative_config parsed and checked against the model's spaces (None: off)."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is not None:
        check_speculation(spec, config, space_specs, hisparse)
    return spec


def check_speculation(spec: SpeculativeConfig, config, space_specs, hisparse) -> None:
    """Refuse, before the weights load, what verification does not handle yet.

    A rejected draft's K/V in a raw-token space (whole history or a sliding window) is given back
    or overwritten later, and a window only releases pages behind the accepted tokens, so those
    spaces roll back by truncation. A compressed space (C4/C128, their states, ring pages) pools
    rejected tokens into its entries and has no rollback yet. The host and storage tiers copy only
    published pages (whole pages of accepted tokens), so they need nothing more; every
    tensor-parallel rank splits the verified rows the same way (tp_worker.RunStep.verify)."""
    odd = sorted({s.name for s in space_specs if s.tokens_per_slot != 1 or s.ring or s.align != 1})
    if odd:
        raise ValueError(f"speculative_config needs a model whose KV spaces hold raw tokens (full attention or a "
                         f"sliding window: Llama, Qwen, Mistral, Gemma-3); this one has compressed spaces {odd}")
    if config.enable_hisparse or hisparse is not None:
        raise ValueError("speculative_config is not supported with HiSparse yet")
