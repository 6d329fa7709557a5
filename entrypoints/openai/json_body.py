"""Parsing an untrusted JSON request body into plain Python values, or a 400 that says why.

Beyond syntax, three things json.loads lets through (or fails on with something other than
ValueError) that nothing downstream should have to think about:

* strings that are not Unicode text: `"\\ud800"` escapes (and their raw UTF-8 spellings, which
  json.loads decodes with surrogatepass) give lone surrogates that no UTF-8 encoder accepts, so
  they would fail later in the tokenizer, a template or the response writer (500s);
* numbers out of range: `1e400` parses as inf (JSON has no infinity);
* nesting deep enough to exhaust the recursion limit (RecursionError, not ValueError).

Integers of more than 4300 digits already fail inside json.loads with ValueError (Python's
int-parsing limit), which becomes the same 400 as any syntax error.
"""
from __future__ import annotations

import json
import math
from typing import Any

from hybridkv.entrypoints.openai.errors import OpenAIError, bad_request, encodable


_SCALARS = frozenset({int, float, bool, type(None)})
_CONTAINERS = frozenset({str, list, dict})  # what the walk has to look at


def _reject_constant(name: str) -> Any:  # NaN / Infinity / -Infinity are not JSON
    raise ValueError(f"invalid JSON constant {name}")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


def _path(parts: tuple) -> str:
    """('messages', 0, 'content') -> "messages[0].content" (the `param` style of protocol.py)."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _not_text(parts: tuple, what: str) -> OpenAIError:
    where = _path(parts)
    field = f"'{where}'" if where else "the request body"
    return bad_request(f"Invalid value for {field}: {what} is not valid Unicode text (it contains a lone "
                       "surrogate code point, e.g. an unpaired \\ud800 escape).", where or None)


def check_text(value: Any) -> None:
    """Raise a 400 naming a string (value or object key) that UTF-8 cannot encode, if any.

    Iterative, so it works at any depth json.loads accepted."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        v, parts = stack.pop()
        t = type(v)
        if t is str:
            if v.isascii():  # O(1) in CPython, and the common case
                continue
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise _not_text(parts, "the string") from None
        elif t is list:
            if _SCALARS.issuperset(map(type, v)):  # a C-level scan: arrays of token ids cost ~10 ms per million
                continue
            stack.extend((item, parts + (i,)) for i, item in enumerate(v) if type(item) in _CONTAINERS)
        elif t is dict:
            for k, item in v.items():
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    shown = encodable(k[:40]) + ("..." if len(k) > 40 else "")
                    raise _not_text(parts, f"the key '{shown}'") from None
                if type(item) in _CONTAINERS:
                    stack.append((item, parts + (k,)))


def parse_json_body(raw: bytes) -> Any:
    """The decoded body; 400 for anything that is not a JSON document of Unicode text."""
    try:
        value = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"We could not parse the JSON body of your request: {e}") from e
    except RecursionError as e:
        raise bad_request("We could not parse the JSON body of your request: it is nested too deeply.") from e
    check_text(value)
    return value
