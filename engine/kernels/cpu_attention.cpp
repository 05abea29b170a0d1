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
#include <cmath>
#include <vector>

namespace {

template <typename T> inline __m512 load16(const T* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <typename T>
void attend_one(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots, const bool* mask,
                int64_t L, int64_t stride, int64_t D, float scale, float* out) {
  // D is a multiple of 16 (checked by the caller); at most 256.
  __m512 qv[16], acc[16];
  const int64_t nv = D / 16;
  for (int64_t i = 0; i < nv; ++i) { qv[i] = _mm512_mul_ps(load16(q + 16 * i), _mm512_set1_ps(scale)); acc[i] = _mm512_setzero_ps(); }
  float m = -INFINITY, denom = 0.f;
  for (int64_t j = 0; j < L; ++j) {
    if (mask && !mask[j]) continue;
    const T* k = k_cache + slots[j] * stride;
    __m512 s = _mm512_setzero_ps();
    for (int64_t i = 0; i < nv; ++i) s = _mm512_fmadd_ps(qv[i], load16(k + 16 * i), s);
    const float score = _mm512_reduce_add_ps(s);
    const T* v = v_cache + slots[j] * stride;
    if (score > m) {  // rescale what has been accumulated so far
      const float c = std::exp(m - score);
      denom *= c;
      for (int64_t i = 0; i < nv; ++i) acc[i] = _mm512_mul_ps(acc[i], _mm512_set1_ps(c));
      m = score;
    }
    const float p = std::exp(score - m);
    denom += p;
    for (int64_t i = 0; i < nv; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(p), load16(v + 16 * i), acc[i]);
  }
  const float inv = denom > 0.f ? 1.f / denom : 0.f;
  for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv)));
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
  at::parallel_for(0, T_ * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H, b = sp[t];
      const bool* mrow = mp ? mp + (b * Q + rp[t]) * L : nullptr;
      attend_one<T>(qp + (t * H + h) * D, kp + (h / G) * D, vp + (h / G) * D, gp + b * L, mrow,
                    mp ? L : lp[b], Hkv * D, D, static_cast<float>(scale), buf.data());
      for (int64_t d = 0; d < D; ++d) op[(t * H + h) * D + d] = static_cast<T>(buf[d]);
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

// x <- x + residual_in; returns rms_norm(x) * weight (float32 math). Fuses the residual add and
// the next norm, which cost more in dispatch than in arithmetic at decode sizes.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && delta.is_contiguous() && x.sizes() == delta.sizes(), "x, delta");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      float ss = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const scalar_t v = static_cast<scalar_t>(static_cast<float>(xp[r * n + i]) + static_cast<float>(dp[r * n + i]));
        xp[r * n + i] = v;
        ss += static_cast<float>(v) * static_cast<float>(v);
      }
      const float inv = 1.f / std::sqrt(ss / n + static_cast<float>(eps));
      for (int64_t i = 0; i < n; ++i)
        op[r * n + i] = static_cast<scalar_t>(static_cast<float>(xp[r * n + i]) * inv * static_cast<float>(wp[i]));
    }
  });
  return out;
}
