"""IncrementalDetokenizer: streamed text must equal tokenizer.decode, stop strings cut it right.

All tokenizers are trained here on a small multilingual corpus (no hub access):
  * byte_level - GPT-2/SmolLM style byte-level BPE (tokenizers + PreTrainedTokenizerFast);
  * llama_sp   - a real sentencepiece BPE model with byte fallback, loaded as transformers'
                 LlamaTokenizer (Metaspace + ByteFallback + Strip decoder, like Llama/Mistral);
  * metaspace  - tokenizers' SentencePieceBPETokenizer (Metaspace decoder, no byte fallback);
  * slow_sp    - transformers' python SentencePieceBackend on the same sentencepiece model,
                 to cover the non-Rust decode path.
"""
from __future__ import annotations

import dataclasses
import io
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.sampling_params import SamplingParams

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "日本語のテキストと カタカナ、ひらがな。東京タワー🗼",
    "한국어 문장도 조금 있습니다. 감사합니다!",
    "Emoji: 😀 🎉 🚀 👨\u200d👩\u200d👧 🇯🇵 ❤️ 👍🏽 and more 🤖🤖",
    "Ça va? naïve café, über Straße; señor ñandú.",
    "Ελληνικά και русский текст, plus العربية and हिन्दी.",
    "def f(x):\n    return x * 2  # code\n\tindented\n\n  spaces   here",
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ! ? ; : ( ) [ ] { }",
    "Mixed 中文 and English with emoji 😀 in between 世界🌍 words.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_NAMES = ["byte_level", "llama_sp", "metaspace", "slow_sp"]


# -- tokenizers ---------------------------------------------------------------------------------
def _byte_level_bpe():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    # A non-special added token: decode never skips it, even with skip_special_tokens=True.
    fast.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return fast


def _sentencepiece_proto() -> bytes:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=buf,
        vocab_size=500,
        model_type="bpe",
        byte_fallback=True,  # rare characters become <0xNN> byte tokens, as in Llama
        character_coverage=0.98,
        normalization_rule_name="identity",  # no NFKC: the converted LlamaTokenizer has no normalizer
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return buf.getvalue()


def _llama_from_sentencepiece(proto: bytes):
    """transformers 5 converts a tokenizer.model only with protobuf installed; build the same
    LlamaTokenizer from the sentencepiece vocab and merges (BPE merge order = piece score)."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, pid in vocab.items():
        if sp.is_byte(pid) or sp.is_control(pid) or sp.is_unknown(pid):
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-sp.get_score(pid), vocab[left], vocab[right], left, right))
    merges.sort()
    tok = LlamaTokenizer(vocab=vocab, merges=[(a, b) for *_, a, b in merges])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    text = CORPUS[1] + " " + CORPUS[4]
    assert tok.encode(text, add_special_tokens=False) == sp.encode(text), "conversion differs from sentencepiece"
    return tok


def _metaspace_bpe():
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    raw = SentencePieceBPETokenizer()
    raw.train_from_iterator(CORPUS * 20, vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=raw._tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _slow_sentencepiece(proto: bytes, folder):
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    path = folder / "tokenizer.model"
    path.write_bytes(proto)
    return SentencePieceBackend(vocab_file=str(path), unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def all_tokenizers(tmp_path_factory) -> dict:
    proto = _sentencepiece_proto()
    return {
        "byte_level": _byte_level_bpe(),
        "llama_sp": _llama_from_sentencepiece(proto),
        "metaspace": _metaspace_bpe(),
        "slow_sp": _slow_sentencepiece(proto, tmp_path_factory.mktemp("slow_sp")),
    }


@pytest.fixture(scope="module", params=TOKENIZER_NAMES)
def tok(request, all_tokenizers):
    return all_tokenizers[request.param]


@pytest.fixture(scope="module")
def byte_level(all_tokenizers):
    return all_tokenizers["byte_level"]


# -- helpers ------------------------------------------------------------------------------------
def _interesting_ids(tokenizer) -> list[int]:
    """Byte tokens and special tokens: the ids that make incremental decoding hard."""
    vocab = tokenizer.get_vocab()
    byte_ids = [i for t, i in vocab.items() if t.startswith("<0x") and len(t) == 6]
    return byte_ids + list(tokenizer.all_special_ids) + [i for t, i in vocab.items() if t in ("▁", "<tool>")]


def _visible(tokenizer, ids: list[int], skip: bool) -> list[str]:
    special = set(tokenizer.all_special_ids) if skip else set()
    return [t for i, t in zip(ids, tokenizer.convert_ids_to_tokens(ids)) if i not in special]


def _reference(tokenizer, prompt: list[int], out: list[int], skip: bool) -> str:
    """The text the detokenizer must produce.

    Without a prompt that is tokenizer.decode(out). With one, it is the continuation of the
    prompt's text (vLLM's semantics: a sentencepiece output keeps its first leading space),
    unless the prompt ends inside a character, or inside a byte run that the output continues:
    then no continuation is well defined and the output is decoded on its own.
    """
    alone = tokenizer.decode(out, skip_special_tokens=skip)
    head = tokenizer.decode(prompt, skip_special_tokens=skip)
    vis_prompt, vis_out = _visible(tokenizer, prompt, skip), _visible(tokenizer, out, skip)
    byte_run_spans = (
        vis_prompt and vis_out and vis_prompt[-1].startswith("<0x") and vis_out[0].startswith("<0x")
        and tokenizer.convert_tokens_to_string(["<0xC3>", "<0xA9>"]) == "é"
    )
    if not vis_prompt or head.endswith("\ufffd") or byte_run_spans:
        return alone
    full = tokenizer.decode(prompt + out, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head) :]


def _stream(tokenizer, prompt, out, params, chunks):
    """Feed `out` in chunks of the given sizes; return (detok, deltas, cumulative texts, stop)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas, cumulative, stop, i = [], [], None, 0
    for size in chunks:
        if i >= len(out) or stop is not None:
            break
        stop = detok.update(out[i : i + size])
        i += size
        if stop is None:
            deltas.append(detok.get_next_output_text(finished=False, delta=True))
            cumulative.append(detok.get_next_output_text(finished=False, delta=False))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    cumulative.append(detok.get_next_output_text(finished=True, delta=False))
    return detok, deltas, cumulative, stop


