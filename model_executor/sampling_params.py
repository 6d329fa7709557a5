"""Per-request sampling settings, validated on construction (vLLM's field names).

Defined on the executor's side: the sampler consumes them, and model_executor never imports
engine (hybridkv.engine.sampling_params re-exports this module)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from hybridkv.model_executor.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries all text/tokens so far (offline LLM)
    DELTA = 1  # every output carries only what is new since the last one (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match this grammar (engine/structured_output/); None = unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from generation_config.json; not part of the user contract.
    all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # A bare int (or other non-list) would make list() raise TypeError; report ValueError.
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"SamplingParams: stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple, set)):
            raise ValueError(
                f"SamplingParams: stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}"
            )
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"SamplingParams: {msg}")

        # Float fields must be real, finite numbers: a string would raise TypeError in the range
        # checks below, and inf/NaN poison sampling (-inf/inf = NaN for temperature, 0*inf for
        # repetition_penalty) even though inf passes a one-sided range check.
        float_ranges = {
            "presence_penalty": "in [-2, 2]",
            "frequency_penalty": "in [-2, 2]",
            "repetition_penalty": "> 0",
            "temperature": ">= 0 (0 = greedy)",
            "top_p": "in (0, 1]",
            "min_p": "in [0, 1]",
        }
        for name, allowed in float_ranges.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number {allowed}, got {v!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not self.temperature >= 0.0:
            raise bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise bad(f"{name} must be None or an integer >= 0, got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad(f"structured_outputs must be a StructuredOutputsParams or None, got "
                      f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes) -> "SamplingParams":
        import dataclasses

        return dataclasses.replace(self, **changes)
