// A decode step through a stack of Llama-style decoder layers in one call from Python.
//
// Each layer of a decode step is ~10 kernel calls (norms, the four linears, RoPE, the K/V write,
// paged attention, SiLU x mul) and the Python between them: the model's forward methods, the
// linears' wrappers, the views. At one row that Python cost ~110 us a layer next to ~210 us of
// weight streaming (2-core Zen 4, the demo model in bf16: 3.3 of a token's 12.5 ms). Here the same
// kernels run in the same order on the same tensors, called from C++ through their addresses
// (each kernel module's kernel_addresses()), so the result is the Python path's, bit for bit:
// the kernels are not recompiled here, and each keeps the compiler flags its module was built
// with (fused_ops.cpp's -ffp-contract=off among them).
//
// The layer, as LlamaDecoderLayer.forward does it for a step of decodes only (fused_decode.py
// decides when that holds):
//   residual, x = norm(hidden) (first layer) or add_norm(hidden, residual)
//   qkv = linear(x); q, k = rotary(qkv[:, :q+kv]) split by heads; v = qkv[:, q+kv:]
//     (with q/k norms, Qwen3's: q = rotary(norm(q by heads)), k = rotary(norm(k by heads)))
//   write_kv(k, v -> the layer's caches at the step's slots)
//   o = paged_attention(q over the caches through the layer's block table)
//   residual, x = add_norm(linear(o), residual)
//   hidden = linear(silu_and_mul(linear(x)))
// between the embedding lookup and the model's final norm (add_norm(hidden, residual)), which
// run here too, as does building the decode groups: at one row each small op after the weight
// stream cost ~50-100 us from Python.
//
// Gemma 3's layer (gemma3 = true), as Gemma3DecoderLayer.forward does it: every norm stores
// weight - 1 (unit offset), each sub-block's output is normed before its residual add, and the
// MLP's gate is GELU-tanh; the embedding is scaled by sqrt(hidden) rounded to the dtype first:
//   x = norm(hidden); q, k, v and attention as above (q/k norms, unit offset)
//   hidden = hidden + post_norm(linear(o))
//   hidden = hidden + post_ff_norm(linear(gelu_tanh(gate) * up)), gate|up = linear(pre_ff_norm(hidden))
// and the final norm is norm(hidden). Sliding and full layers read their own RoPE table
// (layer_rope) and block space (layer_space).
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// The kernels' exact types (blocked_linear.cpp, fused_ops.cpp, paged_attention.cpp).
using Linear = torch::Tensor (*)(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, int64_t);
using RmsNorm = torch::Tensor (*)(torch::Tensor, torch::Tensor, double, bool);
using AddRmsNorm = std::vector<torch::Tensor> (*)(torch::Tensor, torch::Tensor, torch::Tensor, double, bool);
using Rotary = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor);
using SiluAndMul = torch::Tensor (*)(torch::Tensor);
using PagedAttention = torch::Tensor (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                         torch::Tensor, torch::Tensor, int64_t, int64_t, double);
using WriteKv = void (*)(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor);

template <typename Fn>
Fn kernel(const std::unordered_map<std::string, int64_t>& addresses, const char* name) {
  const auto it = addresses.find(name);
  TORCH_CHECK(it != addresses.end() && it->second != 0, "decode_layers: no address for kernel ", name);
  return reinterpret_cast<Fn>(it->second);
}

// A bias slot: an empty tensor stands for "no bias" (a list of tensors cannot hold None).
c10::optional<torch::Tensor> bias_of(const torch::Tensor& t) {
  return t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// Per layer, in this order; empty tensors where a model has none (q/k norms, Gemma 3's
// pre- and post-feedforward norms). kPostNorm is post_attention_layernorm in either layer.
constexpr int64_t kWeights = 14;
enum {
  kInNorm, kPostNorm, kQkv, kQkvBias, kO, kOBias, kGateUp, kGateUpBias, kDown, kDownBias, kQNorm, kKNorm,
  kPreFfNorm, kPostFfNorm
};

}  // namespace

