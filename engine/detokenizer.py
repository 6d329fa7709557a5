"""Incremental detokenization and stop-string matching for one generated sequence.

Decoding the whole output again after every token costs O(n) per step, O(n^2) per request.
Instead, like vLLM's `detokenize_incrementally`, we keep the token strings and decode only a
small window: `prefix_text` = decode(tokens[prefix:read]) was already emitted, and the new text
is decode(tokens[prefix:]) minus `prefix_text`. Decoding the window together with a few tokens
of left context (rather than the new token alone) matters because decoders are not
concatenative: sentencepiece strips the leading space of the first token of whatever it decodes,
and a multi-byte character may be split over several tokens.

Text is only committed when it is stable, i.e. later tokens cannot change it:
  * a window whose text ends with U+FFFD may be an incomplete UTF-8 character: wait;
  * decoders with byte fallback (Llama/Mistral style `<0xNN>` tokens) decode a whole run of
    byte tokens at once and turn *every* byte of an invalid run into U+FFFD, so a valid "é" can
    later become "���": a window ending in a byte token is held until the run ends.
The not-yet-stable tail is still part of `output_text` (so the final text equals
`tokenizer.decode`), but `get_next_output_text` only hands it out once the sequence finished.
"""
from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.engine.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Visible prompt tokens decoded as left context of the first output token (vLLM uses 5 too):
# enough to hold a whole character split into byte tokens, so the context decodes cleanly.
_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 32
# The token list only needs tokens from `prefix` on; drop the rest once this many pile up so a
# long generation does not keep every token string alive.
_TRIM_TOKENS = 1024
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class _TokenizerTraits:
    """What a tokenizer's `decode` does, reduced to the pieces the window decoding needs."""

    id_to_token: Callable[[int], str | None]
    tokens_to_text: Callable[[list[str]], str]
    skip_ids: frozenset[int]  # skipped by id (python tokenizers)
    skip_strs: frozenset[str]  # skipped by token string (the Rust backend checks strings)
    byte_runs_all_or_nothing: bool  # ByteFallback-style decoding of `<0xNN>` runs


# tokenizer -> (len(tokenizer) when computed, traits)
_traits_cache: "weakref.WeakKeyDictionary[Any, tuple[int, _TokenizerTraits]]" = weakref.WeakKeyDictionary()


def _tokenizer_traits(tokenizer: Any) -> _TokenizerTraits:
    # Collecting the special tokens walks the added vocabulary: do it once per tokenizer, not
    # per request. len() (cheap, counts added tokens) notices tokens added since then.
    size = len(tokenizer)
    try:
        cached_size, traits = _traits_cache[tokenizer]
        if cached_size == size:
            return traits
    except (KeyError, TypeError):
        pass
    traits = _compute_traits(tokenizer)
    try:
        _traits_cache[tokenizer] = (size, traits)
    except TypeError:  # not weak-referenceable: recompute next time
        pass
    return traits


def _compute_traits(tokenizer: Any) -> _TokenizerTraits:
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        # A fast tokenizer's decode() is the Rust `Tokenizer.decode`: id_to_token (added vocab
        # first), drop tokens whose *string* is a special added token, then run the decoder
        # (or join with spaces when there is none). Mirror exactly that, not transformers'
        # python-level all_special_ids, which can disagree with the Rust flags.
        decoder = backend.decoder
        tokens_to_text = decoder.decode if decoder is not None else " ".join
        specials = frozenset(t.content for t in backend.get_added_tokens_decoder().values() if t.special)
        id_to_token = backend.id_to_token
        skip_ids: frozenset[int] = frozenset()
    else:
        # Python tokenizers: decode() = convert_tokens_to_string(convert_ids_to_tokens(ids, skip)).
        tokens_to_text = tokenizer.convert_tokens_to_string
        specials = frozenset()
        id_to_token = tokenizer.convert_ids_to_tokens
        skip_ids = frozenset(tokenizer.all_special_ids)
    return _TokenizerTraits(id_to_token, tokens_to_text, skip_ids, specials, _probe_byte_runs(tokens_to_text))


def _probe_byte_runs(tokens_to_text: Callable[[list[str]], str]) -> bool:
    """True if the decoder turns a run of `<0xNN>` tokens into text all-or-nothing.

    Asking the decoder itself works for any tokenizer class, fast or slow: "é" followed by a
    stray continuation byte decodes to "é�" with local (lossy) UTF-8 decoding, but to "���"
    with ByteFallback, which invalidates the whole run.
    """
    try:
        valid = tokens_to_text(["<0xC3>", "<0xA9>"])
        spoiled = tokens_to_text(["<0xC3>", "<0xA9>", "<0xA9>"])
    except Exception:  # an exotic decoder that rejects these strings cannot have byte runs
        return False
    return "\u00e9" in valid and "\u00e9" not in spoiled