def _check_stream(final: str, deltas: list[str], cumulative: list[str]) -> None:
    assert "".join(deltas) == final
    assert cumulative[-1] == final
    for text in cumulative[:-1]:
        assert final.startswith(text)  # nothing shown early is ever taken back
        if "\ufffd" not in final:
            assert "\ufffd" not in text  # no half character while streaming
    if "\ufffd" not in final:
        assert all("\ufffd" not in d for d in deltas)


def _chunk_sizes(rng: random.Random, n: int, max_chunk: int = 4) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, max_chunk))
    return sizes


# -- decode equivalence -------------------------------------------------------------------------
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_ids_match_decode(tok, data):
    """Random token ids (heavy on byte and special tokens), random chunking, with or without a
    prompt: the final text is the decode, streamed deltas add up to it, and no intermediate text
    shows a half character or anything later taken back."""
    vocab = len(tok)
    ids = st.one_of(st.integers(0, vocab - 1), st.sampled_from(_interesting_ids(tok)))
    out = data.draw(st.lists(ids, max_size=40), label="out")
    prompt = data.draw(st.one_of(st.just([]), st.lists(ids, min_size=1, max_size=8)), label="prompt")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=len(out), max_size=len(out)), label="chunks")
    detok, deltas, cumulative, _ = _stream(tok, prompt, out, SamplingParams(skip_special_tokens=skip), chunks)
    expected = _reference(tok, prompt, out, skip)
    assert detok.output_text == expected
    _check_stream(expected, deltas, cumulative)


def test_random_ids_many_seeds(tok):
    """The same property over many seeded sequences (broader than hypothesis' budget)."""
    rng = random.Random(1234)
    interesting = _interesting_ids(tok)
    for _ in range(300):
        pick = lambda: rng.choice(interesting) if rng.random() < 0.4 else rng.randrange(len(tok))  # noqa: E731
        out = [pick() for _ in range(rng.randrange(0, 50))]
        prompt = [pick() for _ in range(rng.randrange(0, 10))]
        skip = rng.random() < 0.5
        params = SamplingParams(skip_special_tokens=skip)
        detok, deltas, cumulative, _ = _stream(tok, prompt, out, params, _chunk_sizes(rng, len(out)))
        expected = _reference(tok, prompt, out, skip)
        assert detok.output_text == expected, (prompt, out, skip)
        _check_stream(expected, deltas, cumulative)


