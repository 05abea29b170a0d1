// The whole Llama decoder stack for a decode-sized batch (a few tokens) in one native call.
//
// At decode sizes the weights stream at memory bandwidth in a few milliseconds, and the ~15
// small tensor ops per layer that surround them cost about as much again when each is a
// Python-level call. `DecodeStack` holds every layer's weights once and runs the layers in C++
// with the same kernels the Python path uses (skinny_linear, paged_attention, add_rms_norm);
// tests/test_kernels.py checks it against the Python forward. The EAGLE draft head's one layer
// runs through it too (no input norm, no final norm: empty weights). With `set_aux(layers)` the
// output is [final ; the residual stream after each of those layers] side by side (the features a
// fused-feature draft head reads).
#include <torch/extension.h>
#include <immintrin.h>

#include "attention.h"
#include "simd.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool float_out);
torch::Tensor skinny_linear_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                                bool float_out, const torch::Tensor* into);
void add_rms_norm_into(const torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                       const torch::Tensor& out);
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_gather,
                              torch::Tensor kv_lens, torch::Tensor q_seq, torch::Tensor q_row, torch::Tensor mask,
                              double scale);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor rms_norm_chunks(torch::Tensor x, int64_t n, double eps);
std::vector<torch::Tensor> topk_log_softmax(torch::Tensor x, int64_t k, torch::Tensor d2t);
int64_t int8_in_features(const torch::Tensor& wq);
int64_t gguf_in_features(const torch::Tensor& w);
extern const int64_t STREAM_NTA_BYTES;
extern thread_local bool stream_nta;
std::vector<torch::Tensor> build_batch(const std::vector<std::vector<int64_t>>& tokens,
                                       const std::vector<int64_t>& num_cached,
                                       const std::vector<std::vector<int64_t>>& tables,
                                       const std::vector<std::vector<int64_t>>& positions,
                                       const std::vector<c10::optional<torch::Tensor>>& masks,
                                       const std::vector<int64_t>& masked_cached, int64_t bs);

namespace {

using namespace eagle_simd;

// Rotate-half RoPE in place on the first `heads` heads of each row of qkv [T, *]; cos, sin [T, D].
template <typename T>
void rope_inplace(T* qkv, int64_t rows, int64_t row_stride, int64_t heads, int64_t D, const float* cos,
                  const float* sin) {
  const int64_t half = D / 2;
  constexpr bool vec = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = qkv + t * row_stride + h * D;
      int64_t i = 0;
      if constexpr (vec) {  // 16 lanes at a time (the scalar loop's cost grew with every row a tree adds)
        for (; i + VL <= half; i += VL) {
          const vf x1 = load16(v + i), x2 = load16(v + i + half);
          store16(v + i, vsub(vmul(x1, load16(c + i)), vmul(x2, load16(s + i))));
          store16(v + i + half, vadd(vmul(x2, load16(c + i + half)), vmul(x1, load16(s + i + half))));
        }
      }
      for (; i < half; ++i) {
        const float x1 = static_cast<float>(v[i]), x2 = static_cast<float>(v[i + half]);
        v[i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
        v[i + half] = static_cast<T>(x2 * c[i + half] + x1 * s[i + half]);
      }
    }
  }
}

// out = silu(gate) * up, float32 math; float32 / bfloat16 16 lanes at a time (the scalar loop
// with std::exp cost about as much as the attention at one token and grew with every row a
// tree adds).
template <typename T>
void silu_mul(const T* gu, T* out, int64_t rows, int64_t inter) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* g = gu + t * 2 * inter;
    const T* u = g + inter;
    T* o = out + t * inter;
    int64_t i = 0;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
      for (; i + VL <= inter; i += VL) {
        const vf gv = load16(g + i);
        const vf e = exp_ps(vsub(vzero(), gv));
        store16(o + i, vmul(vdiv(gv, vadd(vset1(1.f), e)), load16(u + i)));
      }
    }
    for (; i < inter; ++i) {
      const float gf = static_cast<float>(g[i]), uf = static_cast<float>(u[i]);
      o[i] = static_cast<T>(gf / (1.f + std::exp(-gf)) * uf);
    }
  }
}

