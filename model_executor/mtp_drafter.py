"""Drafting with a model's multi-token prediction (MTP) layer (DeepSeek-V4: models/deepseek_v4/mtp.py).

Row convention. The MTP row of position i combines the main model's final streams h_i with the
next token t_{i+1}, predicts t_{i+2}, and keeps its K/V at position i in the MTP layer's own
slice of the sliding-window (swa) space. (DeepSeek's reference labels that row i+1; attention
sees only relative positions, so the drafts are the same.) The MTP rows of a step are then the
main model's rows, on the same pages and the same attention metadata, and two things follow:

* Draft extend: after every forward, the MTP runs over all the step's rows (prefill chunks,
  decodes, verified chunks) with the main model's streams, so each computed position also has
  its MTP K/V, and those K/V are cached, tiered and released with their swa pages. t_{i+1} is
  known for every row by then: a prompt or output token, the token just sampled, or for a
  verified chunk the greedy token after the row (for accepted rows that is the accepted draft
  or the bonus token; rows past the acceptance are rewritten before anything reads them).
  The row of a request's last accepted position is its `tail`: its output streams, and its
  greedy token, the first draft.
* Chain: propose() runs k-1 more MTP steps from a tail, each reading the previous step's output
  streams and draft, at positions L, L+1, ... (L = the request's computed tokens; the engine
  allocated their pages). Their K/V are speculative and rewritten by the next draft extend.

The slot of position i depends on t_{i+1}: a prefix hit whose next token differs from the cached
request's reads one MTP key computed from another token, and the first row of a hit has no h
for the cached positions before it. Both only change drafts, never outputs (drafts are verified).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hybridkv.model_executor.batch import ScheduledSequence
from hybridkv.model_executor.checkpoint import safetensors_names
from hybridkv.model_executor.models.base import CausalLM
from hybridkv.model_executor.parallel.state import TensorParallel
from hybridkv.model_executor.sampler import greedy_tokens


@dataclass
class MtpTail:
    """A request's MTP row at its last accepted position: where its next draft chain starts."""

    position: int  # i: the row combined h_i and t_{i+1}
    next_token: int  # t_{i+1}, the request's last token
    streams: torch.Tensor  # [hc, d] the MTP layer's output streams of the row
    draft: int  # the greedy token of its logits: the first draft (for t_{i+2})


def accepted_drafts(drafts: list[int], greedy: list[int]) -> int:
    """How many drafts a greedy verification accepts (engine/speculative/verifier.py's rule)."""
    a = 0
    while a < len(drafts) and drafts[a] == greedy[a]:
        a += 1
    return a


def check_mtp(cls: type[CausalLM], model_dir: str, parallel: TensorParallel | None) -> None:
    """Refuse speculative decoding with an MTP layer where there is none to load, before anything
    is built: a model class without one, a checkpoint that ships none, tensor parallelism."""
    if not getattr(cls, "supports_mtp", False):
        raise ValueError(f"speculative_config method 'mtp' needs a model with a multi-token prediction layer; "
                         f"{cls.__name__} ({model_dir}) has none (DeepSeek-V4 has): use method 'ngram'")
    if parallel is not None:
        raise ValueError("speculative_config method 'mtp' is not supported with tensor_parallel_size > 1")
    names = safetensors_names(model_dir)
    if not any(n.startswith(("mtp.0.", "model.mtp.0.")) for n in names):
        raise ValueError(f"speculative_config method 'mtp': the checkpoint {model_dir} ships no MTP weights "
                         "(no mtp.0.* or model.mtp.0.* tensor); use method 'ngram'")


def _token_at(s: ScheduledSequence, position: int) -> int:
    n = len(s.prompt_token_ids)
    return s.prompt_token_ids[position] if position < n else s.output_token_ids[position - n]


