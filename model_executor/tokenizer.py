"""Loading a checkpoint's tokenizer and rendering chat prompts.

Two kinds of folders are supported:

* ``tokenizer.json`` (a ``tokenizers`` serialization; also vocab.json +
  merges.txt) — loaded with ``AutoTokenizer.from_pretrained``.
* only a SentencePiece ``tokenizer.model`` (older Llama-style checkpoints).
  transformers 5 converts these through ``SentencePieceExtractor``, which
  needs the ``protobuf`` package; without it transformers falls back to a
  tiktoken reader and fails with a misleading "tiktoken is required" error.
  We therefore read the SentencePiece model proto ourselves (a few fields of
  the protobuf wire format, no protobuf dependency), build the fast tokenizer
  with transformers' ``SpmConverter.build_tokenizer_from_spm_proto`` (the
  same builder transformers uses for generic SentencePiece folders, which
  follows the model's own normalizer/dummy-prefix/byte-fallback settings so
  ids match ``SentencePieceProcessor.encode``), and load the folder's
  ``tokenizer_config.json`` around it. This path is taken whether or not
  protobuf is installed, so the result does not depend on the environment.

The engine only uses fast (Rust) tokenizers: they are what
``AutoTokenizer`` returns in transformers 5 anyway.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from typing import Any

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"

# Used when neither the caller nor the tokenizer provides a chat template.
# ChatML (<|im_start|>role\ncontent<|im_end|>\n) is the most common format for
# instruction-tuned checkpoints and is harmless for base models, which simply
# see it as text. It is a documented fallback, not a guess at the model's format.
CHATML_FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tokenizer classes whose slow (SentencePiece) implementation added BOS by
# default; used only when tokenizer_config.json does not say add_bos_token.
_BOS_BY_DEFAULT_CLASSES = frozenset({"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer",
                                     "CodeLlamaTokenizerFast"})


# --------------------------------------------------------------------------- SentencePiece model proto


@dataclass
class _SpmPiece:
    piece: str
    score: float = 0.0
    type: int = 1  # 1 NORMAL, 2 UNKNOWN, 3 CONTROL, 4 USER_DEFINED, 5 UNUSED, 6 BYTE


@dataclass
class _SpmTrainerSpec:
    model_type: int = 1  # 1 UNIGRAM, 2 BPE, 3 WORD, 4 CHAR
    byte_fallback: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    unk_piece: str = "<unk>"
    bos_piece: str = "<s>"
    eos_piece: str = "</s>"
    pad_piece: str = "<pad>"


@dataclass
class _SpmNormalizerSpec:
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


@dataclass
class SentencePieceModelSpec:
    """The parts of SentencePiece's ``ModelProto`` a fast tokenizer needs.

    Attribute names mirror the protobuf message so the object can stand in for
    it in transformers' ``SpmConverter.build_tokenizer_from_spm_proto``.
    Defaults are the proto2 defaults from ``sentencepiece_model.proto``.
    """

    pieces: list[_SpmPiece] = field(default_factory=list)
    trainer_spec: _SpmTrainerSpec = field(default_factory=_SpmTrainerSpec)
    normalizer_spec: _SpmNormalizerSpec = field(default_factory=_SpmNormalizerSpec)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, pos


def _proto_fields(data: bytes):
    """Yield (field_number, value) of one protobuf message (wire types 0, 1, 2, 5)."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated field")
        yield number, value


def _int32(value: int) -> int:
    # proto int32 negatives (e.g. pad_id=-1) are sign-extended 64-bit varints.
    return value - (1 << 64) if value >= (1 << 63) else value