// dst[t * stride + i] = a[t, i] + b[t, i] for rows t < T of width n, rounded to T once (as ATen's
// `a + b` rounds: the sum in float32, then to the dtype)
template <typename T>
void add_rows_into(const T* a, const T* b, T* dst, int64_t stride, int64_t rows, int64_t n) {
  constexpr bool vec = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
  using acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  using namespace eagle_simd;
  for (int64_t t = 0; t < rows; ++t) {
    const T *ar = a + t * n, *br = b + t * n;
    T* o = dst + t * stride;
    int64_t i = 0;
    if constexpr (vec)
      for (; i + VL <= n; i += VL) store16(o + i, vadd(load16(ar + i), load16(br + i)));
    for (; i < n; ++i) o[i] = static_cast<T>(static_cast<acc>(ar[i]) + static_cast<acc>(br[i]));
  }
}

// A linear's inputs from the weight the native kernels read: [N, K], pack_bf16's [N/32, K/2, 64]
// or pack_int8's (either layout), or a packed GGUF weight (uint8, one dimension)
int64_t in_features(const torch::Tensor& w) {
  if (w.dim() == 1 && w.scalar_type() == at::kByte) return gguf_in_features(w);
  if (w.dim() != 3) return w.size(1);
  return w.scalar_type() == at::kChar ? int8_in_features(w) : w.size(1) * 2;
}

c10::optional<torch::Tensor> opt(const torch::Tensor& t) {
  return t.defined() && t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

}  // namespace

struct DecodeStack {
  std::vector<torch::Tensor> in_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down;
  // a draft head's int8 weights (pack_int8; an undefined tensor: that linear keeps the above),
  // for calls of up to int8_rows rows (set_int8)
  std::vector<torch::Tensor> qkv8, o8, gate_up8, down8;
  int64_t int8_rows = 0;
  torch::Tensor final_norm;
  std::vector<int64_t> aux_layers;
  int64_t heads, kv_heads, head_dim, inter;
  double eps, scale;