@pytest.mark.parametrize("skip", [True, False])
def test_real_text_streams_exactly(tok, skip):
    """Encodings of real multilingual text (emoji split over several tokens, CJK, ZWJ
    sequences), cut into a prompt and an output at every position."""
    rng = random.Random(7)
    for text in CORPUS:
        ids = tok.encode(text)  # with the tokenizer's own special tokens (BOS) where it adds them
        for cut in range(len(ids) + 1):
            prompt, out = ids[:cut], ids[cut:] + [tok.eos_token_id]
            params = SamplingParams(skip_special_tokens=skip)
            detok, deltas, cumulative, _ = _stream(tok, prompt, out, params, _chunk_sizes(rng, len(out), 3))
            expected = _reference(tok, prompt, out, skip)
            assert detok.output_text == expected, (text, cut)
            _check_stream(expected, deltas, cumulative)
        # One token at a time without a prompt gives exactly tokenizer.decode.
        detok, _, cumulative, _ = _stream(tok, [], ids, SamplingParams(skip_special_tokens=skip), [1] * len(ids))
        assert detok.output_text == tok.decode(ids, skip_special_tokens=skip) == cumulative[-1]


def test_byte_level_equals_decode_of_output_even_with_prompt(byte_level):
    """For byte-level BPE the prompt changes nothing: output_text == decode(output_ids)."""
    ids = byte_level.encode("".join(CORPUS))
    rng = random.Random(3)
    for _ in range(200):
        cut = rng.randrange(len(ids))
        prompt, out = ids[max(0, cut - rng.randrange(1, 20)) : cut], ids[cut : cut + rng.randrange(1, 30)]
        detok, deltas, cumulative, _ = _stream(byte_level, prompt, out, SamplingParams(), _chunk_sizes(rng, len(out)))
        assert detok.output_text == byte_level.decode(out)
        _check_stream(detok.output_text, deltas, cumulative)


def test_prompt_ending_inside_a_character(byte_level):
    """The prompt stops after the first byte tokens of an emoji: the output is decoded on its own
    (the orphan continuation bytes become U+FFFD, as in decode(output_ids))."""
    ids = byte_level.encode("ok 🦀🦜 done")  # emoji unseen in training: split into byte tokens
    pieces = [byte_level.decode(ids[:k]) for k in range(len(ids))]
    cut = next(k for k, p in enumerate(pieces) if p.endswith("\ufffd"))
    detok, deltas, cumulative, _ = _stream(byte_level, ids[:cut], ids[cut:], SamplingParams(), [1] * len(ids))
    assert detok.output_text == byte_level.decode(ids[cut:])
    assert detok.output_text.startswith("\ufffd")


def test_sentencepiece_first_token_keeps_its_space_after_a_prompt(all_tokenizers):
    tok = all_tokenizers["llama_sp"]
    prompt = tok.encode("Hello")
    out = tok.encode(" world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(out)[0].startswith("▁")
    with_prompt = IncrementalDetokenizer(tok, prompt, SamplingParams())
    with_prompt.update(out)
    assert with_prompt.output_text == " world"  # decode(prompt + out) = "Hello world"
    alone = IncrementalDetokenizer(tok, [], SamplingParams())
    alone.update(out)
    assert alone.output_text == tok.decode(out) == "world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(byte_level, skip):
    im_end, tool = byte_level.convert_tokens_to_ids(["<|im_end|>", "<tool>"])
    out = byte_level.encode("a 😀") + [im_end, tool] + byte_level.encode(" b") + [im_end, 10_000_000]
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(skip_special_tokens=skip))
    for tid in out:
        detok.update([tid])
    assert detok.output_text == byte_level.decode(out, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.output_text) is not skip
    assert "<tool>" in detok.output_text  # an added token that is not special is never skipped


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_matches_decode(tok, spaces):
    """transformers 5 decode() ignores spaces_between_special_tokens; so do we (same output)."""
    specials = list(tok.all_special_ids)
    word = tok.encode("Hello world", add_special_tokens=False)
    out = specials + word + specials[::-1] + word + specials
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    detok = IncrementalDetokenizer(tok, [], params)
    for tid in out:
        detok.update([tid])
    assert detok.output_text == tok.decode(out, skip_special_tokens=False, spaces_between_special_tokens=spaces)