class _TextBuffer:
    """Append-only text with cheap tail access.

    `self.text += piece` on an attribute copies the whole string every step (CPython's in-place
    concat trick only applies to locals), which is O(n^2) over a long generation. Chunks make an
    append O(len(piece)); the full string is joined only when someone asks for it.
    """

    __slots__ = ("_chunks", "_len")

    def __init__(self) -> None:
        self._chunks: list[str] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, piece: str) -> None:
        if piece:
            self._chunks.append(piece)
            self._len += len(piece)

    def text(self) -> str:
        if len(self._chunks) > 1:  # collapse so the next call is free
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def slice(self, start: int, stop: int | None = None) -> str:
        """text[start:stop], touching only the chunks that overlap it (cheap near the end)."""
        stop = self._len if stop is None else min(stop, self._len)
        start = max(start, 0)
        if start >= stop:
            return ""
        parts: list[str] = []
        end = self._len  # absolute end of chunk i
        for i in range(len(self._chunks) - 1, -1, -1):
            chunk = self._chunks[i]
            begin = end - len(chunk)
            if begin < stop:
                parts.append(chunk[max(start - begin, 0) : stop - begin])
            if begin <= start:
                break
            end = begin
        parts.reverse()
        return "".join(parts)

    def truncate(self, length: int) -> None:
        while self._len > length:
            last = self._chunks.pop()
            self._len -= len(last)
            if self._len < length:
                self.append(last[: length - self._len])