  DecodeStack(std::vector<torch::Tensor> in_norm, std::vector<torch::Tensor> qkv, std::vector<torch::Tensor> qkv_bias,
              std::vector<torch::Tensor> o, std::vector<torch::Tensor> o_bias, std::vector<torch::Tensor> post_norm,
              std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down, torch::Tensor final_norm,
              int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : in_norm(in_norm), qkv(qkv), qkv_bias(qkv_bias), o(o), o_bias(o_bias), post_norm(post_norm),
        gate_up(gate_up), down(down), final_norm(final_norm), heads(heads), kv_heads(kv_heads),
        head_dim(head_dim), inter(in_features(down[0])), eps(eps),
        scale(scale) {
    for (const auto* ws : {&qkv, &o, &gate_up, &down})
      for (const auto& w : *ws) weight_bytes += w.numel() * w.element_size();
  }
  int64_t weight_bytes = 0;  // its linears' weights: past STREAM_NTA_BYTES they stream non-temporally

  // h: [T, hidden] embeddings; kv: [layers, 2, S, Hkv, D]; cos/sin: [T, D] float32.
  torch::Tensor forward(torch::Tensor h, torch::Tensor kv, torch::Tensor slot_mapping, torch::Tensor kv_gather,
                        torch::Tensor kv_lens, torch::Tensor q_seq, torch::Tensor q_row, torch::Tensor mask,
                        torch::Tensor cos, torch::Tensor sin) {
    const int64_t T = h.size(0), D = head_dim, q_size = heads * D, kv_size = kv_heads * D;
    const bool int8 = int8_rows > 0 && T <= int8_rows;  // (int8_rows > 0: set_int8 filled the lists)
    auto pick = [&](const std::vector<torch::Tensor>& w, const std::vector<torch::Tensor>& w8, size_t l) -> const torch::Tensor& {
      return int8 && w8[l].defined() ? w8[l] : w[l];
    };
    struct Streaming {  // the linears below see stream_nta; the previous value comes back however forward ends
      bool before = stream_nta;
      explicit Streaming(bool on) { stream_nta = on; }
      ~Streaming() { stream_nta = before; }
    } streaming(weight_bytes > STREAM_NTA_BYTES);
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && kv.is_contiguous() && kv.dim() == 5 && kv.size(0) == qkv.size() &&
                kv.size(3) == kv_heads && kv.size(4) == D && kv.scalar_type() == h.scalar_type(),
                "forward: h [T, hidden], kv [layers, 2, S, kv_heads, head_dim] contiguous, one dtype");
    TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T,
                "forward: slot_mapping [T] int64");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T && sin.size(0) == T, "forward: cos, sin [T, D]");
    const int64_t S = kv.size(2), slot_elems = kv_size, layer_elems = 2 * S * kv_size;
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < S, "forward: slot out of range");
    // which keys each row sees, planned once for every layer; the buffers every layer reuses
    // (one allocation each a forward, not a dozen tensor ops a layer: select, narrow, reshape,
    // index_copy_, contiguous and their outputs, which ran on the calling thread while the other waited)
    AttentionPlan plan;
    plan_attention(plan, kv_gather, kv_lens, q_seq, q_row, mask, T, kv_heads);
    const auto opts = h.options();
    torch::Tensor residual = h.clone();
    torch::Tensor delta = torch::zeros_like(h);
    torch::Tensor xn = torch::empty_like(h);
    torch::Tensor fused = torch::empty({T, q_size + 2 * kv_size}, opts);
    torch::Tensor q = torch::empty({T, q_size}, opts);
    torch::Tensor attn = torch::empty({T, q_size}, opts);
    torch::Tensor gu = torch::empty({T, 2 * inter}, opts);
    torch::Tensor act = torch::empty({T, inter}, opts);
    const int64_t esize = h.element_size(), fw = q_size + 2 * kv_size;
    char* kvp = static_cast<char*>(kv.data_ptr());
    // with aux layers the output is [T, (1 + n) hidden], [final feature ; each aux layer's
    // output], written in place: after the target's weight stream every ATen op (an add per aux
    // layer, a cat) ran cold, tens of us each in a round that no head drafts in
    const int64_t H = h.size(1), W = (1 + static_cast<int64_t>(aux_layers.size())) * H;
    torch::Tensor wide = aux_layers.empty() ? torch::Tensor() : torch::empty({T, W}, opts);
    for (size_t l = 0; l < qkv.size(); ++l) {
      // delta is 0 for layer 0; an empty norm weight means no input norm (the EAGLE head's layer)
      const torch::Tensor* x = &xn;
      if (in_norm[l].numel()) add_rms_norm_into(residual, delta, in_norm[l], eps, xn);
      else { residual.add_(delta); x = &residual; }
      skinny_linear_into(*x, pick(qkv, qkv8, l), opt(qkv_bias[l]), false, &fused);  // [T, q + 2 kv]
      AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "rope", [&] {
        rope_inplace<scalar_t>(fused.data_ptr<scalar_t>(), T, fw, heads + kv_heads, D,
                               cos.data_ptr<float>(), sin.data_ptr<float>());
      });
      // the rows' K and V into their cache slots, their queries side by side
      char* k_cache = kvp + l * layer_elems * esize;
      char* v_cache = k_cache + S * kv_size * esize;
      const char* fp = static_cast<const char*>(fused.data_ptr());
      char* qp = static_cast<char*>(q.data_ptr());
      for (int64_t t = 0; t < T; ++t) {
        const char* row = fp + t * fw * esize;
        std::memcpy(qp + t * q_size * esize, row, q_size * esize);
        std::memcpy(k_cache + slots[t] * slot_elems * esize, row + q_size * esize, kv_size * esize);
        std::memcpy(v_cache + slots[t] * slot_elems * esize, row + (q_size + kv_size) * esize, kv_size * esize);
      }
      attend_planned(plan, h.scalar_type(), q.data_ptr(), k_cache, v_cache, attn.data_ptr(), heads, D, scale);
      skinny_linear_into(attn, pick(o, o8, l), opt(o_bias[l]), false, &delta);
      add_rms_norm_into(residual, delta, post_norm[l], eps, xn);
      skinny_linear_into(xn, pick(gate_up, gate_up8, l), c10::nullopt, false, &gu);
      AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "silu_mul", [&] {
        silu_mul<scalar_t>(gu.data_ptr<scalar_t>(), act.data_ptr<scalar_t>(), T, inter);
      });
      skinny_linear_into(act, pick(down, down8, l), c10::nullopt, false, &delta);
      for (size_t j = 0; j < aux_layers.size(); ++j)
        if (aux_layers[j] == static_cast<int64_t>(l)) {  // the layer's output, delta + residual
          AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "aux", [&] {
            add_rows_into<scalar_t>(delta.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                    wide.data_ptr<scalar_t>() + (1 + j) * H, W, T, H);
          });
        }
    }
    // an empty final norm weight: the stack's raw output h + residual (the EAGLE head's feature)
    if (aux_layers.empty())
      return final_norm.numel() ? add_rms_norm(residual, delta, final_norm, eps) : residual.add_(delta);
    torch::Tensor out = xn;
    if (final_norm.numel()) add_rms_norm_into(residual, delta, final_norm, eps, xn);
    else out = residual.add_(delta);
    const char* op = static_cast<const char*>(out.data_ptr());
    char* wp = static_cast<char*>(wide.data_ptr());
    for (int64_t t = 0; t < T; ++t) std::memcpy(wp + t * W * esize, op + t * H * esize, H * esize);
    return wide;
  }

  // One EAGLE draft level in one call, for a stack built from a draft head's layer: the head's
  // input [embed_w[ids] ; f] with f = feats' first h columns (+ fc_aux(rms-normalised aux
  // chunks) where feats carry n_aux fused layers), x = fc(input), the stack's forward, then the
  // draft LM head's float32 logits of `top_rows` (empty: every row) and their k best
  // log-softmax values with their indices (mapped through d2t where given). The same kernels and
  // ATen ops as the Python path (EagleHead.forward, draft_topk), one dispatch instead of ~15.
  // Weights as skinny_linear takes them (the caller picks int8 or bf16 by row count). Returns
  // {hidden [T, h], its top rows [R, h], values [R, k] float32, indices [R, k] int64}.
  std::vector<torch::Tensor> head_level(torch::Tensor ids, torch::Tensor feats, torch::Tensor embed_w, torch::Tensor fc_w,
                                        torch::Tensor fc_b, torch::Tensor fc_aux_w, int64_t n_aux, torch::Tensor lm_w,
                                        torch::Tensor d2t, torch::Tensor top_rows, int64_t k, torch::Tensor kv,
                                        torch::Tensor slot_mapping, torch::Tensor kv_gather, torch::Tensor kv_lens,
                                        torch::Tensor q_seq, torch::Tensor q_row, torch::Tensor mask,
                                        torch::Tensor cos_table, torch::Tensor sin_table, torch::Tensor positions) {
    const int64_t h = embed_w.size(1);
    TORCH_CHECK(feats.dim() == 2 && feats.size(0) == ids.size(0) && feats.size(1) == h * (1 + n_aux),
                "head_level: feats [T, (1 + n_aux) h]");
    torch::Tensor f = feats.narrow(1, 0, h);
    if (n_aux > 0)
      f = f + skinny_linear(rms_norm_chunks(feats.narrow(1, h, n_aux * h).contiguous(), n_aux, eps), fc_aux_w,
                            c10::nullopt, false);
    // [embed_w[ids] ; f] row by row (index_select and cat: two more ATen ops and a copy a level)
    const int64_t T = ids.size(0), es = f.element_size();
    TORCH_CHECK(ids.is_contiguous() && ids.scalar_type() == at::kLong && embed_w.is_contiguous() &&
                embed_w.scalar_type() == f.scalar_type() && f.stride(1) == 1, "head_level: ids, embed_w, feats");
    torch::Tensor in = torch::empty({T, 2 * h}, f.options());
    const int64_t* idp = ids.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(idp[t] >= 0 && idp[t] < embed_w.size(0), "head_level: token id out of range");
      char* dst = static_cast<char*>(in.data_ptr()) + t * 2 * h * es;
      std::memcpy(dst, static_cast<const char*>(embed_w.data_ptr()) + idp[t] * h * es, h * es);
      std::memcpy(dst + h * es, static_cast<const char*>(f.data_ptr()) + t * f.stride(0) * es, h * es);
    }
    torch::Tensor x = skinny_linear(in, fc_w, opt(fc_b), false);
    torch::Tensor hidden = forward(x, kv, slot_mapping, kv_gather, kv_lens, q_seq, q_row, mask,
                                   cos_table.index_select(0, positions), sin_table.index_select(0, positions));
    torch::Tensor rows = top_rows.numel() ? hidden.index_select(0, top_rows) : hidden;
    torch::Tensor logits = skinny_linear(rows.contiguous(), lm_w, c10::nullopt, true);
    auto top = topk_log_softmax(logits, std::min<int64_t>(k, logits.size(1)), d2t);
    return {hidden, rows, top[0], top[1]};
  }

  // A whole EAGLE-2 draft tree in one call: EagleDrafter.propose's dynamic path (its first
  // level, then its _grow per depth), the same kernels and ATen ops per level as head_level
  // from Python, so the same numbers, and the same candidate bookkeeping (scores summed in
  // double, as Python floats; frontiers the top_k new candidates by (-score, index)). Per
  // sequence b: pending[b] its pending pairs' tokens (>= 1), draft_len[b] its committed pairs,
  // tables[b] its block table, max_depth[b] >= 1; feats: the pending pairs' target features,
  // stacked in that order ([f ; aux] with n_aux fused layers). Weights: w[i] (i = fc, fc_aux,
  // lm) as Linear.native_weight, w8[i] its int8 weights or an empty tensor, taken for calls of
  // up to rows8[i] rows (Linear.native_for); the caller checks the native path takes every
  // row count a level can have. Returns {tokens, parents, scores (float64), depths, counts}:
  // every candidate of every sequence, sequence after sequence (counts[b] each), in the
  // Python path's order. The draft KV of each level is written as that path writes it.
  std::vector<torch::Tensor> draft_tree(const std::vector<std::vector<int64_t>>& pending,
                                        const std::vector<int64_t>& draft_len,
                                        const std::vector<std::vector<int64_t>>& tables,
                                        const std::vector<int64_t>& max_depth, torch::Tensor feats, int64_t n_aux,
                                        torch::Tensor embed_w, std::vector<torch::Tensor> w,
                                        std::vector<torch::Tensor> w8, std::vector<int64_t> rows8, torch::Tensor fc_b,
                                        torch::Tensor d2t, int64_t width, int64_t top_k, int64_t block_size,
                                        torch::Tensor kv, torch::Tensor cos_table, torch::Tensor sin_table) {
    const int64_t B = static_cast<int64_t>(pending.size());
    TORCH_CHECK(B > 0 && draft_len.size() == pending.size() && tables.size() == pending.size() &&
                max_depth.size() == pending.size() && w.size() == 3 && w8.size() == 3 && rows8.size() == 3 &&
                width >= 1 && top_k >= 1, "draft_tree: one entry per sequence, three weights");
    auto pick = [&](int i, int64_t rows) -> torch::Tensor {
      return w8[i].defined() && w8[i].numel() && rows <= rows8[i] ? w8[i] : w[i];
    };
    auto run_level = [&](const std::vector<std::vector<int64_t>>& toks, const std::vector<int64_t>& cached,
                         const std::vector<std::vector<int64_t>>& tabs, const std::vector<std::vector<int64_t>>& pos,
                         const std::vector<c10::optional<torch::Tensor>>& masks, const std::vector<int64_t>& mcached,
                         const torch::Tensor& f, int64_t aux, const torch::Tensor& top_rows) {
      auto bt = build_batch(toks, cached, tabs, pos, masks, mcached, block_size);
      const int64_t nb = static_cast<int64_t>(toks.size()), T = bt[0].size(0);
      const int64_t R = top_rows.numel() ? top_rows.size(0) : T;
      torch::Tensor mask = bt[4].defined() ? bt[4].view({nb, bt[4].size(2), bt[4].size(3)})
                                           : torch::empty({0}, torch::TensorOptions().dtype(at::kBool));
      return head_level(bt[0], f, embed_w, pick(0, T), fc_b, aux ? pick(1, T) : torch::empty({0}), aux, pick(2, R), d2t,
                        top_rows, width, kv, bt[2], bt[3].view({nb, -1}), bt[6], bt[7], bt[8], mask, cos_table,
                        sin_table, bt[1]);
    };
    const torch::Tensor all_rows = torch::empty({0}, torch::TensorOptions().dtype(at::kLong));  // top_rows: every row
    // the first level: every pending pair, the last one's row ranks the root's children
    std::vector<int64_t> ends(B), base(B), none_cached(B, 0);
    std::vector<std::vector<int64_t>> no_pos(B);
    std::vector<c10::optional<torch::Tensor>> no_mask(B);
    for (int64_t b = 0, end = 0; b < B; ++b) {
      TORCH_CHECK(!pending[b].empty() && max_depth[b] >= 1, "draft_tree: pending pairs and a depth per sequence");
      end += static_cast<int64_t>(pending[b].size());
      ends[b] = end - 1;
      base[b] = draft_len[b] + static_cast<int64_t>(pending[b].size());
    }
    auto lv = run_level(pending, draft_len, tables, no_pos, no_mask, none_cached, feats, n_aux,
                        torch::tensor(ends, torch::TensorOptions().dtype(at::kLong)));
    struct Grow {
      std::vector<int64_t> tokens, parents, depths, frontier, scratch;
      std::vector<double> scores;
      torch::Tensor frontier_feats;
    };
    std::vector<Grow> g(B);
    // the k best of `cands` by (-score, index), in index order (EagleDrafter._next_frontier);
    // a NaN score sorts as -inf (Python's sort is undefined there; this one stays well-defined)
    auto next_frontier = [&](const Grow& gr, std::vector<int64_t> cands) {
      auto key = [&](int64_t c) { const double s = gr.scores[c]; return std::isnan(s) ? -INFINITY : s; };
      std::sort(cands.begin(), cands.end(), [&](int64_t a, int64_t b2) {
        const double x = key(a), y = key(b2);
        return x != y ? x > y : a < b2;
      });
      if (static_cast<int64_t>(cands.size()) > top_k) cands.resize(top_k);
      std::sort(cands.begin(), cands.end());
      return cands;
    };
    // a level's top-k of row `row` as children of candidate `parent` (-1: the root) at `depth`;
    // returns the new candidates' indices
    auto expand = [&](Grow& gr, int64_t parent, int64_t depth, const float* vp, const int64_t* ip, int64_t row) {
      std::vector<int64_t> added;
      for (int64_t r = 0; r < width; ++r) {
        added.push_back(static_cast<int64_t>(gr.tokens.size()));
        gr.tokens.push_back(ip[row * width + r]);
        gr.parents.push_back(parent);
        const double v = vp[row * width + r];  // (float to double: exact)
        gr.scores.push_back(parent < 0 ? v : gr.scores[parent] + v);
        gr.depths.push_back(depth);
      }
      return added;
    };
    {
      const torch::Tensor values = lv[2].contiguous(), idx = lv[3].contiguous();
      TORCH_CHECK(values.size(1) == width, "draft_tree: the draft vocabulary has fewer tokens than width");
      for (int64_t b = 0; b < B; ++b) {
        Grow& gr = g[b];
        gr.frontier = next_frontier(gr, expand(gr, -1, 1, values.data_ptr<float>(), idx.data_ptr<int64_t>(), b));
        gr.frontier_feats = lv[1].narrow(0, b, 1).expand({static_cast<int64_t>(gr.frontier.size()), -1});
      }
    }
    int64_t deepest = *std::max_element(max_depth.begin(), max_depth.end());
    for (int64_t depth = 2; depth <= deepest; ++depth) {
      std::vector<int64_t> todo;
      for (int64_t b = 0; b < B; ++b)
        if (max_depth[b] >= depth && !g[b].frontier.empty()) todo.push_back(b);
      if (todo.empty()) continue;
      const size_t n = todo.size();
      std::vector<std::vector<int64_t>> toks(n), tabs(n), pos(n);
      std::vector<int64_t> cached(n), mcached(n);
      std::vector<c10::optional<torch::Tensor>> masks(n);
      std::vector<torch::Tensor> fs(n);
      for (size_t j = 0; j < n; ++j) {
        const Grow& gr = g[todo[j]];
        const int64_t F = static_cast<int64_t>(gr.frontier.size()), prev = static_cast<int64_t>(gr.scratch.size());
        for (int64_t c : gr.frontier) toks[j].push_back(gr.tokens[c]);
        tabs[j] = tables[todo[j]];
        pos[j].assign(F, base[todo[j]] + depth - 2);
        cached[j] = base[todo[j]] + prev;
        mcached[j] = prev;
        // frontier node i sees the scratch pairs that are its ancestors, and itself (EagleDrafter._mask)
        torch::Tensor m = torch::zeros({F, prev + F}, torch::TensorOptions().dtype(at::kBool));
        bool* mp = m.data_ptr<bool>();
        for (int64_t i = 0; i < F; ++i) {
          for (int64_t c = gr.frontier[i]; c >= 0; c = gr.parents[c]) {
            for (int64_t k = 0; k < prev; ++k)
              if (gr.scratch[k] == c) mp[i * (prev + F) + k] = true;
          }
          mp[i * (prev + F) + prev + i] = true;
        }
        masks[j] = m;
        fs[j] = gr.frontier_feats;
      }
      auto out = run_level(toks, cached, tabs, pos, masks, mcached, torch::cat(fs), 0, all_rows);
      const torch::Tensor values = out[2].contiguous(), idx = out[3].contiguous();
      int64_t row = 0;
      for (size_t j = 0; j < n; ++j) {
        Grow& gr = g[todo[j]];
        const std::vector<int64_t> expanded = gr.frontier;
        const int64_t first_row = row;
        std::vector<int64_t> added;
        gr.scratch.insert(gr.scratch.end(), expanded.begin(), expanded.end());
        for (int64_t c : expanded) {
          const auto kids = expand(gr, c, depth, values.data_ptr<float>(), idx.data_ptr<int64_t>(), row++);
          added.insert(added.end(), kids.begin(), kids.end());
        }
        gr.frontier = depth < max_depth[todo[j]] ? next_frontier(gr, added) : std::vector<int64_t>();
        std::vector<int64_t> parent_rows;
        for (int64_t c : gr.frontier) {
          const int64_t p = gr.parents[c];
          parent_rows.push_back(first_row + (std::find(expanded.begin(), expanded.end(), p) - expanded.begin()));
        }
        gr.frontier_feats = out[0].index_select(0, torch::tensor(parent_rows, torch::TensorOptions().dtype(at::kLong)));
      }
    }
    std::vector<int64_t> tokens, parents, depths, counts(B);
    std::vector<double> scores;
    for (int64_t b = 0; b < B; ++b) {
      const Grow& gr = g[b];
      tokens.insert(tokens.end(), gr.tokens.begin(), gr.tokens.end());
      parents.insert(parents.end(), gr.parents.begin(), gr.parents.end());
      depths.insert(depths.end(), gr.depths.begin(), gr.depths.end());
      scores.insert(scores.end(), gr.scores.begin(), gr.scores.end());
      counts[b] = static_cast<int64_t>(gr.tokens.size());
    }
    const auto i64 = torch::TensorOptions().dtype(at::kLong);
    return {torch::tensor(tokens, i64), torch::tensor(parents, i64),
            torch::tensor(scores, torch::TensorOptions().dtype(at::kDouble)), torch::tensor(depths, i64),
            torch::tensor(counts, i64)};
  }

  // Int8 weights per linear (each list one per layer; an undefined or empty tensor: none) for
  // calls of up to max_rows rows; more rows keep the weights the stack was built with.
  void set_int8(std::vector<torch::Tensor> q, std::vector<torch::Tensor> o_, std::vector<torch::Tensor> gu,
                std::vector<torch::Tensor> d, int64_t max_rows) {
    for (const auto* ws : {&q, &o_, &gu, &d}) {
      TORCH_CHECK(ws->size() == qkv.size(), "set_int8: one weight per layer");
      for (const auto& w : *ws)
        TORCH_CHECK(!w.defined() || !w.numel() || (w.dim() == 3 && w.scalar_type() == at::kChar), "set_int8: pack_int8 weights");
    }
    auto keep = [](std::vector<torch::Tensor> ws) {
      for (auto& w : ws) if (w.defined() && !w.numel()) w = torch::Tensor();
      return ws;
    };
    qkv8 = keep(q), o8 = keep(o_), gate_up8 = keep(gu), down8 = keep(d);
    int8_rows = max_rows;
  }

  void set_aux(std::vector<int64_t> layers) {
    for (int64_t l : layers) TORCH_CHECK(l >= 0 && l < static_cast<int64_t>(qkv.size()), "aux layer out of range");
    aux_layers = layers;
  }
};

