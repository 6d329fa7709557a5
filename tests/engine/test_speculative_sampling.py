"""N-gram speculative decoding of sampled requests (temperature > 0, model_executor/rejection_sampler.py):
the generated tokens have the law plain sampling gives them (Pearson's chi-square against the law
computed from the model's logits), seeded requests yield the same tokens run to run and with
speculation off, requests whose drafts cannot be verified exactly are not drafted, and a
multi-turn conversation reuses at least as much of its history with speculation on."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import hybridkv.model_executor.model_runner as model_runner
from chi_square import chi_square, critical_value
from hybridkv.entrypoints import LLM, SamplingParams
from hybridkv.model_executor.rejection_sampler import DraftedSequence, target_probs

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
KW = dict(dtype="float32", max_model_len=256, num_scheduler_steps=1)
TEMPERATURE, TOP_K, TOKENS, DRAWS = 0.1, 3, 4, 2000


def _generate(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_invariants()
    return [list(c.token_ids) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def looping_prompt(tiny_ckpt) -> list[int]:
    """A repeated pattern, then the tiny Llama's own greedy continuation of it, which settles into
    a cycle: at a low temperature the sampled tokens follow the cycle often but not always, so
    the n-gram drafts are accepted at some rows and rejected at others."""
    llm = LLM(tiny_ckpt("llama"), **KW)
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(3, llm.engine.runner.config.vocab_size, (8,), generator=g).tolist()
    greedy = _generate(llm, [pattern * 5], SamplingParams(temperature=0, max_tokens=22, ignore_eos=True))[0]
    return pattern * 5 + greedy


def _last_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The model's logits after each prompt (the runner's capture hook)."""
    out = []
    for p in prompts:
        llm.engine.runner.captured_logits = {}
        _generate(llm, [p], SamplingParams(temperature=0, max_tokens=1))
        (rows,) = llm.engine.runner.captured_logits.values()
        out.append(rows[-1][-1].double())
    llm.engine.runner.captured_logits = None
    return out


def _exact_law(llm: LLM, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The probability of every TOKENS-token continuation under plain sampling (temperature, then
    top-k), from the model's logits after each prefix of the top-k tree, in float64."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(TOKENS):
        prefixes = list(law)
        nxt: dict[tuple[int, ...], float] = {}
        for prefix, logits in zip(prefixes, _last_logits(llm, [prompt + list(q) for q in prefixes])):
            top = (logits / TEMPERATURE).topk(TOP_K)
            for tok, p in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                nxt[prefix + (tok,)] = law[prefix] * p
        law = nxt
    return law


def _always_accept(logits: torch.Tensor, seqs: list[DraftedSequence], default_generator) -> list[list[int]]:
    """A biased verifier for the control run: keeps every draft, then one token from the last row."""
    probs, out, first = target_probs(logits, seqs), [], 0
    for s in seqs:
        last = probs[first + len(s.drafts)]
        out.append(s.drafts + [int(torch.multinomial(last, 1, generator=default_generator))])
        first += len(s.drafts) + 1
    return out


def test_sampled_tokens_follow_the_models_law_with_speculation(tiny_ckpt, looping_prompt, monkeypatch):
    """2,000 sampled continuations of 4 tokens (temperature 0.1, top-k 3) with drafts verified by
    speculative sampling: the chi-square statistic of the 4-token sequences against their exact
    probabilities stays under the critical value at alpha 1e-4 (cells expected fewer than 5 times
    pooled; the degrees of freedom are printed with a failure). The same run with a verifier that
    accepts every draft lands far above it: the test can fail."""
    path = tiny_ckpt("llama")
    law = _exact_law(LLM(path, **KW), looping_prompt)
    spec = LLM(path, speculative_config=SPEC, **KW)
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=TOKENS, ignore_eos=True)
    counts = Counter(tuple(t) for t in _generate(spec, [looping_prompt] * DRAWS, params))
    stat, df = chi_square(counts, law)
    assert df >= 8 and stat < critical_value(df), (stat, df, critical_value(df), counts.most_common(12))
    st = spec.engine.stats
    # drafts were verified at both outcomes: some accepted, some rejected
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st
    assert st["spec_drafts"] >= DRAWS // 2, st

    monkeypatch.setattr(model_runner, "sample_drafted", _always_accept)
    biased = Counter(tuple(t) for t in _generate(spec, [looping_prompt] * DRAWS, params))
    stat, df = chi_square(biased, law)
    assert stat > 10 * critical_value(df), (stat, df)


def _sampled_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.1, top_k=3, seed=1, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.3, top_p=0.9, seed=2, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.2, min_p=0.1, seed=3, max_tokens=30, ignore_eos=True, n=2),
            SamplingParams(temperature=0.1, seed=4, max_tokens=25, ignore_eos=True)]


