"""Prompts as the engine takes them: text, token ids (list, tuple, 1-D numpy array or tensor) or
a dict, checked and turned into a list of Python ints once, at the door."""
from __future__ import annotations

import operator
import sys
from typing import Any

import torch

PromptType = str | dict[str, Any] | list[int]


def is_token_array(value: Any) -> bool:
    """A torch tensor or a numpy array (numpy is imported only if the caller already did:
    an object cannot be an ndarray otherwise, and numpy is not a hard dependency)."""
    if isinstance(value, torch.Tensor):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray)


def as_token_ids(value: Any) -> list[int]:
    """Token ids as a list of Python ints, from a list, tuple, 1-D numpy array or 1-D tensor.

    Everything downstream (prefix hashing, the index, detokenization) compares ids as Python
    ints, so numpy/torch scalars are converted here, once. Floats and bools are refused rather
    than truncated: they are almost always a mistake (logits, masks) that would decode as garbage.
    """
    if is_token_array(value):
        if value.ndim != 1:
            raise ValueError(
                f"prompt token ids must be 1-D, got an array of shape {tuple(value.shape)} "
                f"(pass one prompt per row as a list of prompts)"
            )
        kind = str(value.dtype)  # e.g. "int64", "torch.int32"; bool, float, complex, object are refused
        if "int" not in kind:
            raise ValueError(f"prompt token ids must be integers, got an array of dtype {kind}")
        return [int(t) for t in value.tolist()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"prompt token ids must be a list, tuple, 1-D numpy array or tensor, got {type(value).__name__}"
        )
    ids = []
    for t in value:
        # bool is an int subclass (True == 1): refuse it explicitly; numpy/torch integer scalars
        # implement __index__, floats do not, so operator.index is the exact integer test.
        if isinstance(t, bool) or _is_bool_scalar(t):
            raise ValueError(f"prompt token ids must be integers, got {t!r} (a bool)")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt token ids must be integers, got {t!r} ({type(t).__name__})") from None
    return ids


def _is_bool_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.bool_)


def tokenize_prompt(tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(text or None, token ids as a list of Python ints). Token ids may be a list, a tuple,
    a 1-D numpy array or a 1-D torch tensor of integers, bare or as a dict's prompt_token_ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty; pass a non-empty string or token ids")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), as_token_ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return tokenize_prompt(tokenizer, prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) or is_token_array(prompt):
        return None, as_token_ids(prompt)
    raise ValueError(
        f"prompt must be a string, token ids (list, tuple, 1-D numpy array or tensor) or a dict, "
        f"got {type(prompt).__name__}"
    )


def validate_prompt(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt the engine can run: non-empty, ids in the vocabulary, room for one token."""
    if not ids:
        raise ValueError("prompt is empty; pass at least one token")
    vocab = vocab_size
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {bad[:5]}")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt is {len(ids)} tokens, but max_model_len is {max_model_len} (the prompt plus at "
            f"least one generated token must fit); shorten the prompt or raise max_model_len"
        )
