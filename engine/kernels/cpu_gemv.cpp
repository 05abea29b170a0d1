// Skinny matrix products for CPU decoding: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), small M.
//
// Decoding reads every weight once per token, so speed is memory bandwidth. General GEMM
// libraries handle M = 1..4 poorly on some CPUs (measured in bench/bench_linear.py); these
// loops stream each weight row once, front to back, and reuse it for all M inputs from L1.
// Accumulation is float32 (AVX-512; bf16 uses VDPBF16PS).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>

namespace {

inline uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return 0x7fc0;  // NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Dot product of one weight row with one input row, streaming the row front to back (one
// sequential stream per thread is what the hardware prefetcher follows best: measured 2x
// over interleaving several rows). Two accumulators hide the FMA latency.
inline float dot_bf16(const uint16_t* x, const uint16_t* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32), (__m512bh)_mm512_loadu_si512(w + k + 32));
  }
  for (; k < K; k += 32) {  // last 1..63 elements, masked past K
    const int64_t left = K - k;
    const __mmask32 m = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, x + k), (__m512bh)_mm512_maskz_loadu_epi16(m, w + k));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

inline float dot_f32(const float* x, const float* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), a1);
  }
  for (; k < K; k += 16) {
    const int64_t left = K - k;
    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// More input rows (tree verification, batches of decodes): a register tile of NB weight rows x
// MB input rows. Each k-step loads NB + MB vectors for NB * MB dot-product instructions instead
// of two loads per instruction, which is what bounds the row-at-a-time loop once the weights
// are in cache. The tile's weight rows still stream front to back.
template <int NB, int MB>
__attribute__((always_inline)) inline void tile_bf16(const uint16_t* x, const uint16_t* w, int64_t K, float* out, int ld) {
  __m512 acc[NB][MB];
#pragma GCC unroll 8
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) wv[i] = (__m512bh)_mm512_loadu_si512(w + i * K + k);
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + j * K + k);
#pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[i]);
    }
  }
  if (k < K) {  // last 1..31 elements, masked past K
    const __mmask32 m = (__mmask32)((1u << (K - k)) - 1);
    __m512bh wv[NB];
#pragma GCC unroll 8
    for (int i = 0; i < NB; ++i) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i * K + k);
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + j * K + k);
#pragma GCC unroll 8
      for (int i = 0; i < NB; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < NB; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) out[i * ld + j] = _mm512_reduce_add_ps(acc[i][j]);
}

constexpr int TILE_N = 1, TILE_M = 8;
constexpr int64_t ROW_AT_A_TIME_MAX = 4;  // up to this many rows: one weight row at a time (measured)

template <int NB>
inline void tile_rows(int mb, const uint16_t* x, const uint16_t* w, int64_t K, float out[TILE_N][TILE_M]) {
  switch (mb) {
    case 1: tile_bf16<NB, 1>(x, w, K, &out[0][0], TILE_M); break;
    case 2: tile_bf16<NB, 2>(x, w, K, &out[0][0], TILE_M); break;
    case 3: tile_bf16<NB, 3>(x, w, K, &out[0][0], TILE_M); break;
    case 4: tile_bf16<NB, 4>(x, w, K, &out[0][0], TILE_M); break;
    case 5: tile_bf16<NB, 5>(x, w, K, &out[0][0], TILE_M); break;
    case 6: tile_bf16<NB, 6>(x, w, K, &out[0][0], TILE_M); break;
    case 7: tile_bf16<NB, 7>(x, w, K, &out[0][0], TILE_M); break;
    default: tile_bf16<NB, 8>(x, w, K, &out[0][0], TILE_M); break;
  }
}

void check(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  if (b) TORCH_CHECK(b->is_contiguous() && b->numel() == w.size(0) && b->scalar_type() == w.scalar_type(), "bias");
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool float_out) {
  check(x, w, bias);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  // float_out keeps the float32 accumulator instead of rounding to bf16 (the LM head: rounding
  // logits of ~25 to bf16 steps of 0.125 would manufacture exact ties)
  auto y = torch::empty({M, N}, float_out ? x.options().dtype(at::kFloat) : x.options());
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "dtype must be float32 or bfloat16");
  if (bf16) {
    auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    auto bp = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) : nullptr;
    float* yf = float_out ? y.data_ptr<float>() : nullptr;
    uint16_t* yh = float_out ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    auto put = [&](int64_t m, int64_t n, float v) {
      v += bp ? bf16_to_float(bp[n]) : 0.f;
      if (yf) yf[m * N + n] = v; else yh[m * N + n] = to_bf16(v);
    };
    if (M <= ROW_AT_A_TIME_MAX) {
      at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t m = 0; m < M; ++m)  // the row is in L1 after the first input row
            put(m, n, dot_bf16(xp + m * K, wp + n * K, K));
      });
    } else {
      at::parallel_for(0, (N + TILE_N - 1) / TILE_N, 32, [&](int64_t b0, int64_t b1) {
        float out[TILE_N][TILE_M];
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n = b * TILE_N;
          const int nb = static_cast<int>(std::min<int64_t>(TILE_N, N - n));
          for (int64_t m = 0; m < M; m += TILE_M) {
            const int mb = static_cast<int>(std::min<int64_t>(TILE_M, M - m));
            tile_rows<TILE_N>(mb, xp + m * K, wp + n * K, K, out);
            for (int i = 0; i < nb; ++i)
              for (int j = 0; j < mb; ++j) put(m + j, n + i, out[i][j]);
          }
        }
      });
    }
  } else {
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M; ++m)
          yp[m * N + n] = dot_f32(xp + m * K, wp + n * K, K) + (bp ? bp[n] : 0.f);
    });
  }
  return y;
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_gather,
                              torch::Tensor kv_lens, torch::Tensor q_seq, torch::Tensor q_row, torch::Tensor mask,
                              double scale);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
void register_decode_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "y = x @ w.T (+ bias) for few rows of x",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("float_out") = false);
  m.def("paged_attention", &paged_attention, "attention of few queries over block-table slots");
  m.def("add_rms_norm", &add_rms_norm, "x += delta; return rms_norm(x) * weight");
  register_decode_stack(m);
}
