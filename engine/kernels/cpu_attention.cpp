// Paged attention for few queries per sequence (decode and tree verification) on the CPU.
//
// Every query (token t, head h) walks its visible keys straight through the block-table slots
// (no gathered copy), with an online softmax in float32: one pass over K and V, in chunks of
// CHUNK keys that run as separate work items and are merged in order.
// Shapes: q [T, H, D]; k_cache, v_cache [S, Hkv, D]; kv_gather [B, L] slots; kv_lens [B];
// q_seq [T] sequence of each query; q_row [T] its row in the mask; mask [B, Q, L] bool or
// empty (then every key < kv_len is visible). Output [T, H * D] in q's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "simd.h"

namespace {

using namespace eagle_simd;

// e^x for x <= 0 (an online softmax's x - max): eagle_simd::exp_ps, whose upper clamp never
// applies here; below ~-104 it flushes to 0 as e^x does in float32.
inline vf exp_nonpos(vf x) { return exp_ps(x); }

constexpr int KEY_BLOCK = 16;
// A query row's visible keys are cut into chunks of this many (a multiple of KEY_BLOCK), each
// a work item of its own, their softmax states merged in order afterwards: one decoding row's
// KV heads are then spread over both threads, and the rows of a tree read each chunk's keys
// right after one another (from cache). A row's chunks depend only on its visible keys, so a
// tree node still computes what a plain step over the same keys computes.
constexpr int64_t CHUNK = 128;

// An online softmax's state over some keys for a group of heads: running max, denominator and
// unnormalised value sums ([heads, D]).
struct State {
  float* m;
  float* denom;
  float* acc;
  State at(int64_t g, int64_t D) const { return {m + g, denom + g, acc + g * D}; }
};

#if EAGLE_DPBF16
// Sum of each of 16 vectors' 16 lanes, in lane b for v[b]: pairwise shuffles and adds (45
// instructions for 16 sums, against ~8 for each horizontal reduction).
inline __m512 sum16x16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: that lane's sums of v[4j .. 4j + 3]
    const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}
#endif

// GB query heads that share one KV head (GQA), one query row, over `slots` (the row's visible
// keys of one chunk, in order): each head's online softmax state in float32, left unnormalised
// in `out`. Keys go in blocks of KEY_BLOCK: every key's V is converted to float32 once for the
// GB heads, each head updates its running max and rescales once per block and takes the
// block's exps in one vector. Scores: with DP (bfloat16 caches, D a multiple of 32) by
// VDPBF16PS straight from the bf16 query and keys (products exact in float32, float32 sums),
// each key's lanes summed for the whole block at once (sum16x16), then scaled; otherwise the
// key converted to float32 and dotted with the scaled query. A head's arithmetic depends only
// on the keys it is given, so a tree node computes what a plain step over the same keys does.
// NV = D / 16 at compile time (registers); NV = 0: D at run time, any multiple of 16 up to 256.
template <typename T, int NV, int GB, bool DP>
void attend_group(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t L, int64_t stride,
                  int64_t D, float scale, State out) {
  constexpr int NVA = NV > 0 ? NV : 16;
  const int nv = NV > 0 ? NV : static_cast<int>(D / VL);
  vf qv[GB][NVA], acc[GB][NVA], kv[NVA];
#if EAGLE_DPBF16
  constexpr int NB = DP ? NV / 2 : 1;  // bf16 vectors of 32 per head (DP)
  __m512bh qb[GB][NB];
  __m512 part[GB][KEY_BLOCK];  // DP: each key's partial lanes
#endif
  float m[GB], denom[GB];
  alignas(64) float sc[GB][KEY_BLOCK];
  alignas(64) float pr[GB][KEY_BLOCK];
  for (int g = 0; g < GB; ++g) {
    m[g] = -INFINITY;
    denom[g] = 0.f;
    for (int i = 0; i < nv; ++i) {
      if constexpr (!DP) qv[g][i] = vmul(load16(q + g * D + VL * i), vset1(scale));
      acc[g][i] = vzero();
    }
#if EAGLE_DPBF16
    if constexpr (DP)
      for (int i = 0; i < NB; ++i) qb[g][i] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * i);
#endif
  }
  for (int64_t j = 0; j < L; j += KEY_BLOCK) {
    const int n = static_cast<int>(std::min<int64_t>(KEY_BLOCK, L - j));
    const int64_t* vis = slots + j;
    for (int b = 0; b < n; ++b) {
      const T* k = k_cache + vis[b] * stride;
#if EAGLE_DPBF16
      if constexpr (DP) {
        __m512bh kb[NB];
        for (int i = 0; i < NB; ++i) kb[i] = (__m512bh)_mm512_loadu_si512(k + 32 * i);
        for (int g = 0; g < GB; ++g) {
          __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
          for (int i = 1; i < NB; ++i) s = _mm512_dpbf16_ps(s, qb[g][i], kb[i]);
          part[g][b] = s;
        }
      } else
#endif
      {
        for (int i = 0; i < nv; ++i) kv[i] = load16(k + VL * i);
        for (int g = 0; g < GB; ++g) {
          vf s = vmul(qv[g][0], kv[0]);
          for (int i = 1; i < nv; ++i) s = vfmadd(qv[g][i], kv[i], s);
          sc[g][b] = vsum(s);
        }
      }
    }
    for (int g = 0; g < GB; ++g) {
      vf s;
#if EAGLE_DPBF16
      if constexpr (DP) {
        for (int b = n; b < KEY_BLOCK; ++b) part[g][b] = _mm512_setzero_ps();
        s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), first_lanes(n),
                               _mm512_mul_ps(sum16x16(part[g]), _mm512_set1_ps(scale)));
      } else