def parse_sentencepiece_model(data: bytes) -> SentencePieceModelSpec:
    """Decode a serialized SentencePiece ``ModelProto`` without the protobuf package.

    Field numbers are those of sentencepiece_model.proto: ModelProto
    {1: pieces, 2: trainer_spec, 3: normalizer_spec}; SentencePiece {1: piece,
    2: score (float), 3: type}; TrainerSpec {3: model_type, 35: byte_fallback,
    40-43: unk/bos/eos/pad id, 45-48: their pieces}; NormalizerSpec
    {2: precompiled_charsmap, 3: add_dummy_prefix, 4: remove_extra_whitespaces,
    5: escape_whitespaces}. Unknown fields are skipped.
    """
    spec = SentencePieceModelSpec()
    trainer, norm = spec.trainer_spec, spec.normalizer_spec
    for number, value in _proto_fields(data):
        if number == 1:
            piece = _SpmPiece(piece="")
            for n, v in _proto_fields(value):
                if n == 1:
                    piece.piece = bytes(v).decode("utf-8")
                elif n == 2:
                    piece.score = struct.unpack("<f", v)[0]
                elif n == 3:
                    piece.type = v
            spec.pieces.append(piece)
        elif number == 2:
            for n, v in _proto_fields(value):
                if n == 3:
                    trainer.model_type = v
                elif n == 35:
                    trainer.byte_fallback = bool(v)
                elif n in (40, 41, 42, 43):
                    setattr(trainer, {40: "unk_id", 41: "bos_id", 42: "eos_id", 43: "pad_id"}[n], _int32(v))
                elif n in (45, 46, 47, 48):
                    name = {45: "unk_piece", 46: "bos_piece", 47: "eos_piece", 48: "pad_piece"}[n]
                    setattr(trainer, name, bytes(v).decode("utf-8"))
        elif number == 3:
            for n, v in _proto_fields(value):
                if n == 2:
                    norm.precompiled_charsmap = bytes(v)
                elif n == 3:
                    norm.add_dummy_prefix = bool(v)
                elif n == 4:
                    norm.remove_extra_whitespaces = bool(v)
                elif n == 5:
                    norm.escape_whitespaces = bool(v)
    if not spec.pieces:
        raise ValueError("the model has no pieces")
    return spec


def _sentencepiece_backend(model_path: str, legacy: bool):
    """Build a ``tokenizers.Tokenizer`` equivalent to the SentencePiece model at ``model_path``."""
    from transformers.convert_slow_tokenizer import SpmConverter

    try:
        with open(model_path, "rb") as f:
            spec = parse_sentencepiece_model(f.read())
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise ValueError(f"{model_path} is not a valid SentencePiece model ({e}); re-download it") from e
    model_type = spec.trainer_spec.model_type
    if model_type == 2:  # BPE: the fast BPE model wants piece -> id
        vocab: Any = {p.piece: i for i, p in enumerate(spec.pieces)}
    elif model_type == 1:  # Unigram: (piece, log-prob) in id order
        vocab = [(p.piece, p.score) for p in spec.pieces]
    else:
        kind = {3: "WORD", 4: "CHAR"}.get(model_type, str(model_type))
        raise ValueError(
            f"{model_path} is a SentencePiece {kind} model; only BPE and Unigram models can be converted. "
            "Provide a tokenizer.json instead"
        )
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto=spec, vocab=vocab, legacy=legacy)
    if backend is None:
        raise ValueError(f"{model_path}: transformers could not build a tokenizer from this SentencePiece model")
    return backend, spec


