"""A user request as the engine tracks it (n sequences sampled from one prompt), and the
RequestOutput built from it each step: full or delta text, tokens, logprobs and metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.outputs import CompletionOutput, RequestOutput
from hybridkv.engine.request import Request
from hybridkv.engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestGroup:
    """A user request: n sequences sampled from one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detoks: dict[str, IncrementalDetokenizer]
    sent_tokens: dict[str, int] = field(default_factory=dict)  # for DELTA outputs
    sent_logprobs: dict[str, int] = field(default_factory=dict)
    sent_prompt_logprobs: bool = False
    reported_finished: set[str] = field(default_factory=set)


def make_output(group: RequestGroup, hisparse_counts=None) -> RequestOutput | None:
    """The group's RequestOutput for this step (None: nothing to report yet, by its output
    kind). hisparse_counts(sequence id) -> (lookups, hits) of its HiSparse selections, or None."""
    kind = group.params.output_kind
    finished = all(r.finished for r in group.children)
    if kind == RequestOutputKind.FINAL_ONLY and not finished:
        return None
    delta = kind == RequestOutputKind.DELTA
    outputs = []
    for req in group.children:
        rid = req.request_id
        if delta and rid in group.reported_finished:
            continue
        detok = group.detoks[rid]
        text = detok.get_next_output_text(req.finished, delta)
        ids = req.output_token_ids
        logprobs = req.logprobs
        if delta:
            start = group.sent_tokens.get(rid, 0)
            ids = ids[start:]
            group.sent_tokens[rid] = req.num_output_tokens
            if logprobs is not None:
                lstart = group.sent_logprobs.get(rid, 0)
                group.sent_logprobs[rid] = len(logprobs)
                logprobs = logprobs[lstart:]
            if not ids and not text and not req.finished:
                continue
        if req.finished:
            group.reported_finished.add(rid)
        outputs.append(
            CompletionOutput(
                index=req.index,
                text=text,
                token_ids=list(ids),
                cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
                logprobs=list(logprobs) if logprobs is not None else None,
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
            )
        )
    lead = group.children[0]
    prompt_logprobs = lead.prompt_logprobs
    if delta and prompt_logprobs is not None:
        if group.sent_prompt_logprobs or len(prompt_logprobs) < lead.num_prompt_tokens:
            prompt_logprobs = None
        else:
            group.sent_prompt_logprobs = True
    if delta and not outputs and not finished:
        return None
    metrics = group_metrics(group, hisparse_counts)
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=outputs,
        finished=finished,
        num_cached_tokens=max(0, lead.num_cached_tokens),
        metrics=metrics,
    )


def group_metrics(group: RequestGroup, hisparse_counts=None) -> dict:
    lead = group.children[0]
    return {
        "arrival_time": lead.arrival_time,
        "first_scheduled_time": lead.first_scheduled_time,
        "first_token_time": lead.first_token_time,
        "last_token_time": lead.last_token_time,
        "num_preemptions": sum(r.num_preemptions for r in group.children),
        "num_cached_tokens": max(0, lead.num_cached_tokens),
        # Where the prompt came from: device cache, host tier (loaded back), or computed.
        "prompt_tokens_from_device": max(0, lead.num_cached_tokens) - lead.num_host_cached_tokens,
        "prompt_tokens_from_host": lead.num_host_cached_tokens - lead.num_storage_cached_tokens,
        "prompt_tokens_from_storage": lead.num_storage_cached_tokens,
        "prompt_tokens_computed": len(lead.prompt_token_ids) - max(0, lead.num_cached_tokens),
        "cached_tokens_per_space": dict(lead.cached_tokens_per_space),
        **_hisparse_metrics(group, hisparse_counts),
    }


def _hisparse_metrics(group: RequestGroup, hisparse_counts) -> dict:
    """HiSparse: the share of the request's selected C4 entries found in its hot buffers."""
    if hisparse_counts is None:
        return {}
    counts = [hisparse_counts(r.request_id) for r in group.children]
    lookups, hits = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return {"hisparse_lookups": lookups, "hisparse_hit_rate": hits / lookups if lookups else None}
