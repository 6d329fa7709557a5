"""The engine's JSON-valued settings (`--speculative-config`, `--kv-events-config`): given as a
dict in Python or as its JSON text on the command line, and read as a dict either way."""
from __future__ import annotations

import json
from typing import Any


def json_object(value: "str | dict[str, Any]", name: str) -> dict[str, Any]:
    """value as a new dict: a dict, or JSON text of an object. A ValueError names the setting."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or the JSON text of an object, got {type(value).__name__}")
    return dict(value)
