"""A reference DeepSeek-V4 MTP layer for tests, from transformers' modules (float32).

transformers does not instantiate the MTP layer, but it is a V4 decoder layer: the reference
loads the checkpoint's mtp.0.* tensors as the last layer of a DeepseekV4ForCausalLM one layer
longer (configured sliding, top-k routed), so transformers' own renames and modules run it, and
wraps it with e_proj / h_proj / enorm / hnorm / norm / hc_head written from DeepSeek's formula.
Its input streams are the main model's final streams, taken with a hook on transformers' last
decoder layer. Every call is a whole-sequence forward without a cache.
"""
from __future__ import annotations

import os
import tempfile

import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from tiny_deepseek_v4 import hf_v4_model, with_mtp_layer

MTP = "model.mtp.0."
_OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
        "hc_head_base", "hc_head_scale")
class ReferenceMTP:
    """transformers' decoder layer holding the checkpoint's MTP tensors, plus the MTP formula."""

    def __init__(self, path: str) -> None:
        from transformers import DeepseekV4ForCausalLM

        self.main = hf_v4_model(path)
        tensors = load_file(os.path.join(path, "model.safetensors"))
        self.own = {k[len(MTP):]: v.float() for k, v in tensors.items() if k.startswith(MTP) and k[len(MTP):] in _OWN}
        n = self.main.config.num_hidden_layers
        layer = {f"model.layers.{n}." + k[len(MTP):]: v for k, v in tensors.items()
                 if k.startswith(MTP) and k[len(MTP):] not in _OWN}
        trunk = {k: v for k, v in tensors.items() if not k.startswith(MTP)}
        with tempfile.TemporaryDirectory() as tmp:
            with_mtp_layer(self.main.config).save_pretrained(tmp)
            save_file({**trunk, **layer}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            longer, info = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        self.longer = longer.eval()
        self.layer = self.longer.model.layers[n]
        self.eps, self.hc_eps = self.main.config.rms_norm_eps, self.main.config.hc_eps
        self.window = self.main.config.sliding_window

    def _rms(self, x: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x if w is None else x * w

    @torch.no_grad()
    def final_streams(self, ids: list[int]) -> torch.Tensor:
        """The main model's streams [T, hc, d] after its last layer (before hc_head)."""
        seen = []
        hook = self.main.model.layers[-1].register_forward_hook(lambda m, i, out: seen.append(out))
        try:
            self.main(torch.tensor([ids]))
        finally:
            hook.remove()
        return seen[0][0]

    def _inputs(self, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """x = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(h_i)), per row."""
        own = self.own
        e = self._rms(self.main.model.embed_tokens(next_ids), own["enorm.weight"])
        return F.linear(e, own["e_proj.weight"]).unsqueeze(1) + F.linear(self._rms(streams, own["hnorm.weight"]),
                                                                       own["h_proj.weight"])

    def _layer(self, x: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """transformers' decoder layer over rows at positions 0..T-1 (sliding-window causal mask)."""
        T = x.shape[0]
        pos = torch.arange(T).unsqueeze(0)
        rope = self.longer.model.rotary_emb
        emb = {kind: rope(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
        mask = torch.zeros(T, T).masked_fill((k > q) | (k <= q - self.window), float("-inf"))[None, None]
        return self.layer(x.unsqueeze(0), position_embeddings=emb, position_ids=pos, attention_mask=mask,
                          input_ids=next_ids.unsqueeze(0))[0]

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        own = self.own
        mixes = F.linear(self._rms(out.flatten(1)), own["hc_head_fn"])
        pre = torch.sigmoid(mixes * own["hc_head_scale"] + own["hc_head_base"]) + self.hc_eps
        collapsed = (pre.unsqueeze(-1) * out).sum(1)
        return self.main.lm_head(self._rms(collapsed, own["norm.weight"]))

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """MTP logits of rows 0..len(ids)-2: row i reads h_i and token i+1 (and predicts i+2)."""
        nxt = torch.tensor(ids[1:])
        x = self._inputs(self.final_streams(ids)[:-1], nxt)
        return self._logits(self._layer(x, nxt))

    @torch.no_grad()
    def drafts(self, ids: list[int], k: int, margin: float = 1e-3) -> list[int]:
        """The k greedy drafts after ids (its last token not yet computed by the main model): the
        row of the last token, then k-1 rows chained from the layer's own output streams. Stops
        early where the top two logits are within `margin` (float noise could swap them)."""
        nxt = torch.tensor(ids[1:])
        x = self._inputs(self.final_streams(ids[:-1]), nxt)
        out: list[int] = []
        for _ in range(k):
            streams = self._layer(x, nxt)
            top = self._logits(streams[-1:])[0].topk(2)
            if (top.values[0] - top.values[1]).item() < margin:
                break
            out.append(int(top.indices[0]))
            nxt = torch.cat([nxt, top.indices[:1]])
            x = torch.cat([x, self._inputs(streams[-1:], top.indices[:1])])
        return out