// engine.forward_batch.build_forward_batch's index tensors for a packed forward, built here
// rather than by ~20 numpy / torch calls, about a third of their time (3 builds a speculative round). Per span b: tokens, num_cached c_b, block table, positions (empty: c_b + i), tree mask
// [n_b, m_b + n_b] (undefined: causal) over its last m_b cached keys and new ones. Returns
// input_ids, positions, slot_mapping, kv_gather [B * L], attn_mask [B, 1, Q, L] (undefined where
// B = 1, Q = 1 and no tree mask: every key), q_index (undefined where B = 1), kv_lens, q_seq,
// q_row, with the numpy builder's semantics (tests/test_forward_batch.py compares the two).
std::vector<torch::Tensor> build_batch(const std::vector<std::vector<int64_t>>& tokens,
                                       const std::vector<int64_t>& num_cached,
                                       const std::vector<std::vector<int64_t>>& tables,
                                       const std::vector<std::vector<int64_t>>& positions,
                                       const std::vector<c10::optional<torch::Tensor>>& masks,
                                       const std::vector<int64_t>& masked_cached, int64_t bs) {
  const int64_t B = static_cast<int64_t>(tokens.size());
  TORCH_CHECK(B > 0 && num_cached.size() == tokens.size() && tables.size() == tokens.size() &&
              positions.size() == tokens.size() && masks.size() == tokens.size() &&
              masked_cached.size() == tokens.size() && bs > 0, "build_batch: one entry per span");
  std::vector<int64_t> n(B), len(B);
  int64_t T = 0, Q = 0, L = 0;
  for (int64_t b = 0; b < B; ++b) {
    n[b] = static_cast<int64_t>(tokens[b].size());
    len[b] = num_cached[b] + n[b];
    TORCH_CHECK(len[b] <= static_cast<int64_t>(tables[b].size()) * bs, "a span writes past its block table");
    TORCH_CHECK(positions[b].empty() || static_cast<int64_t>(positions[b].size()) == n[b], "positions");
    T += n[b];
    Q = std::max(Q, n[b]);
    L = std::max(L, len[b]);
  }
  const auto i64 = torch::TensorOptions().dtype(at::kLong);
  auto ids = torch::empty({T}, i64), pos = torch::empty({T}, i64), slots = torch::empty({T}, i64);
  auto gather = torch::zeros({B * L}, i64), lens = torch::empty({B}, i64);
  auto q_seq = torch::empty({T}, i64), q_row = torch::empty({T}, i64);
  int64_t *ip = ids.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>(), *sp = slots.data_ptr<int64_t>();
  int64_t *gp = gather.data_ptr<int64_t>(), *qs = q_seq.data_ptr<int64_t>(), *qr = q_row.data_ptr<int64_t>();
  bool any_tree = false;
  for (int64_t b = 0, t = 0; b < B; ++b) {
    const auto& tb = tables[b];
    int64_t* g = gp + b * L;
    for (int64_t p = 0; p < len[b]; ++p) g[p] = tb[p / bs] * bs + p % bs;
    lens.data_ptr<int64_t>()[b] = len[b];
    for (int64_t i = 0; i < n[b]; ++i, ++t) {
      ip[t] = tokens[b][i];
      pp[t] = positions[b].empty() ? num_cached[b] + i : positions[b][i];
      sp[t] = g[num_cached[b] + i];
      qs[t] = b;
      qr[t] = i;
    }
    any_tree = any_tree || masks[b].has_value();
  }
  torch::Tensor mask, q_index;
  if (B > 1 || Q > 1 || any_tree) {
    mask = torch::zeros({B, 1, Q, L}, torch::TensorOptions().dtype(at::kBool));
    bool* mp = mask.data_ptr<bool>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t c = num_cached[b];
      for (int64_t i = 0; i < Q; ++i) {
        bool* row = mp + (b * Q + i) * L;
        if (i >= n[b]) {  // a padded query row sees key 0 only, so its softmax stays finite
          row[0] = true;
          continue;
        }
        std::fill(row, row + std::min(c + i + 1, len[b]), true);  // committed keys, then causal
      }
      if (masks[b]) {
        const torch::Tensor tm = masks[b]->to(at::kBool).contiguous();
        const int64_t m = masked_cached[b];
        TORCH_CHECK(tm.dim() == 2 && tm.size(0) == n[b] && tm.size(1) == m + n[b] && m <= c, "tree mask shape");
        const bool* tp = tm.data_ptr<bool>();
        for (int64_t i = 0; i < n[b]; ++i) std::copy(tp + i * (m + n[b]), tp + (i + 1) * (m + n[b]), mp + (b * Q + i) * L + c - m);
      }
    }
  }
  if (B > 1) {
    q_index = torch::empty({T}, i64);
    int64_t* qi = q_index.data_ptr<int64_t>();
    for (int64_t b = 0, t = 0; b < B; ++b)
      for (int64_t i = 0; i < n[b]; ++i) qi[t++] = b * Q + i;
  }
  return {ids, pos, slots, gather, mask, q_index, lens, q_seq, q_row};
}

void register_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, torch::Tensor, int64_t, int64_t,
                          int64_t, double, double>())
      .def("forward", &DecodeStack::forward)
      .def("set_aux", &DecodeStack::set_aux)
      .def("set_int8", &DecodeStack::set_int8)
      .def("head_level", &DecodeStack::head_level)
      .def("draft_tree", &DecodeStack::draft_tree);
  m.def("build_batch", &build_batch, "a packed forward's index tensors (engine.forward_batch)");
}
