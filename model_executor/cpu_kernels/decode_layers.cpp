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
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)

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
using ArgmaxRows = torch::Tensor (*)(torch::Tensor);

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

// What a stack of layers reads at every step: the kernels, the weights, the caches, the shape.
struct Stack {
  Linear linear;
  RmsNorm rms_norm;
  AddRmsNorm add_rms_norm;
  Rotary rotary;
  SiluAndMul silu_and_mul;
  PagedAttention paged_attention;
  WriteKv write_kv;
  const std::vector<torch::Tensor>& weights;
  const std::vector<int64_t>& out_features;
  const std::vector<torch::Tensor>& caches;
  const std::vector<int64_t>& windows;
  const std::vector<int64_t>& layer_space;
  const std::vector<int64_t>& layer_rope;
  torch::Tensor embedding, final_norm;
  int64_t heads, kv_heads, head_dim, page_size;
  double scale, eps, final_eps;
  bool gemma3;
  double embed_scale;
};

Stack make_stack(torch::Tensor embedding, const std::unordered_map<std::string, int64_t>& kernels,
                 const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& out_features,
                 const std::vector<torch::Tensor>& caches, int64_t tables_per_space, int64_t tables,
                 const std::vector<int64_t>& windows, const std::vector<int64_t>& layer_space, int64_t ropes,
                 const std::vector<int64_t>& layer_rope, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 int64_t page_size, double scale, double eps, torch::Tensor final_norm, double final_eps,
                 bool gemma3, double embed_scale) {
  const int64_t layers = static_cast<int64_t>(layer_space.size());
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
  const int64_t spaces = static_cast<int64_t>(windows.size());
  TORCH_CHECK(embedding.dim() == 2, "decode_layers: the embedding must be [vocab, hidden]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeights * layers &&
                  static_cast<int64_t>(out_features.size()) == 4 * layers &&
                  static_cast<int64_t>(caches.size()) == 2 * layers,
              "decode_layers: per-layer lists of ", layers, " layers do not match");
  TORCH_CHECK(tables == tables_per_space * spaces, "decode_layers: per-space lists of ", spaces,
              " spaces do not match");
  for (const int64_t sp : layer_space)
    TORCH_CHECK(sp >= 0 && sp < spaces, "decode_layers: a layer's block space ", sp, " is not one of ", spaces);
  const int64_t tables_of_rope = ropes / 2;
  TORCH_CHECK(ropes % 2 == 0 && static_cast<int64_t>(layer_rope.size()) == layers,
              "decode_layers: ropes (cos, sin per table) and layer_rope (one per layer) do not match");
  for (const int64_t r : layer_rope)
    TORCH_CHECK(r >= 0 && r < tables_of_rope, "decode_layers: a layer's RoPE table ", r, " is not one of ",
                tables_of_rope);
  return Stack{kernel<Linear>(kernels, "linear"),
               kernel<RmsNorm>(kernels, "rms_norm"),
               kernel<AddRmsNorm>(kernels, "add_rms_norm"),
               kernel<Rotary>(kernels, "rotary"),
               kernel<SiluAndMul>(kernels, "silu_and_mul"),
               kernel<PagedAttention>(kernels, "paged_attention"),
               kernel<WriteKv>(kernels, "write_kv"),
               weights, out_features, caches, windows, layer_space, layer_rope, embedding, final_norm,
               heads, kv_heads, head_dim, page_size, scale, eps, final_eps, gemma3, embed_scale};
}

void check_context_lens(const torch::Tensor& context_lens, int64_t T) {
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == T && context_lens.scalar_type() == at::kInt &&
                  context_lens.is_contiguous(),
              "decode_layers: context_lens must be [T] int32");
}