#endif
        s = load_first(sc[g], n, -INFINITY);
      const float bmax = vmaxall(s);
      if (bmax > m[g]) {  // rescale what has been accumulated so far
        const float c = std::exp(m[g] - bmax);
        denom[g] *= c;
        for (int i = 0; i < nv; ++i) acc[g][i] = vmul(acc[g][i], vset1(c));
        m[g] = bmax;
      }
      const vf p = keep_first(exp_nonpos(vsub(s, vset1(m[g]))), n);
      store16(pr[g], p);
      denom[g] += vsum(p);
    }
    for (int b = 0; b < n; ++b) {
      const T* v = v_cache + vis[b] * stride;
      for (int i = 0; i < nv; ++i) kv[i] = load16(v + VL * i);
      for (int g = 0; g < GB; ++g) {
        const vf pb = vset1(pr[g][b]);
        for (int i = 0; i < nv; ++i) acc[g][i] = vfmadd(pb, kv[i], acc[g][i]);
      }
    }
  }
  for (int g = 0; g < GB; ++g) {
    out.m[g] = m[g];
    out.denom[g] = denom[g];
    for (int i = 0; i < nv; ++i) store16(out.acc + g * D + VL * i, acc[g][i]);
  }
}

template <typename T, int NV, int GB>
inline void group(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t L, int64_t stride,
                  int64_t D, float scale, State out) {
  constexpr bool dp = EAGLE_DPBF16 && std::is_same_v<T, at::BFloat16> && NV > 0 && NV % 2 == 0;
  attend_group<T, NV, GB, dp>(q, k_cache, v_cache, slots, L, stride, D, scale, out);
}

// All G heads of one KV head, in groups of up to MAXG (registers: q and accumulators per head).
template <typename T, int NV>
void attend_heads(int64_t G, const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, int64_t L,
                  int64_t stride, int64_t D, float scale, State out) {
  constexpr int MAXG = NV == 0 ? 1 : NV <= 4 ? 4 : 2;
  for (int64_t g0 = 0; g0 < G; g0 += MAXG) {
    const int64_t gb = std::min<int64_t>(MAXG, G - g0);
    const T* qg = q + g0 * D;
    const State og = out.at(g0, D);
    switch (gb) {
      case 1: group<T, NV, 1>(qg, k_cache, v_cache, slots, L, stride, D, scale, og); break;
      case 2: group<T, NV, MAXG >= 2 ? 2 : 1>(qg, k_cache, v_cache, slots, L, stride, D, scale, og); break;
      case 3: group<T, NV, MAXG >= 3 ? 3 : 1>(qg, k_cache, v_cache, slots, L, stride, D, scale, og); break;
      default: group<T, NV, MAXG>(qg, k_cache, v_cache, slots, L, stride, D, scale, og); break;
    }
  }
}