def _prompts(vocab: int, looping: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    other = torch.randint(3, vocab, (5,), generator=g).tolist()
    return [looping, other * 6, torch.randint(3, vocab, (30,), generator=g).tolist(), looping[-30:]]


def test_seeded_sampled_requests_are_reproducible(tiny_ckpt, looping_prompt):
    """Seeded sampled requests (n = 1 and n = 2) with speculation on: the same tokens run to run,
    and the tokens of speculation off (a draw per kept token, the one plain decoding makes, over
    logits the verify rows share bit for bit with decode rows); every page is free after."""
    path = tiny_ckpt("llama")
    plain, spec = LLM(path, **KW), LLM(path, speculative_config=SPEC, **KW)
    prompts = _prompts(plain.engine.runner.config.vocab_size, looping_prompt)
    params = _sampled_params()
    first = _generate(spec, prompts, params)
    assert _generate(spec, prompts, params) == first  # prefix hits the second time
    assert _generate(LLM(path, speculative_config=SPEC, **KW), prompts, params) == first
    assert _generate(plain, prompts, params) == first
    st = spec.engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st
    spec.engine.kv.assert_idle()


def test_only_exactly_verifiable_requests_are_drafted(tiny_ckpt, looping_prompt, monkeypatch):
    """Penalties, logprobs and min_tokens not yet reached: those requests decode a token a step,
    with their plain outputs, while greedy and plain sampled ones beside them are drafted."""
    path = tiny_ckpt("llama")
    plain, spec = LLM(path, **KW), LLM(path, speculative_config=SPEC, **KW)
    drafted: dict[float, list[int]] = {}  # temperature (one per request) -> its outputs when drafted
    proposer = spec.engine.scheduler.proposer
    original = proposer.propose

    def recording(req, budget):
        drafts = original(req, budget)
        if drafts:
            drafted.setdefault(req.params.temperature, []).append(req.num_output_tokens)
        return drafts

    monkeypatch.setattr(proposer, "propose", recording)
    base = dict(max_tokens=24, ignore_eos=True, seed=5)
    params = [SamplingParams(temperature=0, **base), SamplingParams(temperature=0.1, **base),
              SamplingParams(temperature=0.11, presence_penalty=0.5, **base),
              SamplingParams(temperature=0.12, logprobs=2, **base),
              SamplingParams(temperature=0.13, min_tokens=20, stop_token_ids=[1], **base)]
    prompts = [looping_prompt] * len(params)
    assert _generate(spec, prompts, params) == _generate(plain, prompts, params)
    assert drafted.get(0) and drafted.get(0.1), drafted
    assert 0.11 not in drafted and 0.12 not in drafted, drafted
    assert min(drafted.get(0.13, [20])) >= 20, drafted  # min_tokens: drafted only once reached


def _conversation(llm: LLM, vocab: int, turns: int = 5) -> tuple[list[list[int]], list[int]]:
    """Each turn's prompt is the previous prompt, its output and new tokens (some of them a quote
    of earlier history, which the drafts copy); greedy. Returns the outputs and each turn's
    cached prompt tokens."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    history: list[int] = []
    outputs, cached = [], []
    for _ in range(turns):
        quote_at = rng.randrange(0, max(1, len(history) - 12))
        history = history + [rng.randrange(3, vocab) for _ in range(20)] + history[quote_at : quote_at + 12]
        out = llm.generate([{"prompt_token_ids": history}], params, use_tqdm=False)[0]
        outputs.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
        history = history + outputs[-1]
    llm.engine.check_invariants()
    return outputs, cached


def test_multiturn_prefix_reuse_with_speculation_is_not_lower(tiny_ckpt):
    """A chat-like conversation on a tiny Llama: with speculation on, every turn finds at least the
    cached history it finds with speculation off (the engine's prefix-hit counter too), and the
    outputs are the same."""
    path = tiny_ckpt("llama")
    kw = dict(KW, max_model_len=512, block_size=8)
    plain, spec = LLM(path, **kw), LLM(path, speculative_config=SPEC, **kw)
    vocab = plain.engine.runner.config.vocab_size
    ref_out, ref_cached = _conversation(plain, vocab)
    got_out, got_cached = _conversation(spec, vocab)
    assert got_out == ref_out
    assert all(g >= r for g, r in zip(got_cached, ref_cached)), (got_cached, ref_cached)
    assert spec.engine.kv.prefix_hits >= plain.engine.kv.prefix_hits > 0
    assert spec.engine.stats["spec_accepted_tokens"] > 0


def test_seeded_sampled_tokens_on_deepseek_v4_equal_plain_decoding(tmp_path_factory):
    """DeepSeek-V4 verifies a drafted request as one chunk of k+1 rows (its hybrid spaces), not
    as one-token decodes: its sampled, seeded requests give plain decoding's tokens too."""
    from tiny_deepseek_v4 import build_v4_checkpoint, single_thread

    v4 = build_v4_checkpoint(str(tmp_path_factory.mktemp("v4")))
    kw = dict(dtype="float32", block_size=32, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=48,
              num_scheduler_steps=1)
    with single_thread():
        plain, spec = LLM(v4, **kw), LLM(v4, speculative_config=SPEC, **kw)
        assert not spec.engine.runner.model.verify_rows_as_decodes
        g = torch.Generator().manual_seed(3)
        pattern = torch.randint(3, plain.engine.runner.config.vocab_size, (7,), generator=g).tolist()
        prompts = [pattern * 6, pattern * 3 + pattern[:2]]
        params = [SamplingParams(temperature=t, top_k=3, seed=i, max_tokens=40, ignore_eos=True)
                  for i, t in enumerate((0.05, 0.2))]
        assert _generate(spec, prompts, params) == _generate(plain, prompts, params)
    st = spec.engine.stats
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st