// One decode step: ids [T] through the embedding, every layer and the final norm. block_tables
// and slot_mappings: one per block space; ropes: (cos, sin) per RoPE table.
torch::Tensor forward(const Stack& s, const torch::Tensor& ids, const std::vector<torch::Tensor>& block_tables,
                      const std::vector<torch::Tensor>& slot_mappings, const torch::Tensor& context_lens,
                      const std::vector<torch::Tensor>& ropes) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "decode_layers: ids must be [T] int64");
  torch::Tensor hidden = at::embedding(s.embedding, ids);  // as nn.Embedding's forward
  // Gemma 3: times a 0-dim tensor of the scale in the dtype, as Gemma3ForCausalLM.forward does.
  if (s.gemma3) hidden = hidden * at::scalar_tensor(s.embed_scale, hidden.options());
  const int64_t T = hidden.size(0), heads = s.heads, kv_heads = s.kv_heads, head_dim = s.head_dim;
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const double eps = s.eps;
  const bool gemma3 = s.gemma3;
  // The decodes as query groups of one row, as AttentionMetadata.decode_groups builds them: group
  // i is row i of the block table, at position context_lens[i] - 1. (Four torch ops from Python
  // cost ~80 us a step after the weight stream; these loops cost nothing measurable.)
  check_context_lens(context_lens, T);
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
  const int64_t layers = static_cast<int64_t>(s.layer_space.size());
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = s.weights.data() + kWeights * l;
    const int64_t* n = s.out_features.data() + 4 * l;
    const torch::Tensor &k_cache = s.caches[2 * l], &v_cache = s.caches[2 * l + 1];
    const int64_t sp = s.layer_space[l];
    const torch::Tensor &cos = ropes[2 * s.layer_rope[l]], &sin = ropes[2 * s.layer_rope[l] + 1];
    torch::Tensor x;
    if (gemma3) {
      x = s.rms_norm(hidden, w[kInNorm], eps, true);
    } else if (l == 0) {
      residual = hidden;
      x = s.rms_norm(hidden, w[kInNorm], eps, false);
    } else {
      auto sum_norm = s.add_rms_norm(hidden, residual, w[kInNorm], eps, false);
      residual = sum_norm[0];
      x = sum_norm[1];
    }
    const auto qkv = s.linear(x, w[kQkv], bias_of(w[kQkvBias]), n[0]);
    const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, kv_heads, head_dim});
    torch::Tensor q, k;
    if (w[kQNorm].numel() == 0) {
      const auto qk = s.rotary(qkv.narrow(1, 0, q_size + kv_size).view({T, heads + kv_heads, head_dim}), cos, sin);
      q = qk.narrow(1, 0, heads);
      k = qk.narrow(1, heads, kv_heads);
    } else {
      q = s.rotary(s.rms_norm(qkv.narrow(1, 0, q_size).view({T, heads, head_dim}), w[kQNorm], eps, gemma3), cos,
                   sin);
      k = s.rotary(s.rms_norm(qkv.narrow(1, q_size, kv_size).view({T, kv_heads, head_dim}), w[kKNorm], eps, gemma3),
                   cos, sin);
    }
    s.write_kv(k_cache, v_cache, slot_mappings[sp], k, v);
    const auto o = s.paged_attention(q, k_cache, v_cache, block_tables[sp], group_start, group_row, positions,
                                     s.page_size, s.windows[sp], s.scale);
    const auto attn = s.linear(o.reshape({T, q_size}), w[kO], bias_of(w[kOBias]), n[1]);
    if (gemma3) {
      hidden = hidden + s.rms_norm(attn, w[kPostNorm], eps, true);
      const auto gate_up =
          s.linear(s.rms_norm(hidden, w[kPreFfNorm], eps, true), w[kGateUp], bias_of(w[kGateUpBias]), n[2]);
      const int64_t inter = n[2] / 2;  // as SiluAndMulMLP.forward: act(gate) * up of the split
      const auto act = at::gelu(gate_up.narrow(1, 0, inter), "tanh") * gate_up.narrow(1, inter, inter);
      hidden = hidden + s.rms_norm(s.linear(act, w[kDown], bias_of(w[kDownBias]), n[3]), w[kPostFfNorm], eps, true);
      continue;
    }
    auto sum_norm = s.add_rms_norm(attn, residual, w[kPostNorm], eps, false);
    residual = sum_norm[0];
    const auto gate_up = s.linear(sum_norm[1], w[kGateUp], bias_of(w[kGateUpBias]), n[2]);
    hidden = s.linear(s.silu_and_mul(gate_up), w[kDown], bias_of(w[kDownBias]), n[3]);
  }
  if (gemma3) return s.rms_norm(hidden, s.final_norm, s.final_eps, true);
  return s.add_rms_norm(hidden, residual, s.final_norm, s.final_eps, false)[1];
}

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
  const Stack s = make_stack(embedding, kernels, weights, out_features, caches, 2,
                             static_cast<int64_t>(tables.size()), windows, layer_space,
                             static_cast<int64_t>(ropes.size()), layer_rope, heads, kv_heads, head_dim, page_size,
                             scale, eps, final_norm, final_eps, gemma3, embed_scale);
  std::vector<torch::Tensor> block_tables, slot_mappings;
  for (size_t i = 0; i < tables.size(); i += 2) {
    block_tables.push_back(tables[i]);
    slot_mappings.push_back(tables[i + 1]);
  }
  return forward(s, ids, block_tables, slot_mappings, context_lens, ropes);
}