template <typename T>
void run_planned(AttentionPlan& p, const T* qp, const T* kp, const T* vp, T* op, int64_t H, int64_t D, double scale) {
  const int64_t T_ = p.T, Hkv = p.Hkv, G = H / Hkv, max_chunks = p.max_chunks;
  const auto heads = D == 32 ? attend_heads<T, 2> : D == 64 ? attend_heads<T, 4> : D == 128 ? attend_heads<T, 8>
                                                                                          : attend_heads<T, 0>;
  const auto& items = p.items;
  const auto& item_of = p.item_of;
  const auto& chunks = p.chunks;
  const int64_t width = 2 * G + G * D;  // one item's state: m [G], denom [G], acc [G, D]
  p.states.resize(items.size() * width);
  float* states = p.states.data();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const AttentionPlan::Item it = items[i];
      const int64_t first = it.c * CHUNK, n = std::min<int64_t>(CHUNK, p.row_len[it.t] - first);
      float* st = states + i * width;
      heads(G, qp + (it.t * H + it.kvh * G) * D, kp + it.kvh * D, vp + it.kvh * D, p.row_slots[it.t] + first,
            std::max<int64_t>(n, 0), Hkv * D, D, static_cast<float>(scale), State{st, st + G, st + 2 * G});
    }
  });
  // merge each (row, KV head)'s chunks in order and normalise
  at::parallel_for(0, T_ * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc(G * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Hkv, kvh = i % Hkv, h0 = kvh * G;
      const int64_t* idx = item_of.data() + i * max_chunks;
      const float* first = states + idx[0] * width;
      for (int64_t g = 0; g < G; ++g) {
        float m = first[g];
        for (int64_t c = 1; c < chunks[t]; ++c) m = std::max(m, states[idx[c] * width + g]);
        float denom = 0.f;
        float* a = acc.data() + g * D;
        std::fill(a, a + D, 0.f);
        for (int64_t c = 0; c < chunks[t]; ++c) {
          const float* st = states + idx[c] * width;
          const float w = chunks[t] == 1 ? 1.f : (st[g] == -INFINITY ? 0.f : std::exp(st[g] - m));
          denom += w * st[G + g];
          const float* sa = st + 2 * G + g * D;
          if (chunks[t] == 1) std::copy(sa, sa + D, a);
          else for (int64_t d = 0; d < D; ++d) a[d] += w * sa[d];
        }
        const float inv = denom > 0.f ? 1.f / denom : 0.f;
        for (int64_t d = 0; d < D; ++d) op[(t * H + h0 + g) * D + d] = static_cast<T>(a[d] * inv);
      }
    }
  });
}

}  // namespace

void plan_attention(AttentionPlan& p, const torch::Tensor& gather, const torch::Tensor& lens,
                    const torch::Tensor& q_seq, const torch::Tensor& q_row, const torch::Tensor& mask, int64_t T_,
                    int64_t Hkv) {
  TORCH_CHECK(gather.dim() == 2 && gather.is_contiguous() && gather.scalar_type() == at::kLong, "kv_gather: [B, L] int64");
  TORCH_CHECK(lens.is_contiguous() && q_seq.is_contiguous() && q_row.is_contiguous() && q_seq.numel() >= T_ &&
              q_row.numel() >= T_, "kv_lens, q_seq, q_row: contiguous int64");
  p.T = T_;
  p.Hkv = Hkv;
  p.gather = gather;
  const int64_t L = gather.size(1), Q = mask.defined() && mask.numel() ? mask.size(1) : 0;
  const int64_t* gp = gather.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = q_seq.data_ptr<int64_t>();
  const int64_t* rp = q_row.data_ptr<int64_t>();
  const bool* mp = Q ? mask.data_ptr<bool>() : nullptr;
  // each row's visible keys' slots, in order (without a mask: its sequence's first kv_len)
  p.row_slots.assign(T_, nullptr);
  p.row_len.assign(T_, 0);
  if (mp) {
    p.visible.resize(T_ * L + 8);  // + 8: the last full store of a compress may run past the end
    int64_t* dst = p.visible.data();
    for (int64_t t = 0; t < T_; ++t) {
      const bool* mrow = mp + (sp[t] * Q + rp[t]) * L;
      const int64_t* g = gp + sp[t] * L;
      p.row_slots[t] = dst;
      int64_t j = 0;
#if EAGLE_DPBF16  // (AVX-512's compress; the AVX2 build takes the scalar loop below)
      for (; j + 8 <= L; j += 8) {  // 8 mask bytes -> the visible ones of 8 slots, packed
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mrow + j));
        const __mmask8 keep = static_cast<__mmask8>(_mm_test_epi8_mask(bytes, bytes));
        _mm512_storeu_si512(dst, _mm512_maskz_compress_epi64(keep, _mm512_loadu_si512(g + j)));
        dst += __builtin_popcount(keep);
      }
#endif
      for (; j < L; ++j)
        if (mrow[j]) *dst++ = g[j];
      p.row_len[t] = dst - p.row_slots[t];
    }
  } else {
    for (int64_t t = 0; t < T_; ++t) {
      p.row_slots[t] = gp + sp[t] * L;
      p.row_len[t] = lp[sp[t]];
    }
  }
  // work items (row, KV head, chunk), ordered so the rows of one sequence take a chunk's keys
  // one after another; item_of[(t * Hkv + kvh) * max_chunks + c] is where its state goes
  p.chunks.assign(T_, 1);
  p.max_chunks = 1;
  for (int64_t t = 0; t < T_; ++t) {
    p.chunks[t] = std::max<int64_t>(1, (p.row_len[t] + CHUNK - 1) / CHUNK);
    p.max_chunks = std::max(p.max_chunks, p.chunks[t]);
  }
  std::vector<int64_t> order(T_);
  for (int64_t t = 0; t < T_; ++t) order[t] = t;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sp[a] < sp[b]; });
  p.items.clear();
  p.item_of.assign(T_ * Hkv * p.max_chunks, -1);
  for (int64_t i0 = 0; i0 < T_;) {  // rows [i0, i1) of `order` share a sequence
    int64_t i1 = i0;
    int64_t most = 0;
    while (i1 < T_ && sp[order[i1]] == sp[order[i0]]) most = std::max(most, p.chunks[order[i1++]]);
    for (int64_t kvh = 0; kvh < Hkv; ++kvh)
      for (int64_t c = 0; c < most; ++c)
        for (int64_t i = i0; i < i1; ++i)
          if (c < p.chunks[order[i]]) {
            p.item_of[(order[i] * Hkv + kvh) * p.max_chunks + c] = static_cast<int64_t>(p.items.size());
            p.items.push_back({order[i], kvh, c});
          }
    i0 = i1;
  }
}