def test_long_generation_and_window_stays_small(tok, monkeypatch):
    """Thousands of tokens: still exact, and every decode call covers only a few tokens (work
    per update is O(new tokens), not O(output))."""
    ids = tok.encode(" ".join(CORPUS * 30), add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Start:"), SamplingParams())
    sizes: list[int] = []
    decode = detok._traits.tokens_to_text

    def counting(tokens: list[str]) -> str:
        sizes.append(len(tokens))
        return decode(tokens)

    detok._traits = dataclasses.replace(detok._traits, tokens_to_text=counting)
    deltas = []
    for i, tid in enumerate(ids):
        detok.update([tid])
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        if i % 500 == 0:  # interleaved cumulative reads must not disturb the delta stream
            assert detok.output_text.startswith(detok.get_next_output_text(finished=False, delta=False))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    assert len(ids) > 2000
    assert max(sizes) <= 16
    assert "".join(deltas) == detok.output_text
    assert detok.output_text.strip() == tok.decode(ids).strip()


# -- stop strings -------------------------------------------------------------------------------
def _run_stop(tokenizer, text: str, chunks: list[int] | None = None, **params):
    out = tokenizer.encode(text, add_special_tokens=False)
    return _stream(tokenizer, [], out, SamplingParams(**params), chunks or [1] * len(out))


def test_stop_string_across_token_boundary(byte_level):
    text = "Hello world! The quick brown fox jumps over the lazy dog."
    tokens = byte_level.convert_ids_to_tokens(byte_level.encode(text))
    # The stop string spans several tokens:
    assert not any("fox jumps" in byte_level.convert_tokens_to_string([t]) for t in tokens)
    detok, deltas, cumulative, stop = _run_stop(byte_level, text, stop=["fox jumps"])
    assert stop == "fox jumps"
    assert detok.output_text == "Hello world! The quick brown "
    _check_stream(detok.output_text, deltas, cumulative)


def test_include_stop_str_in_output(byte_level):
    detok, deltas, cumulative, stop = _run_stop(
        byte_level, "Hello world! The quick brown fox jumps.", stop=["fox jumps"], include_stop_str_in_output=True
    )
    assert stop == "fox jumps"
    assert detok.output_text == "Hello world! The quick brown fox jumps"
    _check_stream(detok.output_text, deltas, cumulative)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_earliest_stop_string_wins(byte_level, chunk):
    text = "the quick brown fox jumps over the lazy dog"
    kw = dict(chunks=[chunk] * 100)
    # Order in the list does not matter, position in the text does.
    assert _run_stop(byte_level, text, stop=["lazy", "fox", "quick"], **kw)[3] == "quick"
    detok, _, _, stop = _run_stop(byte_level, text, stop=["lazy dog", "over"], **kw)
    assert (stop, detok.output_text) == ("over", "the quick brown fox jumps ")
    # A stop string completed inside a longer one wins: it is the first one a stream completes,
    # so the answer does not depend on how many tokens arrived per update.
    detok, _, _, stop = _run_stop(byte_level, text, stop=["quick brown fox", "ick b"], **kw)
    assert (stop, detok.output_text) == ("ick b", "the qu")
    # Same end: the longer (earlier-starting) one.
    detok, _, _, stop = _run_stop(byte_level, text, stop=["brown", "quick brown"], **kw)
    assert (stop, detok.output_text) == ("quick brown", "the ")


def test_multibyte_stop_string(all_tokenizers):
    for name in ("byte_level", "llama_sp"):
        tok = all_tokenizers[name]
        detok, deltas, cumulative, stop = _run_stop(tok, "Mixed 中文 and English with emoji 😀 in between 世界🌍 words.", stop=["😀 in"])
        assert stop == "😀 in"
        assert detok.output_text.endswith("with emoji ")
        _check_stream(detok.output_text, deltas, cumulative)


def test_held_back_text_never_shows_part_of_a_removed_stop(byte_level):
    """Near misses ("fo", "fox ju") stream out once they are known not to be the stop string;
    the real one is never shown, not even its first characters."""
    text = "fo fox ju fox jum fox jumps away"
    detok, deltas, cumulative, stop = _run_stop(byte_level, text, stop=["fox jumps"])
    assert stop == "fox jumps"
    assert detok.output_text == "fo fox ju fox jum "
    _check_stream(detok.output_text, deltas, cumulative)
    # While unfinished, exactly len("fox jumps") - 1 characters are held back.
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["fox jumps"]))
    detok.update(byte_level.encode("fo fox ju fox jum"))
    assert detok.get_next_output_text(finished=False, delta=False) == "fo fox ju"  # 17 - 8 characters
    assert detok.get_next_output_text(finished=True, delta=False) == "fo fox ju fox jum"