// `steps` greedy decode steps in one call (the engine's num_scheduler_steps): step j runs the
// stack above on ids_j, then the logits head (`linear` on head_weight, as the model's
// compute_logits, with Gemma's final softcap when softcap > 0) and `argmax_rows` (the sampler's
// greedy_tokens) give ids_{j+1}. Returns the
// sampled tokens [steps, T] (int64). What differs from decode_layers, per step j:
//   block_tables:  1 per block space, wide enough for the last step (the engine allocated the
//                  pages of every step before the call)
//   slot_mappings: 1 per block space, [steps, T] int64: row j is step j's
//   context_lens:  [T] int32 of step 0; step j's are those + j
//   ropes:         (cos, sin [steps * T, 1, D]) per RoPE table: rows j*T .. j*T+T-1 are step j's
// The Python loop this replaces runs ~1 ms a step on a cold cache after each weight stream
// (2-core Zen 4, the demo model); here a step is its kernels.
torch::Tensor decode_burst(int64_t steps, torch::Tensor ids, torch::Tensor embedding,
                           std::unordered_map<std::string, int64_t> kernels, std::vector<torch::Tensor> weights,
                           std::vector<int64_t> out_features, std::vector<torch::Tensor> caches,
                           std::vector<torch::Tensor> block_tables, std::vector<torch::Tensor> slot_mappings,
                           std::vector<int64_t> windows, std::vector<int64_t> layer_space, torch::Tensor context_lens,
                           std::vector<torch::Tensor> ropes, std::vector<int64_t> layer_rope, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t page_size, double scale, double eps,
                           torch::Tensor final_norm, double final_eps, bool gemma3, double embed_scale,
                           torch::Tensor head_weight, torch::Tensor head_bias, int64_t head_out, double softcap) {
  TORCH_CHECK(steps >= 1, "decode_burst: steps must be >= 1");
  const Stack s = make_stack(embedding, kernels, weights, out_features, caches, 1,
                             static_cast<int64_t>(block_tables.size()), windows, layer_space,
                             static_cast<int64_t>(ropes.size()), layer_rope, heads, kv_heads, head_dim, page_size,
                             scale, eps, final_norm, final_eps, gemma3, embed_scale);
  const auto argmax_rows = kernel<ArgmaxRows>(kernels, "argmax_rows");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "decode_burst: ids must be [T] int64");
  const int64_t T = ids.size(0);
  TORCH_CHECK(slot_mappings.size() == block_tables.size(), "decode_burst: one slot mapping per block table");
  for (const auto& sm : slot_mappings)
    TORCH_CHECK(sm.dim() == 2 && sm.size(0) == steps && sm.size(1) == T && sm.scalar_type() == at::kLong &&
                    sm.is_contiguous(),
                "decode_burst: slot mappings must be [steps, T] int64");
  for (const auto& r : ropes)
    TORCH_CHECK(r.dim() == 3 && r.size(0) == steps * T, "decode_burst: ropes must be [steps * T, 1, D]");
  check_context_lens(context_lens, T);
  auto tokens = torch::empty({steps, T}, ids.options());
  auto ctx = context_lens.clone();
  torch::Tensor step_ids = ids;
  std::vector<torch::Tensor> step_slots(slot_mappings.size()), step_ropes(ropes.size());
  for (int64_t j = 0; j < steps; ++j) {
    for (size_t i = 0; i < slot_mappings.size(); ++i) step_slots[i] = slot_mappings[i][j];
    for (size_t i = 0; i < ropes.size(); ++i) step_ropes[i] = ropes[i].narrow(0, j * T, T);
    if (j > 0) {
      int32_t* c = ctx.data_ptr<int32_t>();
      for (int64_t i = 0; i < T; ++i) c[i] += 1;
    }
    const auto hidden = forward(s, step_ids, block_tables, step_slots, ctx, step_ropes);
    auto logits = s.linear(hidden, head_weight, bias_of(head_bias), head_out);
    if (softcap > 0) logits = at::tanh(logits / softcap) * softcap;  // as Gemma3ForCausalLM.compute_logits
    const auto next = argmax_rows(logits);
    tokens[j].copy_(next);
    step_ids = next;
  }
  return tokens;
}