class MtpDrafter:
    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.mtp = model.mtp
        self.tails: dict[str, MtpTail] = {}
        # Parity hook: when a dict, the MTP logits of every extended row are appended per request.
        self.captured_logits: dict[str, list[torch.Tensor]] | None = None

    def _next_tokens(self, items: list[ScheduledSequence], sampled: dict[str, int],
                     verified: dict[str, list[int]]) -> tuple[list[int], dict[str, int]]:
        """t_{i+1} for every row of the step, and the row of each request's tail (its last
        accepted row, where it has one: a chunk that stops inside the prompt has none)."""
        next_ids: list[int] = []
        tail_rows: dict[str, int] = {}
        row = 0
        for s in items:
            greedy = verified.get(s.request_id)
            if greedy is not None:  # the last token and its drafts, verified in one chunk
                next_ids += greedy
                tail_rows[s.request_id] = row + accepted_drafts(s.token_ids[1:], greedy)
            else:
                known = len(s.prompt_token_ids) + len(s.output_token_ids)
                next_ids += [_token_at(s, p + 1) for p in range(s.start, min(s.end, known - 1))]
                if s.end == known:  # the chunk's last row is followed by the token sampled now
                    next_ids.append(sampled[s.request_id])
                    tail_rows[s.request_id] = row + s.num_new_tokens - 1
            row += s.num_new_tokens
        return next_ids, tail_rows

    @torch.inference_mode()
    def extend(self, items: list[ScheduledSequence], positions: torch.Tensor, meta,
               sampled: dict[str, int], verified: dict[str, list[int]]) -> None:
        """The draft extend of a step the model just ran (items, positions and meta as it ran
        them): the MTP's K/V at every row, and the tails of the requests whose next token is known."""
        streams, self.model.final_streams = self.model.final_streams, None
        next_ids, tail_rows = self._next_tokens(items, sampled, verified)
        for s in items:
            if s.request_id not in tail_rows:
                self.tails.pop(s.request_id, None)
        meta.kv_loads = None  # the forward completed this step's host-tier load-backs
        ids = torch.tensor(next_ids, dtype=torch.long, device=streams.device)
        out = self.mtp(streams, ids, self.model.embed_tokens, positions, meta)
        if self.captured_logits is not None:
            logits = self.model.compute_logits(self.mtp.head_hidden(out)).float().cpu()
            row = 0
            for s in items:
                self.captured_logits.setdefault(s.request_id, []).append(logits[row : row + s.num_new_tokens])
                row += s.num_new_tokens
        if not tail_rows:
            return
        rows = list(tail_rows.values())
        picked = out[torch.tensor(rows, device=out.device)]
        drafts = greedy_tokens(self.model.compute_logits(self.mtp.head_hidden(picked)).cpu()).tolist()
        pos = positions[torch.tensor(rows, device=positions.device)].tolist()
        for i, rid in enumerate(tail_rows):
            self.tails[rid] = MtpTail(pos[i], next_ids[rows[i]], picked[i].clone(), drafts[i])

    @torch.inference_mode()
    def propose(self, request_ids: list[str], num_computed: list[int], last_tokens: list[int],
                num_drafts: list[int], rows_meta: Callable[[list[str], list[int]], tuple[object, torch.Tensor]],
                ) -> dict[str, list[int]]:
        """Up to num_drafts[i] greedy drafts for each request whose tail is at its last token
        (position num_computed - 1, next token last_tokens[i]); the others get none. One MTP
        forward per draft position over the requests still drafting. rows_meta(ids, positions):
        the attention metadata and positions tensor of one row per request at those positions."""
        live = [(rid, t, k) for rid, n, tok, k in zip(request_ids, num_computed, last_tokens, num_drafts)
                if (t := self.tails.get(rid)) is not None and t.position == n - 1 and t.next_token == tok and k > 0]
        if not live:
            return {}
        drafts = {rid: [t.draft] for rid, t, _ in live}
        streams = torch.stack([t.streams for _, t, _ in live])  # each request's last output streams
        tokens = [t.draft for _, t, _ in live]
        pos = [t.position + 1 for _, t, _ in live]
        for j in range(1, max(k for _, _, k in live)):
            active = [i for i, (_, _, k) in enumerate(live) if k > j]
            ids = [live[i][0] for i in active]
            meta, positions = rows_meta(ids, [pos[i] for i in active])
            index = torch.tensor(active, device=streams.device)
            token_ids = torch.tensor([tokens[i] for i in active], dtype=torch.long, device=streams.device)
            out = self.mtp(streams[index], token_ids, self.model.embed_tokens, positions, meta)
            new = greedy_tokens(self.model.compute_logits(self.mtp.head_hidden(out)).cpu()).tolist()
            streams = streams.index_copy(0, index, out)
            for i, rid, tok in zip(active, ids, new):
                drafts[rid].append(tok)
                tokens[i], pos[i] = tok, pos[i] + 1
        return drafts

    def release(self, request_ids) -> None:
        """Requests that left the device: their tails go (a resume's prefill makes a new one)."""
        for rid in request_ids:
            self.tails.pop(rid, None)