def _load_sentencepiece_folder(model_dir: str):
    from transformers import PreTrainedTokenizerFast

    config_path = os.path.join(model_dir, TOKENIZER_CONFIG)
    config: dict[str, Any] = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{config_path} is not valid JSON ({e}); fix or re-download it") from e
        if not isinstance(config, dict):
            raise ValueError(f"{config_path} must contain a JSON object")
    # transformers' own default for SentencePiece conversion; legacy=True is
    # what makes the dummy prefix behave exactly like SentencePieceProcessor.
    legacy = bool(config.get("legacy", True))
    backend, spec = _sentencepiece_backend(os.path.join(model_dir, SENTENCEPIECE_MODEL), legacy=legacy)

    kwargs: dict[str, Any] = {}
    trainer = spec.trainer_spec
    for key, token_id, piece in (("bos_token", trainer.bos_id, trainer.bos_piece),
                                 ("eos_token", trainer.eos_id, trainer.eos_piece),
                                 ("unk_token", trainer.unk_id, trainer.unk_piece),
                                 ("pad_token", trainer.pad_id, trainer.pad_piece)):
        if key not in config and token_id >= 0:
            kwargs[key] = piece
    if "add_bos_token" not in config:
        kwargs["add_bos_token"] = config.get("tokenizer_class") in _BOS_BY_DEFAULT_CLASSES
    # Control pieces (<s>, </s>, ...) must never be produced from plain text:
    # register them as special added tokens, as transformers' extractor does.
    special = [p.piece for p in spec.pieces if p.type == 3]

    # Pass the built tokenizer as an explicit `tokenizer_file`: for the generic
    # fast class transformers then loads it as-is and applies everything else
    # of tokenizer_config.json (special tokens, chat template, add_bos_token).
    with tempfile.TemporaryDirectory(prefix="hybridkv-spm-") as tmp:
        tokenizer_file = os.path.join(tmp, TOKENIZER_JSON)
        backend.save(tokenizer_file)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            model_dir, tokenizer_file=tokenizer_file, local_files_only=True, **kwargs
        )
    missing_special = [t for t in special if t not in tokenizer.all_special_tokens]
    if missing_special:
        tokenizer.add_special_tokens({"extra_special_tokens": missing_special},
                                     replace_extra_special_tokens=False)
    return tokenizer


# --------------------------------------------------------------------------- public API


def load_tokenizer(model_dir: str):
    """Load the fast tokenizer of a checkpoint folder (see module docstring for the formats)."""
    if not os.path.isdir(model_dir):
        raise ValueError(
            f"Model folder '{model_dir}' does not exist; pass a path to a HuggingFace checkpoint folder "
            "(config.json + *.safetensors) or omit the model to use the built-in demo model"
        )

    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(model_dir, name))

    if has(TOKENIZER_JSON) or (has("vocab.json") and has("merges.txt")):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False, local_files_only=True)
        except (ValueError, OSError, KeyError, TypeError) as e:
            raise ValueError(f"the tokenizer in {model_dir} could not be loaded: {e}") from e
    if has(SENTENCEPIECE_MODEL):
        return _load_sentencepiece_folder(model_dir)
    raise ValueError(
        f"{model_dir} has no tokenizer: expected {TOKENIZER_JSON} (with {TOKENIZER_CONFIG}), "
        f"or a SentencePiece {SENTENCEPIECE_MODEL}, or vocab.json + merges.txt"
    )


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {got}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}] has no '{key}'")
            if not isinstance(message[key], str):
                raise ValueError(f"messages[{i}]['{key}'] must be a string, got {type(message[key]).__name__}")
        if not message["role"]:
            raise ValueError(f"messages[{i}]['role'] is empty")


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
) -> str:
    """Render ``messages`` into a prompt string; ``tools`` (OpenAI's function tools) go to the
    template as transformers' ``tools=`` argument (templates that know no tools ignore them).

    Template precedence: ``chat_template`` argument, then the tokenizer's own,
    then ``CHATML_FALLBACK_TEMPLATE`` (when the checkpoint ships none). The
    rendered text already contains any BOS the template writes, so callers
    must tokenize it with ``add_special_tokens=False``.
    """
    _validate_messages(messages)
    template = chat_template or getattr(tokenizer, "chat_template", None) or CHATML_FALLBACK_TEMPLATE
    try:
        rendered = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False,
            tools=tools,
        )
    except Exception as e:  # jinja2 TemplateError / TemplateSyntaxError, or the template's raise_exception
        raise ValueError(f"the chat template could not render these messages: {e}") from e
    if not isinstance(rendered, str):  # defensive: older transformers returned lists for batched input
        raise ValueError(f"the chat template rendered {type(rendered).__name__}, expected a string")
    return rendered
