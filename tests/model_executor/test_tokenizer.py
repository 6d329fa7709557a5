"""Tests for model_executor.tokenizer: loading tokenizer.json and SentencePiece-only folders, chat templates.

Tokenizers are trained in the test (tokenizers BPE, sentencepiece BPE/Unigram)
on generated text, so nothing is downloaded.
"""

from __future__ import annotations

import json
import random

import pytest

from hybridkv.model_executor.tokenizer import (
    CHATML_FALLBACK_TEMPLATE,
    apply_chat_template,
    load_tokenizer,
    parse_sentencepiece_model,
)

_WORDS = ("the quick brown fox jumps over lazy dog cat sat on mat hello world engine cache block "
          "token model paged attention scheduler prefill decode").split()


def _corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n_lines)]
    # Some random character soup so every letter and punctuation mark is seen.
    lines += ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz .,!?") for _ in range(60)) for _ in range(100)]
    return lines


# Texts the tokenizers must agree on: plain, repeated/leading/trailing spaces,
# newlines, tabs, punctuation, NFKC-normalisable fullwidth letters, unseen letters.
_SAMPLES = [
    "the quick brown fox",
    "hello  world\nengine",
    " leading space",
    "  two  spaces  ",
    "paged attention, prefill! decode?",
    "tab\there",
    "ｆｕｌｌwidth",
    "zebra xylophone QUIZ",
]


# ----------------------------------------------------------------------------- tokenizer.json


@pytest.fixture(scope="module")
def json_tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    path = tmp_path_factory.mktemp("json_tok")
    tok.save_pretrained(str(path))
    return str(path)


def test_tokenizer_json_folder_round_trips(json_tokenizer_dir):
    """A folder with tokenizer.json loads as a fast tokenizer whose encode/decode round-trips text."""
    tok = load_tokenizer(json_tokenizer_dir)
    assert tok.is_fast
    for text in _SAMPLES[:6]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.eos_token == "</s>" and tok.eos_token_id == tok.convert_tokens_to_ids("</s>")


