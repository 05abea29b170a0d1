// Skinny matrix products for CPU decoding: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), small M.
//
// Decoding reads every weight once per token, so speed is memory bandwidth. General GEMM
// libraries handle M = 1..4 poorly on some CPUs (measured in bench/bench_decode.py); these
// loops stream each weight row once, keep R output rows in registers, and reuse the loaded
// rows for all M inputs from L1. Accumulation is float32 (AVX-512; bf16 uses VDPBF16PS).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

namespace {

constexpr int64_t R = 8;  // weight rows per inner block

inline uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return 0x7fc0;  // NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// One block of `rows` (<= R) weight rows against one input row, K elements.
inline void dot_rows_bf16(const uint16_t* x, const uint16_t* w, int64_t K, int rows, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
    for (int r = 0; r < rows; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512(w + r * K + k));
  }
  if (k < K) {  // tail: masked loads of the last K % 32 elements
    __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
    __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
    for (int r = 0; r < rows; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * K + k));
  }
  for (int r = 0; r < rows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

inline void dot_rows_f32(const float* x, const float* w, int64_t K, int rows, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv = _mm512_loadu_ps(x + k);
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + r * K + k), acc[r]);
  }
  if (k < K) {
    __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
    __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
    for (int r = 0; r < rows; ++r) acc[r] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, w + r * K + k), acc[r]);
  }
  for (int r = 0; r < rows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

void check(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  if (b) TORCH_CHECK(b->is_contiguous() && b->numel() == w.size(0) && b->scalar_type() == w.scalar_type(), "bias");
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  check(x, w, bias);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "dtype must be float32 or bfloat16");
  const int64_t blocks = (N + R - 1) / R;
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    float out[R];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * R;
      const int rows = static_cast<int>(std::min(R, N - n));
      for (int64_t m = 0; m < M; ++m) {
        if (bf16) {
          auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * K;
          auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) + n * K;
          dot_rows_bf16(xp, wp, K, rows, out);
          auto yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) + m * N + n;
          auto bp = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) + n : nullptr;
          for (int r = 0; r < rows; ++r) {
            float v = out[r];
            if (bp) { uint32_t bits = static_cast<uint32_t>(bp[r]) << 16; float bv; std::memcpy(&bv, &bits, 4); v += bv; }
            yp[r] = to_bf16(v);
          }
        } else {
          dot_rows_f32(x.data_ptr<float>() + m * K, w.data_ptr<float>() + n * K, K, rows, out);
          float* yp = y.data_ptr<float>() + m * N + n;
          const float* bp = bias ? bias->data_ptr<float>() + n : nullptr;
          for (int r = 0; r < rows; ++r) yp[r] = out[r] + (bp ? bp[r] : 0.f);
        }
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "y = x @ w.T (+ bias) for few rows of x");
}