void attend_planned(AttentionPlan& p, at::ScalarType dtype, const void* q, const void* k_cache, const void* v_cache,
                    void* out, int64_t H, int64_t D, double scale) {
  TORCH_CHECK(D % 16 == 0 && D <= 256, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(p.Hkv > 0 && H % p.Hkv == 0, "heads must be a multiple of kv heads");
  if (dtype == at::kBFloat16)
    run_planned<at::BFloat16>(p, static_cast<const at::BFloat16*>(q), static_cast<const at::BFloat16*>(k_cache),
                              static_cast<const at::BFloat16*>(v_cache), static_cast<at::BFloat16*>(out), H, D, scale);
  else if (dtype == at::kFloat)
    run_planned<float>(p, static_cast<const float*>(q), static_cast<const float*>(k_cache),
                       static_cast<const float*>(v_cache), static_cast<float*>(out), H, D, scale);
  else TORCH_CHECK(false, "dtype must be float32 or bfloat16");
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_gather,
                              torch::Tensor kv_lens, torch::Tensor q_seq, torch::Tensor q_row, torch::Tensor mask,
                              double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "one dtype");
  AttentionPlan p;
  plan_attention(p, kv_gather.contiguous(), kv_lens, q_seq, q_row, mask, q.size(0), k_cache.size(1));
  auto out = torch::empty_like(q);
  attend_planned(p, q.scalar_type(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), q.size(1),
                 q.size(2), scale);
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

namespace {

// Rows of n: x += delta (where given), out = rms_norm(x) (* weight, where given); float32
// statistics and math, one rounding to T per output. float32 / bfloat16 16 lanes at a time (the
// sum of squares in 16 partial sums, then added), the rest scalar: each row's numbers depend on
// that row alone. Vectorised because scalar per-row loops grow with every row a tree adds
// (bench/bench_kernels_ab.py measures such a change side by side).
template <typename T>
void rms_rows(T* x, const T* delta, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  constexpr bool vec = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
  using namespace eagle_simd;
  for (int64_t r = 0; r < rows; ++r) {
    T* xr = x + r * n;
    const T* dr = delta ? delta + r * n : nullptr;
    T* o = out + r * n;
    float ss = 0.f;
    int64_t i = 0;
    if constexpr (vec) {
      vf acc = vzero();
      for (; i + VL <= n; i += VL) {
        if (dr) store16(xr + i, vadd(load16(xr + i), load16(dr + i)));  // rounded to T, as below
        const vf v = load16(xr + i);
        acc = vfmadd(v, v, acc);
      }
      ss = vsum(acc);
    }
    for (; i < n; ++i) {
      if (dr) xr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
      ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    }
    const float inv = 1.f / std::sqrt(ss / n + eps);
    i = 0;
    if constexpr (vec) {
      for (; i + VL <= n; i += VL) {
        vf y = vmul(load16(xr + i), vset1(inv));
        if (weight) y = vmul(y, load16(weight + i));
        store16(o + i, y);
      }
    }
    for (; i < n; ++i) {
      float y = static_cast<float>(xr[i]) * inv;
      if (weight) y *= static_cast<float>(weight[i]);
      o[i] = static_cast<T>(y);
    }
  }
}

}  // namespace

// x <- x + residual_in; returns rms_norm(x) * weight (float32 math). Fuses the residual add and
// the next norm, which cost more in dispatch than in arithmetic at decode sizes.
// (into `out`, a buffer of x's shape and dtype: the decode stack's, reused by every layer)
void add_rms_norm_into(const torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight, double eps,
                       const torch::Tensor& out) {
  TORCH_CHECK(x.is_contiguous() && delta.is_contiguous() && x.sizes() == delta.sizes(), "x, delta");
  TORCH_CHECK(x.dim() == 2 && weight.is_contiguous() && weight.numel() == x.size(1), "weight [n]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), "out: x's shape");
  TORCH_CHECK(delta.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type() &&
              out.scalar_type() == x.scalar_type(), "x, delta, weight and out share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                       out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous(), "x");
  auto out = torch::empty_like(x);
  add_rms_norm_into(x, delta, weight, eps, out);
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

// Per row of x [R, V] float32: the index of its maximum, as torch's max(-1).indices gives it (the
// first index among equal maxima; a row holding NaN: its first NaN, which max propagates). One
// pass of 16-lane compares, each lane keeping its first best, then the lanes reduced by (value,
// lowest index); rows in parallel. Greedy picks read every logit of a tree's rows: 9.4 us for 4
// rows of the default model's 49152, several times faster than torch's argmax.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x: contiguous float32 [R, V], V > 0");
  using namespace eagle_simd;
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    alignas(64) float bv[VL];
    alignas(64) int32_t bi[VL];
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * V;
      int64_t best = 0;
      float bestv = row[0];
      int64_t j = 0;
      bool nan = false;
      if (V >= VL) {
#if EAGLE_DPBF16
        __m512 m = _mm512_loadu_ps(row);
        __m512i mi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i idx = mi;
        __mmask16 unord = _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
        for (j = VL; j + VL <= V; j += VL) {
          idx = _mm512_add_epi32(idx, _mm512_set1_epi32(VL));
          const __m512 v = _mm512_loadu_ps(row + j);
          unord |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          const __mmask16 gt = _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ);
          m = _mm512_mask_mov_ps(m, gt, v);
          mi = _mm512_mask_mov_epi32(mi, gt, idx);
        }
        nan = unord != 0;
        _mm512_store_ps(bv, m);
        _mm512_store_si512(bi, mi);
#else
        __m256 m0 = _mm256_loadu_ps(row), m1 = _mm256_loadu_ps(row + 8);
        __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
        __m256i idx0 = i0, idx1 = i1;
        __m256 unord = _mm256_or_ps(_mm256_cmp_ps(m0, m0, _CMP_UNORD_Q), _mm256_cmp_ps(m1, m1, _CMP_UNORD_Q));
        for (j = VL; j + VL <= V; j += VL) {
          idx0 = _mm256_add_epi32(idx0, _mm256_set1_epi32(VL));
          idx1 = _mm256_add_epi32(idx1, _mm256_set1_epi32(VL));
          const __m256 v0 = _mm256_loadu_ps(row + j), v1 = _mm256_loadu_ps(row + j + 8);
          unord = _mm256_or_ps(unord, _mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)));
          const __m256 g0 = _mm256_cmp_ps(v0, m0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(v1, m1, _CMP_GT_OQ);
          m0 = _mm256_blendv_ps(m0, v0, g0);
          m1 = _mm256_blendv_ps(m1, v1, g1);
          i0 = _mm256_blendv_epi8(i0, idx0, _mm256_castps_si256(g0));
          i1 = _mm256_blendv_epi8(i1, idx1, _mm256_castps_si256(g1));
        }
        nan = _mm256_movemask_ps(unord) != 0;
        _mm256_store_ps(bv, m0);
        _mm256_store_ps(bv + 8, m1);
        _mm256_store_si256(reinterpret_cast<__m256i*>(bi), i0);
        _mm256_store_si256(reinterpret_cast<__m256i*>(bi + 8), i1);
#endif
        best = bi[0];
        bestv = bv[0];
        for (int l = 1; l < VL; ++l)
          if (bv[l] > bestv || (bv[l] == bestv && bi[l] < best)) { bestv = bv[l]; best = bi[l]; }
      } else {
        j = 1;
      }
      for (; j < V; ++j) {  // the tail (or a row shorter than a vector)
        if (std::isnan(row[j])) nan = true;
        if (row[j] > bestv) { bestv = row[j]; best = j; }
      }
      if (nan || std::isnan(row[0])) {
        for (int64_t k = 0; k < V; ++k)
          if (std::isnan(row[k])) { best = k; break; }
      }
      op[r] = best;
    }
  });
  return out;
}