class IncrementalDetokenizer:
    """Turns the generated token ids of one sequence into text, step by step.

    `output_text` always equals what `tokenizer.decode(output_ids, skip_special_tokens=...)`
    gives, continued from the prompt (for sentencepiece-style tokenizers that means the first
    output token keeps its leading space, as vLLM does), truncated at a matched stop string.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._traits = _tokenizer_traits(tokenizer)
        self._skip_special = params.skip_special_tokens
        # spaces_between_special_tokens: transformers 5's decode() ignores it for fast and python
        # tokenizers alike (special tokens are joined by the decoder like any token), so matching
        # decode() means ignoring it here too.
        self._stops: list[str] = list(params.stop or [])
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        # While unfinished, a client must not see text that may turn out to start a stop string
        # which is then cut off; with include_stop_str_in_output nothing is ever cut before it.
        self._holdback = 0 if self._include_stop or not self._stops else self._max_stop_len - 1

        self._tokens: list[str] = self._prompt_context(prompt_token_ids)
        self._prefix = 0  # tokens[prefix:read] decode to `prefix_text`, already committed
        self._read = len(self._tokens)
        self._prefix_text = self._decode(0, self._read) if self._tokens else ""
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            self._drop_context()  # the prompt ends inside a character
        # A prompt ending in a byte token leaves its byte run open: if the output goes on with
        # byte tokens, the run (decoded all-or-nothing) straddles prompt and output.
        self._open_context_run = bool(self._tokens) and self._is_byte_run_token(self._tokens[-1])

        self._committed = _TextBuffer()  # stable text (truncated at a stop string)
        self._pending = ""  # decoded but possibly unstable tail (a partial character)
        self._emitted = 0  # characters handed out by delta calls
        self._stopped = False

    # -- decoding -------------------------------------------------------------------------------
    def _is_visible(self, token_id: int, token: str | None) -> bool:
        if token is None:  # unknown id: the Rust decode drops it silently
            return False
        if not self._skip_special:
            return True
        return token_id not in self._traits.skip_ids and token not in self._traits.skip_strs

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[str]:
        # Walk back from the end: converting the whole prompt would cost O(prompt) per request.
        traits = self._traits
        context: list[str] = []
        for i in range(len(prompt_token_ids) - 1, -1, -1):
            if len(context) >= _CONTEXT_TOKENS and not (
                # Starting inside a byte run would decode the whole run as U+FFFD: go back to
                # its first byte (bounded, a run is one character or a few).
                len(context) < _MAX_CONTEXT_TOKENS and self._is_byte_run_token(context[-1])
            ):
                break
            tid = int(prompt_token_ids[i])
            token = traits.id_to_token(tid)
            if self._is_visible(tid, token):
                context.append(token)
        context.reverse()
        return context

    def _drop_context(self) -> None:
        """Decode the output on its own, i.e. exactly tokenizer.decode(output_ids).

        Used when the prompt does not end on a clean boundary (inside a character, or inside a
        byte run the output continues): the output's first bytes then belong to a character
        that straddles prompt and output, and no continuation of the prompt text is right.
        """
        self._tokens, self._prefix, self._read, self._prefix_text = [], 0, 0, ""

    def _is_byte_run_token(self, token: str) -> bool:
        return self._traits.byte_runs_all_or_nothing and _BYTE_TOKEN.fullmatch(token) is not None

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._traits.tokens_to_text(self._tokens[start:stop])

    def _step(self) -> None:
        """Decode the window after one more token was appended; commit its text if stable."""
        text = self._decode(self._prefix)
        new_text = text[len(self._prefix_text) :]
        stable = (
            len(text) > len(self._prefix_text)
            and not text.endswith(_REPLACEMENT_CHAR)
            and not self._is_byte_run_token(self._tokens[-1])
        )
        if not stable:
            self._pending = new_text
            return
        self._committed.append(new_text)
        self._pending = ""
        self._prefix, self._read = self._read, len(self._tokens)
        self._prefix_text = self._decode(self._prefix, self._read)
        if self._prefix >= _TRIM_TOKENS:
            del self._tokens[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0

    # -- public API -----------------------------------------------------------------------------
    def update(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append newly generated token ids; decode them incrementally; if check_stop and a stop
        string now appears in the output text, truncate the text (keep the stop string only if
        include_stop_str_in_output) and return the stop string that matched; else return None."""
        if self._stopped:
            raise RuntimeError("update() after a stop string matched: the sequence is finished")
        traits = self._traits
        check = check_stop and bool(self._stops)
        # Token by token (not one decode of the whole batch), and stop strings checked after
        # each token: the result then does not depend on how tokens were grouped into calls.
        for tid in new_token_ids:
            tid = int(tid)
            token = traits.id_to_token(tid)
            if not self._is_visible(tid, token):
                continue
            if self._open_context_run:
                self._open_context_run = False
                if self._is_byte_run_token(token):
                    self._drop_context()
            new_start = len(self._committed)
            self._tokens.append(token)
            self._step()
            if check:
                stop = self._match_stop(new_start)
                if stop is not None:
                    return stop  # later tokens of this call lie after the stop string
        return None

    def _match_stop(self, new_start: int) -> str | None:
        """Find a stop string ending after `new_start` in the text; cut the text there.

        The pending tail takes part too (minus a trailing partial character): a held byte run
        may already spell out a stop string. Matching there is safe, because stopping now fixes
        the run as it is, and it is searched again next time since it was not committed.

        Only text within max_stop_len-1 characters before `new_start` can begin such a match, so
        the search costs O(new text), not O(output). Among matches the one that *ends* first
        wins (ties: the longer one): that is the stop string a character-by-character stream
        would hit first, so the result does not depend on how many tokens one call carried.
        """
        tail = self._pending.rstrip(_REPLACEMENT_CHAR)
        if len(self._committed) + len(tail) <= new_start:
            return None
        region_start = max(0, new_start - (self._max_stop_len - 1))
        region = self._committed.slice(region_start) + tail
        offset = new_start - region_start  # where the unchecked text begins inside `region`
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stops:
            i = region.find(stop, max(0, offset - len(stop) + 1))  # must end after `offset`
            if i >= 0 and (best is None or (i + len(stop), i) < best[:2]):
                best = (i + len(stop), i, stop)
        if best is None:
            return None
        end, start, stop = best
        cut = region_start + (end if self._include_stop else start)
        committed = len(self._committed)
        if cut <= committed:
            self._committed.truncate(cut)
        else:
            self._committed.append(tail[: cut - committed])
        self._pending = ""
        self._stopped = True
        return stop

    @property
    def output_text(self) -> str:
        """Full text so far (truncated at the stop string when one matched)."""
        return self._committed.text() + self._pending

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to emit now. While not finished, hold back the last (max_stop_len - 1) characters
        (0 when include_stop_str_in_output or no stop strings) so a client never sees part of a
        stop string that is later removed; a not-yet-stable tail (partial character) is held back
        too. delta=True returns only text not returned before by a delta call; delta=False returns
        the whole text (minus the held-back tail while unfinished)."""
        committed = len(self._committed)
        if finished:
            # Nothing can change any more: the pending tail is final, even if it ends in U+FFFD
            # (tokenizer.decode shows an incomplete character the same way).
            end = committed + len(self._pending)
        else:
            end = max(committed - self._holdback, 0)
        start = self._emitted if delta else 0
        if delta:
            self._emitted = max(start, end)
        if start >= end:
            return ""
        if start == 0:  # cumulative: join once, so the next call only joins the new chunks
            text = self._committed.text()[:end]
        else:
            text = self._committed.slice(start, end)
        if end > committed:
            text += self._pending[max(start - committed, 0) : end - committed]
        return text