def test_missing_tokenizer_files_names_folder_and_expected_files(tmp_path):
    """A folder without any tokenizer file is a ValueError naming the folder and the expected files."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError) as err:
        load_tokenizer(str(tmp_path))
    msg = str(err.value)
    assert str(tmp_path) in msg and "tokenizer.json" in msg and "tokenizer.model" in msg


def test_missing_folder(tmp_path):
    """A nonexistent folder is a ValueError saying so."""
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


# ----------------------------------------------------------------------------- sentencepiece


def _train_sentencepiece(tmp_path, model_type: str, vocab_size: int, tokenizer_config: dict | None,
                         **train_kwargs) -> str:
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(_corpus()))
    folder = tmp_path / f"spm_{model_type}"
    folder.mkdir()
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=vocab_size,
        model_type=model_type, minloglevel=2, num_threads=1, **train_kwargs,
    )
    (folder / "tokenizer.vocab").unlink()  # only tokenizer.model, as in old Llama checkpoints
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(folder)


_LLAMA_CONFIG = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                 "unk_token": "<unk>", "add_bos_token": True}


@pytest.mark.parametrize(
    "model_type, vocab_size, extra",
    [("bpe", 150, {}), ("unigram", 150, {}), ("bpe", 400, {"byte_fallback": True})],
    ids=["bpe", "unigram", "bpe-byte-fallback"],
)
def test_sentencepiece_only_folder_matches_sentencepiece_ids(tmp_path, model_type, vocab_size, extra):
    """A folder with only tokenizer.model (+ tokenizer_config.json) encodes to the same ids as
    SentencePieceProcessor (plus the BOS the config asks for) and decodes back to the original text."""
    import sentencepiece as spm

    folder = _train_sentencepiece(tmp_path, model_type, vocab_size, _LLAMA_CONFIG, **extra)
    tok = load_tokenizer(folder)
    sp = spm.SentencePieceProcessor(model_file=f"{folder}/tokenizer.model")
    assert tok.is_fast
    assert tok.bos_token_id == sp.bos_id() and tok.eos_token_id == sp.eos_id() and tok.unk_token_id == sp.unk_id()
    for text in _SAMPLES:
        expected = sp.encode(text)
        assert tok.encode(text) == [sp.bos_id()] + expected, text
        assert tok.encode(text, add_special_tokens=False) == expected, text
        if sp.unk_id() not in expected:  # <unk> is a special token and cannot round-trip
            assert tok.decode(expected) == sp.decode(expected), text


def test_sentencepiece_folder_without_tokenizer_config(tmp_path):
    """tokenizer.model alone still loads: special tokens come from the model, ids match SentencePiece."""
    import sentencepiece as spm

    folder = _train_sentencepiece(tmp_path, "bpe", 150, None)
    tok = load_tokenizer(folder)
    sp = spm.SentencePieceProcessor(model_file=f"{folder}/tokenizer.model")
    assert tok.eos_token == sp.id_to_piece(sp.eos_id())
    text = "hello world the cat"
    assert tok.encode(text, add_special_tokens=False) == sp.encode(text)


def test_sentencepiece_control_pieces_are_special(tmp_path):
    """Control pieces of the SentencePiece model (bos/eos/pad, extra control symbols) become special tokens."""
    folder = _train_sentencepiece(tmp_path, "bpe", 150, _LLAMA_CONFIG, pad_id=3, control_symbols=["<ctl>"])
    tok = load_tokenizer(folder)
    for piece in ("<s>", "</s>", "<pad>", "<ctl>"):
        assert piece in tok.all_special_tokens, piece
    assert tok.pad_token == "<pad>"
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(ids + [tok.convert_tokens_to_ids("<ctl>")], skip_special_tokens=True) == "hello world"


def test_parse_sentencepiece_model_matches_processor(tmp_path):
    """The protobuf-free model reader sees the same pieces, scores and special ids as SentencePieceProcessor."""
    import sentencepiece as spm

    folder = _train_sentencepiece(tmp_path, "unigram", 150, None, pad_id=3)
    with open(f"{folder}/tokenizer.model", "rb") as f:
        spec = parse_sentencepiece_model(f.read())
    sp = spm.SentencePieceProcessor(model_file=f"{folder}/tokenizer.model")
    assert len(spec.pieces) == sp.get_piece_size()
    for i, piece in enumerate(spec.pieces):
        assert piece.piece == sp.id_to_piece(i)
        assert abs(piece.score - sp.get_score(i)) < 1e-6
        assert (piece.type == 3) == sp.is_control(i)
    t = spec.trainer_spec
    assert (t.model_type, t.unk_id, t.bos_id, t.eos_id, t.pad_id) == (1, sp.unk_id(), sp.bos_id(), sp.eos_id(), 3)
    assert spec.normalizer_spec.add_dummy_prefix and spec.normalizer_spec.precompiled_charsmap


def test_corrupt_sentencepiece_model_names_file(tmp_path):
    """A tokenizer.model that is not a SentencePiece proto is a ValueError naming the file."""
    (tmp_path / "tokenizer.model").write_bytes(b"\xff\xff\xff garbage")
    with pytest.raises(ValueError) as err:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path / "tokenizer.model") in str(err.value)


# ----------------------------------------------------------------------------- chat template

_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_chat_template_argument_is_used(json_tokenizer_dir):
    """An explicit chat_template argument wins and add_generation_prompt is passed to it."""
    tok = load_tokenizer(json_tokenizer_dir)
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert apply_chat_template(tok, _MESSAGES, chat_template=template) == "[system]Be brief.[user]Hi![assistant]"
    assert apply_chat_template(tok, _MESSAGES, chat_template=template,
                               add_generation_prompt=False) == "[system]Be brief.[user]Hi!"


def test_tokenizer_own_template_is_used(json_tokenizer_dir):
    """Without an argument, the tokenizer's chat_template (e.g. from tokenizer_config.json) is used."""
    tok = load_tokenizer(json_tokenizer_dir)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert apply_chat_template(tok, _MESSAGES, add_generation_prompt=False) == "<system>Be brief.<user>Hi!"


def test_chatml_fallback_when_tokenizer_has_no_template(json_tokenizer_dir):
    """A tokenizer without a chat template gets the documented ChatML fallback."""
    tok = load_tokenizer(json_tokenizer_dir)
    assert not tok.chat_template
    assert apply_chat_template(tok, _MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<|im_start|>" in CHATML_FALLBACK_TEMPLATE


def test_sentencepiece_folder_template_from_tokenizer_config(tmp_path):
    """The chat_template of tokenizer_config.json is applied to a SentencePiece-only folder too."""
    config = dict(_LLAMA_CONFIG, chat_template="{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    tok = load_tokenizer(_train_sentencepiece(tmp_path, "bpe", 150, config))
    assert apply_chat_template(tok, _MESSAGES, add_generation_prompt=False) == "Be brief.|Hi!|"


@pytest.mark.parametrize(
    "messages, complaint",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (None, "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\] must be a string"),
        ([{"role": "user", "content": "a"}, {"role": None, "content": "b"}], r"messages\[1\]\['role'\] must be a string"),
        ([{"role": "", "content": "hi"}], "is empty"),
    ],
)
def test_bad_messages_raise_value_error(json_tokenizer_dir, messages, complaint):
    """Malformed messages are a ValueError that says which message and what is wrong."""
    tok = load_tokenizer(json_tokenizer_dir)
    with pytest.raises(ValueError, match=complaint):
        apply_chat_template(tok, messages)


def test_broken_template_is_value_error(json_tokenizer_dir):
    """A template with a Jinja syntax error is reported as a ValueError."""
    tok = load_tokenizer(json_tokenizer_dir)
    with pytest.raises(ValueError, match="chat template"):
        apply_chat_template(tok, _MESSAGES, chat_template="{% for m in messages %}")