// Per row of logits x [R, V] float32: the k largest entries of log_softmax(x) (descending; equal
// values by lower index) and their indices, mapped through d2t [V] where given (a reduced draft
// vocabulary's target ids). One draft level's ranking in one call instead of log_softmax, topk and
// an index (three ATen ops; bench/results/kernels_ab_topk_log_softmax.json): the k best by one pass of
// 16-lane block maxima against the k-th best so far (a block rarely holds a new one), then
// e^(x - max) summed 16 lanes at a time; values = (x - max) - log(sum), the formula ATen's
// log_softmax uses. A row holding a NaN or an infinity takes ATen's ops instead
// (their ordering of NaN). Both draft paths (EagleHead.draft_topk from Python, head_level here)
// rank through this function, so they agree.
std::vector<torch::Tensor> topk_log_softmax(torch::Tensor x, int64_t k, torch::Tensor d2t) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x: contiguous float32 [R, V], V > 0");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "k must be in [1, V]");
  TORCH_CHECK(!d2t.defined() || !d2t.numel() || (d2t.dim() == 1 && d2t.numel() == V && d2t.is_contiguous() &&
                                                 d2t.scalar_type() == at::kLong), "d2t: int64 [V] or empty");
  using namespace eagle_simd;
  auto values = torch::empty({R, k}, x.options());
  auto indices = torch::empty({R, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  const int64_t* map = d2t.defined() && d2t.numel() ? d2t.data_ptr<int64_t>() : nullptr;
  std::vector<char> odd(R, 0);  // rows with a NaN or an infinity: ATen's ops below
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> bv(k);
    std::vector<int64_t> bi(k);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * V;
      int64_t n = 0;  // entries held, best first
      float thr = -INFINITY;  // the k-th best once n == k
      auto offer = [&](float v, int64_t j) {
        if (n == k && !(v > thr)) return;
        int64_t p = n < k ? n++ : k - 1;
        while (p > 0 && v > bv[p - 1]) {  // after every held value >= v: equal values keep index order
          bv[p] = bv[p - 1];
          bi[p] = bi[p - 1];
          --p;
        }
        bv[p] = v;
        bi[p] = j;
        if (n == k) thr = bv[k - 1];
      };
      vf finite = vzero();  // x * 0: 0 where finite, NaN where x is NaN or infinite
      int64_t j = 0;
      for (; j + VL <= V; j += VL) {
        const vf v = load16(row + j);
        finite = vadd(finite, vmul(v, vzero()));
        if (n < k || vmaxall(v) > thr)
          for (int l = 0; l < VL; ++l) offer(row[j + l], j + l);
      }
      bool ok = !std::isnan(vsum(finite));
      for (; j < V; ++j) {
        if (!std::isfinite(row[j])) ok = false;
        offer(row[j], j);
      }
      if (!ok) {  // (n == k here: every entry was offered and k <= V)
        odd[r] = 1;
        continue;
      }
      const float m = bv[0];
      vf acc = vzero();
      j = 0;
      for (; j + VL <= V; j += VL) acc = vadd(acc, exp_ps(vsub(load16(row + j), vset1(m))));
      float sum = vsum(acc);
      for (; j < V; ++j) sum += std::exp(row[j] - m);
      const float lse = std::log(sum);
      for (int64_t i = 0; i < k; ++i) {
        vp[r * k + i] = (bv[i] - m) - lse;
        ip[r * k + i] = map ? map[bi[i]] : bi[i];
      }
    }
  });
  for (int64_t r = 0; r < R; ++r)
    if (odd[r]) {
      auto top = at::topk(at::log_softmax(x[r], -1), k);
      values[r].copy_(std::get<0>(top));
      indices[r].copy_(map ? d2t.index({std::get<1>(top)}) : std::get<1>(top));
    }
  return {values, indices};
}
