"""StructuredOutputsParams: what a request's output must match (vLLM's field names).

A plain description of the constraint, with no grammar library behind it: it travels inside
SamplingParams (so it sits beside them on the executor's side, which never imports engine), and
the engine's structured_output package turns it into a grammar. Exactly one form is given:

- ``json``: a JSON schema (a dict, or its JSON text);
- ``regex``: a regular expression the whole output matches;
- ``choice``: a list of strings, the output is one of them;
- ``grammar``: a context-free grammar, in Lark or GBNF (llama.cpp's EBNF) syntax;
- ``json_object=True``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).

``start_after`` (optional, with any form): the grammar applies only to what follows the first
occurrence of this text in the output, e.g. ``"</think>"`` for a reasoning model, whose
reasoning stays free and whose answer is constrained (what the server does under
``--reasoning-parser``). Until the text is written nothing is constrained.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

_FORMS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    start_after: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _FORMS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams: give exactly one of json, regex, choice, grammar or json_object=True, "
                f"got {given or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"StructuredOutputsParams: json is not valid JSON text: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"StructuredOutputsParams: json must be a JSON schema object, got {type(parsed).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"StructuredOutputsParams: regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"StructuredOutputsParams: grammar must be a non-empty string, got {self.grammar!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise ValueError(f"StructuredOutputsParams: choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            self.choice = list(self.choice)
        if self.start_after is not None and (not isinstance(self.start_after, str) or not self.start_after):
            raise ValueError(f"StructuredOutputsParams: start_after must be a non-empty string, got {self.start_after!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"StructuredOutputsParams: json_object must be a boolean, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """Which form is given: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in _FORMS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints get equal keys, so a compiled grammar is
        shared by every request that asks for the same one (the compile cache's key)."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, _json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)