def test_no_hold_back_without_stops_or_with_include(byte_level):
    for params in (SamplingParams(), SamplingParams(stop=["zzz"], include_stop_str_in_output=True)):
        detok = IncrementalDetokenizer(byte_level, [], params)
        detok.update(byte_level.encode("hello there"))
        assert detok.get_next_output_text(finished=False, delta=True) == "hello there"


@pytest.mark.parametrize("chunk", [1, 100])
def test_stop_string_inside_a_held_byte_run(all_tokenizers, chunk):
    """With byte fallback an emoji is a run of <0xNN> tokens whose text is held until the run
    ends. A stop string completed by the last byte token must still match right away: the
    generation may end there (EOS, max_tokens), and a later update may never come.
    A stray continuation byte after it would turn the whole run into U+FFFD, so even when it
    arrives in the same update() the stop must be found first (checks run after every token)."""
    tok = all_tokenizers["llama_sp"]
    out = tok.encode("東京タワー🗼", add_special_tokens=False) + [tok.convert_tokens_to_ids("<0x80>")]
    assert tok.convert_ids_to_tokens(out)[-2].startswith("<0x")  # the emoji is byte tokens
    for include, expected in ((False, "東京タ"), (True, "東京タワー🗼")):
        params = SamplingParams(stop=["ワー🗼"], include_stop_str_in_output=include)
        detok, deltas, cumulative, stop = _stream(tok, [], out, params, [chunk] * len(out))
        assert stop == "ワー🗼"
        assert detok.output_text == expected
        _check_stream(expected, deltas, cumulative)


def test_check_stop_false_ignores_stops(byte_level):
    """min_tokens not reached: no matching. A stop string entirely inside that text is never
    reported later, even when it lies within the look-back window of the next check; one that
    ends in text checked later is (vLLM's behaviour)."""
    params = SamplingParams(stop=["lazy", "zy", "dog"])
    detok = IncrementalDetokenizer(byte_level, [], params)
    assert detok.update(byte_level.encode("the lazy"), check_stop=False) is None
    assert detok.output_text == "the lazy"
    assert detok.update(byte_level.encode(" cat"), check_stop=True) is None
    assert detok.output_text == "the lazy cat"
    # "do" arrives unchecked, "g" checked: the match ends in checked text, so it counts.
    assert detok.update(byte_level.encode(" do"), check_stop=False) is None
    assert detok.update(byte_level.encode("g!"), check_stop=True) == "dog"
    assert detok.output_text == "the lazy cat "
    assert detok.get_next_output_text(finished=True, delta=True) == "the lazy cat "


def test_batched_update_stops_at_earliest_match(byte_level):
    """Several tokens in one update (e.g. speculative decoding) give the same result as one by one."""
    text = "alpha beta STOP gamma STOP delta"
    one_by_one = _run_stop(byte_level, text, stop=["STOP"])
    batched = _run_stop(byte_level, text, chunks=[100], stop=["STOP"])
    assert one_by_one[0].output_text == batched[0].output_text == "alpha beta "
    with pytest.raises(RuntimeError):
        batched[0].update(byte_level.encode("more"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stop_strings_property(all_tokenizers, data):
    """Stops drawn from the text itself, random chunking: the result is the final decode cut at
    the stop occurrence that ends first, and the stream never shows anything cut later."""
    tok = all_tokenizers[data.draw(st.sampled_from(["byte_level", "llama_sp"]), label="tokenizer")]
    text = data.draw(st.sampled_from(CORPUS), label="text")
    full = tok.decode(tok.encode(text, add_special_tokens=False))

    def substring(draw_start: int, length: int) -> str:
        start = draw_start % len(full)
        return full[start : start + length] or full[-1]

    stops = data.draw(
        st.lists(st.builds(substring, st.integers(0, 10_000), st.integers(1, 8)), min_size=1, max_size=3)
        | st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=2),
        label="stops",
    )
    include = data.draw(st.booleans(), label="include")
    out = tok.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 6), min_size=len(out), max_size=len(out)), label="chunks")
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok, deltas, cumulative, stop = _stream(tok, [], out, params, chunks)

    hits = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
    if not hits:
        assert stop is None and detok.output_text == full
    else:
        end, start, first = min(hits, key=lambda h: (h[0], h[1]))
        assert stop == first  # equal (end, start) means the same string
        assert detok.output_text == full[: end if include else start]
    _check_stream(detok.output_text, deltas, cumulative)