// ids [T] (int64) through the embedding [vocab, hidden] (times embed_scale for Gemma 3), every
// layer and the final norm; returns the final hidden states [T, hidden].
//   kernels:      name -> address: `linear` (the four projections' kernel) and rms_norm,
//                 add_rms_norm, rotary, silu_and_mul, paged_attention, write_kv
//   weights:      kWeights per layer (the enum above; packed linears, float32 padded biases or
//                 empty tensors, norm weights; the per-head q/k norms' weights or empty tensors)
//   out_features: 4 per layer (qkv, o, gate_up, down)
//   caches:       2 per layer (k, v: [Hkv, slots, D])
//   tables:       2 per block space (block table int32, slot mapping int64); windows: 1 per block
//                 space (-1: none); layer_space: each layer's block space (an index into those)
//   context_lens: [T] int32, each sequence's tokens in the cache after this step (the step's
//                 decode groups, AttentionMetadata.decode_groups, are built from it here)
//   ropes:        2 per RoPE table (cos, sin [T, 1, D] in the embedding's dtype); layer_rope: each
//                 layer's table (an index into those)
//   eps: the layers' norms' (q/k norms included); final_norm, final_eps: the model's final RMSNorm
//   gemma3:       Gemma 3's layer (above); embed_scale is read only then
torch::Tensor decode_layers(torch::Tensor ids, torch::Tensor embedding, std::unordered_map<std::string, int64_t> kernels,
                            std::vector<torch::Tensor> weights, std::vector<int64_t> out_features,
                            std::vector<torch::Tensor> caches, std::vector<torch::Tensor> tables,
                            std::vector<int64_t> windows, std::vector<int64_t> layer_space, torch::Tensor context_lens,
                            std::vector<torch::Tensor> ropes, std::vector<int64_t> layer_rope, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, int64_t page_size, double scale, double eps,
                            torch::Tensor final_norm, double final_eps, bool gemma3, double embed_scale) {
  const auto linear = kernel<Linear>(kernels, "linear");
  const auto rms_norm = kernel<RmsNorm>(kernels, "rms_norm");
  const auto add_rms_norm = kernel<AddRmsNorm>(kernels, "add_rms_norm");
  const auto rotary = kernel<Rotary>(kernels, "rotary");
  const auto silu_and_mul = kernel<SiluAndMul>(kernels, "silu_and_mul");
  const auto paged_attention = kernel<PagedAttention>(kernels, "paged_attention");
  const auto write_kv = kernel<WriteKv>(kernels, "write_kv");

  const int64_t layers = static_cast<int64_t>(layer_space.size());
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
  const int64_t spaces = static_cast<int64_t>(windows.size());
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "decode_layers: ids must be [T] int64");
  TORCH_CHECK(embedding.dim() == 2, "decode_layers: the embedding must be [vocab, hidden]");
  torch::Tensor hidden = at::embedding(embedding, ids);  // as nn.Embedding's forward
  // Gemma 3: times a 0-dim tensor of the scale in the dtype, as Gemma3ForCausalLM.forward does.
  if (gemma3) hidden = hidden * at::scalar_tensor(embed_scale, hidden.options());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeights * layers &&
                  static_cast<int64_t>(out_features.size()) == 4 * layers &&
                  static_cast<int64_t>(caches.size()) == 2 * layers,
              "decode_layers: per-layer lists of ", layers, " layers do not match");
  TORCH_CHECK(static_cast<int64_t>(tables.size()) == 2 * spaces, "decode_layers: per-space lists of ", spaces,
              " spaces do not match");
  for (const int64_t sp : layer_space)
    TORCH_CHECK(sp >= 0 && sp < spaces, "decode_layers: a layer's block space ", sp, " is not one of ", spaces);
  const int64_t tables_of_rope = static_cast<int64_t>(ropes.size()) / 2;
  TORCH_CHECK(ropes.size() % 2 == 0 && static_cast<int64_t>(layer_rope.size()) == layers,
              "decode_layers: ropes (cos, sin per table) and layer_rope (one per layer) do not match");
  for (const int64_t r : layer_rope)
    TORCH_CHECK(r >= 0 && r < tables_of_rope, "decode_layers: a layer's RoPE table ", r, " is not one of ",
                tables_of_rope);
  const int64_t T = hidden.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  // The decodes as query groups of one row, as AttentionMetadata.decode_groups builds them: group
  // i is row i of the block table, at position context_lens[i] - 1. (Four torch ops from Python
  // cost ~80 us a step after the weight stream; these loops cost nothing measurable.)
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == T && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous(),
              "decode_layers: context_lens must be [T] int32");
  const auto int32 = context_lens.options();
  auto group_start = torch::empty({T + 1}, int32), positions = torch::empty({T}, int32);
  {
    int32_t* gs = group_start.data_ptr<int32_t>();
    int32_t* pos = positions.data_ptr<int32_t>();
    const int32_t* ctx = context_lens.data_ptr<int32_t>();
    for (int64_t i = 0; i <= T; ++i) gs[i] = static_cast<int32_t>(i);
    for (int64_t i = 0; i < T; ++i) pos[i] = ctx[i] - 1;
  }
  const auto group_row = group_start.narrow(0, 0, T);
  torch::Tensor residual;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + kWeights * l;
    const int64_t* n = out_features.data() + 4 * l;
    const torch::Tensor &k_cache = caches[2 * l], &v_cache = caches[2 * l + 1];
    const int64_t sp = layer_space[l];
    const torch::Tensor &cos = ropes[2 * layer_rope[l]], &sin = ropes[2 * layer_rope[l] + 1];
    torch::Tensor x;
    if (gemma3) {
      x = rms_norm(hidden, w[kInNorm], eps, true);
    } else if (l == 0) {
      residual = hidden;
      x = rms_norm(hidden, w[kInNorm], eps, false);
    } else {
      auto sum_norm = add_rms_norm(hidden, residual, w[kInNorm], eps, false);
      residual = sum_norm[0];
      x = sum_norm[1];
    }
    const auto qkv = linear(x, w[kQkv], bias_of(w[kQkvBias]), n[0]);
    const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads, head_dim});
    torch::Tensor q, k;
    if (w[kQNorm].numel() == 0) {
      const auto qk = rotary(qkv.narrow(1, 0, q_size + kv_size).view({T, heads + kv_heads, head_dim}), cos, sin);
      q = qk.narrow(1, 0, heads);
      k = qk.narrow(1, heads, kv_heads);
    } else {
      q = rotary(rms_norm(qkv.narrow(1, 0, q_size).view({T, heads, head_dim}), w[kQNorm], eps, gemma3), cos, sin);
      k = rotary(rms_norm(qkv.narrow(1, q_size, kv_size).view({T, kv_heads, head_dim}), w[kKNorm], eps, gemma3), cos,
                 sin);
    }
    write_kv(k_cache, v_cache, tables[2 * sp + 1], k, v);
    const auto o = paged_attention(q, k_cache, v_cache, tables[2 * sp], group_start, group_row, positions, page_size,
                                   windows[sp], scale);
    const auto attn = linear(o.reshape({T, q_size}), w[kO], bias_of(w[kOBias]), n[1]);
    if (gemma3) {
      hidden = hidden + rms_norm(attn, w[kPostNorm], eps, true);
      const auto gate_up =
          linear(rms_norm(hidden, w[kPreFfNorm], eps, true), w[kGateUp], bias_of(w[kGateUpBias]), n[2]);
      const int64_t inter = n[2] / 2;  // as SiluAndMulMLP.forward: act(gate) * up of the split
      const auto act = at::gelu(gate_up.narrow(1, 0, inter), "tanh") * gate_up.narrow(1, inter, inter);
      hidden = hidden + rms_norm(linear(act, w[kDown], bias_of(w[kDownBias]), n[3]), w[kPostFfNorm], eps, true);
      continue;
    }
    auto sum_norm = add_rms_norm(attn, residual, w[kPostNorm], eps, false);
    residual = sum_norm[0];
    const auto gate_up = linear(sum_norm[1], w[kGateUp], bias_of(w[kGateUpBias]), n[2]);
    hidden = linear(silu_and_mul(gate_up), w[kDown], bias_of(w[kDownBias]), n[3]);
  }
  if (gemma3) return rms_norm(hidden, final_norm, final_eps, true);
  return add_rms_norm(hidden, residual, final_norm, final_eps, false)[1];
}
