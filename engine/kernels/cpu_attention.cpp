// Paged attention for few queries per sequence (decode and tree verification) on the CPU.
//
// Every query (token t, head h) walks its sequence's keys straight through the block-table
// slots (no gathered copy), with an online softmax in float32: one pass over K and V.
// Shapes: q [T, H, D]; k_cache, v_cache [S, Hkv, D]; kv_gather [B, L] slots; kv_lens [B];
// q_seq [T] sequence of each query; q_row [T] its row in the mask; mask [B, Q, L] bool or
// empty (then every key < kv_len is visible). Output [T, H * D] in q's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace {

using eagle_simd::load16;

// e^x for x <= 0 (an online softmax's x - max): eagle_simd::exp_ps, whose upper clamp never
// applies here; below ~-104 it flushes to 0 as e^x does in float32.
inline __m512 exp_nonpos(__m512 x) { return eagle_simd::exp_ps(x); }

constexpr int KEY_BLOCK = 16;

// GB query heads that share one KV head (GQA), one query row, over the sequence's keys. Each
// head is an online softmax in float32. The visible keys, in order, go in blocks of KEY_BLOCK:
// every key's K (and then V) is converted to float32 once for the GB heads, its scores are
// independent dot products, each head updates its running max and rescales once per block and
// takes the block's exps in one vector. Blocks are cut from the visible keys only, so a head's
// arithmetic depends on which keys it sees, not on the masked ones around them or on the other
// heads: a tree node computes what a plain step over the same keys computes.
// NV = D / 16 at compile time (registers); NV = 0: D at run time, any multiple of 16 up to 256.
template <typename T, int NV, int GB>
void attend_group(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, const bool* mask,
                  int64_t L, int64_t stride, int64_t D, float scale, float* out) {
  constexpr int NVA = NV > 0 ? NV : 16;
  const int nv = NV > 0 ? NV : static_cast<int>(D / 16);
  __m512 qv[GB][NVA], acc[GB][NVA], kv[NVA];
  float m[GB], denom[GB];
  alignas(64) float sc[GB][KEY_BLOCK];
  alignas(64) float pr[GB][KEY_BLOCK];
  int64_t vis[KEY_BLOCK];
  for (int g = 0; g < GB; ++g) {
    m[g] = -INFINITY;
    denom[g] = 0.f;
    for (int i = 0; i < nv; ++i) {
      qv[g][i] = _mm512_mul_ps(load16(q + g * D + 16 * i), _mm512_set1_ps(scale));
      acc[g][i] = _mm512_setzero_ps();
    }
  }
  int64_t j = 0;
  while (j < L) {
    int n = 0;
    for (; j < L && n < KEY_BLOCK; ++j)
      if (!mask || mask[j]) vis[n++] = slots[j];
    if (n == 0) break;
    for (int b = 0; b < n; ++b) {
      const T* k = k_cache + vis[b] * stride;
      for (int i = 0; i < nv; ++i) kv[i] = load16(k + 16 * i);
      for (int g = 0; g < GB; ++g) {
        __m512 s = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int i = 1; i < nv; ++i) s = _mm512_fmadd_ps(qv[g][i], kv[i], s);
        sc[g][b] = _mm512_reduce_add_ps(s);
      }
    }
    const __mmask16 live = n == KEY_BLOCK ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    for (int g = 0; g < GB; ++g) {
      const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, sc[g]);
      const float bmax = _mm512_reduce_max_ps(s);
      if (bmax > m[g]) {  // rescale what has been accumulated so far
        const float c = std::exp(m[g] - bmax);
        denom[g] *= c;
        for (int i = 0; i < nv; ++i) acc[g][i] = _mm512_mul_ps(acc[g][i], _mm512_set1_ps(c));
        m[g] = bmax;
      }
      const __m512 p = _mm512_maskz_mov_ps(live, exp_nonpos(_mm512_sub_ps(s, _mm512_set1_ps(m[g]))));
      _mm512_store_ps(pr[g], p);
      denom[g] += _mm512_reduce_add_ps(p);
    }
    for (int b = 0; b < n; ++b) {
      const T* v = v_cache + vis[b] * stride;
      for (int i = 0; i < nv; ++i) kv[i] = load16(v + 16 * i);
      for (int g = 0; g < GB; ++g) {
        const __m512 pb = _mm512_set1_ps(pr[g][b]);
        for (int i = 0; i < nv; ++i) acc[g][i] = _mm512_fmadd_ps(pb, kv[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < GB; ++g) {
    const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
    for (int i = 0; i < nv; ++i) _mm512_storeu_ps(out + g * D + 16 * i, _mm512_mul_ps(acc[g][i], _mm512_set1_ps(inv)));
  }
}

// All G heads of one KV head, in groups of up to MAXG (registers: q and accumulators per head).
template <typename T, int NV>
void attend_heads(int64_t G, const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, const bool* mask,
                  int64_t L, int64_t stride, int64_t D, float scale, float* out) {
  constexpr int MAXG = NV == 0 ? 1 : NV <= 4 ? 4 : 2;
  for (int64_t g0 = 0; g0 < G; g0 += MAXG) {
    const int64_t gb = std::min<int64_t>(MAXG, G - g0);
    const T* qg = q + g0 * D;
    float* og = out + g0 * D;
    switch (gb) {
      case 1: attend_group<T, NV, 1>(qg, k_cache, v_cache, slots, mask, L, stride, D, scale, og); break;
      case 2: attend_group<T, NV, MAXG >= 2 ? 2 : 1>(qg, k_cache, v_cache, slots, mask, L, stride, D, scale, og); break;
      case 3: attend_group<T, NV, MAXG >= 3 ? 3 : 1>(qg, k_cache, v_cache, slots, mask, L, stride, D, scale, og); break;
      default: attend_group<T, NV, MAXG>(qg, k_cache, v_cache, slots, mask, L, stride, D, scale, og); break;
    }
  }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& gather,
         const torch::Tensor& lens, const torch::Tensor& q_seq, const torch::Tensor& q_row,
         const torch::Tensor& mask, double scale, torch::Tensor& out) {
  const int64_t T_ = q.size(0), H = q.size(1), D = q.size(2), Hkv = kc.size(1), G = H / Hkv;
  const int64_t L = gather.size(1), Q = mask.defined() && mask.numel() ? mask.size(1) : 0;
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* gp = gather.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = q_seq.data_ptr<int64_t>();
  const int64_t* rp = q_row.data_ptr<int64_t>();
  const bool* mp = Q ? mask.data_ptr<bool>() : nullptr;
  T* op = out.data_ptr<T>();
  const auto heads = D == 32 ? attend_heads<T, 2> : D == 64 ? attend_heads<T, 4> : D == 128 ? attend_heads<T, 8>
                                                                                          : attend_heads<T, 0>;
  // one work item per (query row, KV head): its G query heads share every key's conversion
  at::parallel_for(0, T_ * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(G * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Hkv, kvh = i % Hkv, b = sp[t], h0 = kvh * G;
      const bool* mrow = mp ? mp + (b * Q + rp[t]) * L : nullptr;
      heads(G, qp + (t * H + h0) * D, kp + kvh * D, vp + kvh * D, gp + b * L, mrow, mp ? L : lp[b], Hkv * D, D,
            static_cast<float>(scale), buf.data());
      for (int64_t d = 0; d < G * D; ++d) op[(t * H + h0) * D + d] = static_cast<T>(buf[d]);
    }
  });
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_gather,
                              torch::Tensor kv_lens, torch::Tensor q_seq, torch::Tensor q_row, torch::Tensor mask,
                              double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 256, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == at::kBFloat16) run<at::BFloat16>(q, k_cache, v_cache, kv_gather, kv_lens, q_seq, q_row, mask, scale, out);
  else if (q.scalar_type() == at::kFloat) run<float>(q, k_cache, v_cache, kv_gather, kv_lens, q_seq, q_row, mask, scale, out);
  else TORCH_CHECK(false, "dtype must be float32 or bfloat16");
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

namespace {

// Rows of n: x += delta (where given), out = rms_norm(x) (* weight, where given); float32
// statistics and math, one rounding to T per output.
template <typename T>
void rms_rows(T* x, const T* delta, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * n;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      if (delta) xr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(delta[r * n + i]));
      ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    }
    const float inv = 1.f / std::sqrt(ss / n + eps);
    for (int64_t i = 0; i < n; ++i) {
      float y = static_cast<float>(xr[i]) * inv;
      if (weight) y *= static_cast<float>(weight[i]);
      out[r * n + i] = static_cast<T>(y);
    }
  }
}

}  // namespace

// x <- x + residual_in; returns rms_norm(x) * weight (float32 math). Fuses the residual add and
// the next norm, which cost more in dispatch than in arithmetic at decode sizes.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && delta.is_contiguous() && x.sizes() == delta.sizes(), "x, delta");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// Each of the n equal chunks of every row of x [T, n * h] RMS-normalised, no weight: a
// fused-feature draft head's aux features, one call instead of the ~10 tensor ops of the torch
// expression (x is only read).
torch::Tensor rms_norm_chunks(torch::Tensor x, int64_t n, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && n > 0 && x.size(1) % n == 0, "x: contiguous [T, n * h]");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm_chunks", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, nullptr, out.data_ptr<scalar_t>(), x.size(0) * n,
                       x.size(1) / n, static_cast<float>(eps));
  });
  return out;
}
