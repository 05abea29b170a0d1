// Skinny matrix products for CPU decoding: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), small M.
//
// Decoding reads every weight once per token, so speed is memory bandwidth. General GEMM
// libraries handle M = 1..4 poorly on some CPUs (measured in bench/bench_linear.py); these
// loops stream each weight row once, front to back, and reuse it for all M inputs from L1.
// Accumulation is float32 (AVX-512; bf16 uses VDPBF16PS).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cpuid.h>
#include "simd.h"
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>
#include <cstring>

namespace {

using eagle_simd::to_bf16;

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Dot product of one weight row with one input row, streaming the row front to back (one
// sequential stream per thread is what the hardware prefetcher follows best: measured 2x
// over interleaving several rows). Two accumulators hide the FMA latency.
#if EAGLE_DPBF16
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
#else  // AVX2 + FMA: the same streams in float32 (bf16 converted exactly), a scalar tail
template <typename T>
inline float dot_rows(const T* x, const T* w, int64_t K) {
  using namespace eagle_simd;
  vf a0 = vzero(), a1 = vzero();
  int64_t k = 0;
  for (; k + 2 * VL <= K; k += 2 * VL) {
    a0 = vfmadd(load16(x + k), load16(w + k), a0);
    a1 = vfmadd(load16(x + k + VL), load16(w + k + VL), a1);
  }
  for (; k + VL <= K; k += VL) a0 = vfmadd(load16(x + k), load16(w + k), a0);
  float s = vsum(vadd(a0, a1));
  for (; k < K; ++k) s += static_cast<float>(x[k]) * static_cast<float>(w[k]);
  return s;
}
inline float dot_bf16(const uint16_t* x, const uint16_t* w, int64_t K) {
  return dot_rows(reinterpret_cast<const at::BFloat16*>(x), reinterpret_cast<const at::BFloat16*>(w), K);
}
inline float dot_f32(const float* x, const float* w, int64_t K) { return dot_rows(x, w, K); }
#endif

// Packed bfloat16 weights for few-row products without horizontal sums. Layout [N / 32, K / 2, 64]:
// for every tile of 32 outputs and every pair of inputs (k, k + 1), the 32 outputs' weight pairs
// side by side (two 64-byte vectors, 16 outputs each), so one VDPBF16PS against the input pair
// broadcast to all lanes adds that pair's products to 16 outputs at once. A tile's weights are
// one contiguous stream, read once for up to PACKED_TILE_M input rows held in registers. Every
// output is one accumulator lane summed over k in order, whatever the number of rows, so a
// row's result does not depend on the batch it came in. (AVX2 builds: the loop further down.)
// Software prefetch this many pairs of inputs (128 bytes of a tile's stream each) ahead: 8 KB.
// The hardware prefetcher alone nearly keeps up with one input row, but with 3-16 rows
// (a verify step's tree, a batch of sequences) the loop spends longer per line and the stream
// falls behind; the prefetch shortens every row count's products, most at 8-16 rows
// (bench/bench_kernels_ab.py). Prefetches past the end do not fault.
constexpr int64_t PREFETCH_PAIRS = 64;

}  // namespace

// Weights streamed once per step that cannot stay cached anyway (a model's whole layer stack, a
// 49k-token LM head) can be prefetched non-temporally, so they do not evict what can: the draft
// head's weights, the KV cache, the interpreter's own state. A stream counts as such when its
// weights exceed STREAM_NTA_BYTES: one linear's (packed_linear), or a whole DecodeStack's, which
// sets stream_nta for its forward. Whether any stream does is nta_streams (set_nta_streams):
// by default on AMD CPUs only. The streams are a prefetch hint of the AVX-512 and AVX2 loops only: where
// the AMX path below runs (Intel, K % 32 == 0) they do not apply. On AMD EPYCs they speed up
// greedy and tree decoding by a few percent; on an Intel Xeon with AMX they cost nearly half of
// plain decoding's speed, hence AMD only (bench/bench_kernels_ab.py --nta compares the two).
extern const int64_t STREAM_NTA_BYTES = int64_t(16) << 20;
thread_local bool stream_nta = false;  // read on the calling thread, before parallel_for
bool nta_streams = (__builtin_cpu_init(), __builtin_cpu_is("amd"));  // the process-wide switch (set_nta_streams)

namespace {

// The input pairs [begin, end) of a tile that one call adds; first: its accumulators start at 0,
// else at what `out` holds (an earlier span's sums: each lane still adds its pairs in k order)
struct Span {
  int64_t begin, end;
  bool first;
};

#if EAGLE_DPBF16
using PackedIn = uint16_t;  // the inputs as the loop reads them: bf16 pairs
constexpr int PACKED_TILE_M = 8;
constexpr int64_t SPAN_PAIRS = INT64_MAX;  // a tile's rows in blocks of 8 read it whole, block by block
template <int MB, bool NTA>
__attribute__((always_inline)) inline void packed_tile(const uint16_t* x, int64_t K, const uint16_t* wt, Span sp,
                                                       float* out) {
  __m512 a0[MB], a1[MB];
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j) {
    a0[j] = sp.first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + j * 32);
    a1[j] = sp.first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + j * 32 + 16);
  }
  for (int64_t kp = sp.begin; kp < sp.end; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(wt + (kp + PREFETCH_PAIRS) * 64), NTA ? _MM_HINT_NTA : _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wt + (kp + PREFETCH_PAIRS) * 64 + 32), NTA ? _MM_HINT_NTA : _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wt + kp * 64);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wt + kp * 64 + 32);
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      int32_t pair;
      std::memcpy(&pair, x + j * K + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      a0[j] = _mm512_dpbf16_ps(a0[j], xb, w0);
      a1[j] = _mm512_dpbf16_ps(a1[j], xb, w1);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j) {
    _mm512_storeu_ps(out + j * 32, a0[j]);
    _mm512_storeu_ps(out + j * 32 + 16, a1[j]);
  }
}

#else
// AVX2 + FMA (no bf16 dot product): a pair's two weights share a 32-bit lane (w_k in the low
// half, w_k+1 in the high), so w_k as float32 is the lane shifted left by 16 and w_k+1 the lane
// with its low half cleared. Each row adds x_k * w_k, then x_k+1 * w_k+1, into its float32 lane
// (two FMAs), in k order, so a row's result does not depend on the
// rows beside it. The inputs come converted to float32 once a call and are broadcast from
// memory. 3 rows a block: their 12 accumulators, the pair's two weight vectors and a broadcast fit
// the 16 vector registers (4 rows spilled: bench/bench_linear.py on a Zen 3 EPYC, 64 rows over
// the default model's layers 228 ms at 4 rows a block, 175 at 3, in two scratch runs).
// More rows than a block go through the tile SPAN_PAIRS pairs (8 KB) at a time, every block of
// rows over one span before the next, so the blocks after the first read the span from L1 while
// the prefetches keep the tile streaming from memory (block after block over the whole tile, the
// stream stopped while the later blocks computed from L2).
using PackedIn = float;
constexpr int PACKED_TILE_M = 3;
constexpr int64_t SPAN_PAIRS = 64;
template <int MB, bool NTA>
__attribute__((always_inline)) inline void packed_tile(const float* x, int64_t K, const uint16_t* wt, Span sp,
                                                       float* out) {
  __m256 acc[MB][4];
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = sp.first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + j * 32 + 8 * i);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kp = sp.begin; kp < sp.end; ++kp) {
    _mm_prefetch(reinterpret_cast<const char*>(wt + (kp + PREFETCH_PAIRS) * 64), NTA ? _MM_HINT_NTA : _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wt + (kp + PREFETCH_PAIRS) * 64 + 32), NTA ? _MM_HINT_NTA : _MM_HINT_T0);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wt + kp * 64 + 16 * i));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
#pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) {
        acc[j][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + j * K + 2 * kp), we, acc[j][i]);
        acc[j][i] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + j * K + 2 * kp + 1), wo, acc[j][i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + j * 32 + 8 * i, acc[j][i]);
}
#endif

// mb (1..PACKED_TILE_M) rows of one tile: the loop unrolled for exactly mb rows
template <bool NTA, int MB = 1>
inline void packed_rows(int mb, const PackedIn* x, int64_t K, const uint16_t* wt, Span sp, float* out) {
  if constexpr (MB < PACKED_TILE_M) {
    if (mb > MB) return packed_rows<NTA, MB + 1>(mb, x, K, wt, sp, out);
  }
  packed_tile<MB, NTA>(x, K, wt, sp, out);
}

// Intel AMX (TDPBF16PS): the same packed layout read as tiles. A tile of B is 16 input pairs of
// 16 outputs, i.e. one half (64 bytes) of 16 consecutive 128-byte rows of a 32-output tile, so
// it loads with a 128-byte stride; A is up to 16 input rows of 32 values; C, 16 float32 outputs
// of each row. Each output still sums its pairs in k order into one float32 lane, and every row
// apart from the others, so a row's result does not depend on how many rows came with it.
// Why: VDPBF16PS runs at half rate on the Xeons measured (one every 2 cycles a core), which makes
// 2-16-row products partly compute-bound there (bench/bench_linear.py); a tile instruction does
// 16 x 16 x 32.
constexpr int AMX_ROWS = 16;

// GCC 11 / clang 12 brought the AMX intrinsics (the assembler needs binutils 2.36); an older
// compiler builds the module without this path, which then never runs
#ifndef EAGLE_AMX
#if !EAGLE_DPBF16  // the AVX2 build: tiles are for AVX-512 CPUs
#define EAGLE_AMX 0
#elif (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define EAGLE_AMX 1
#else
#define EAGLE_AMX 0
#endif
#endif

bool amx_supported() {  // CPUID.(7,0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE; the OS must grant the state
#if EAGLE_AMX
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

#if EAGLE_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0 / tmm1: C of the tile's two 16-output halves; tmm2: A; tmm3 / tmm4: B of the two halves
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_configure(int mb) {
  TileConfig cfg;
  for (int t : {0, 1, 2}) { cfg.rows[t] = static_cast<uint8_t>(mb); cfg.colsb[t] = 64; }
  for (int t : {3, 4}) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes: without this the other stores
  // may be dropped as dead
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile,amx-bf16"))) inline void amx_release() { _tile_release(); }

// One 32-output tile for the mb (<= AMX_ROWS, as configured) rows of x; K % 32 == 0.
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_tile(const uint16_t* x, int64_t K, const uint16_t* wt,
                                                                  float* out) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kp = 0; kp < K / 2; kp += 16) {
    for (int i = 0; i < 32; ++i)  // the next chunks of the stream: 2 KB a chunk, 4 ahead
      _mm_prefetch(reinterpret_cast<const char*>(wt + (kp + 4 * 16) * 64 + i * 32), _MM_HINT_T0);
    _tile_loadd(2, x + 2 * kp, K * 2);
    _tile_loadd(3, wt + kp * 64, 128);
    _tile_loadd(4, wt + kp * 64 + 32, 128);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, out, 128);
  _tile_stored(1, out + 16, 128);
}
#else  // never called: amx_supported() is false
inline void amx_configure(int) {}
inline void amx_release() {}
inline void amx_tile(const uint16_t*, int64_t, const uint16_t*, float*) {}
#endif

void check(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share a dtype");
  if (b) TORCH_CHECK(b->is_contiguous() && b->numel() == w.size(0) && b->scalar_type() == w.scalar_type(), "bias");
}

}  // namespace

const bool amx_available = amx_supported();  // asked once, at load
bool use_amx = amx_available;  // the process-wide switch (set_amx)

torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "w: contiguous bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 2 == 0 && K > 0, "packing needs N % 32 == 0 and even K > 0");
  // [N, K] -> [N/32, 32, K/2, 2] -> [N/32, K/2, 32, 2]
  return w.view({N / 32, 32, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({N / 32, K / 2, 64});
}

// A product's output [M, N]: `into` where the caller gives one (the decode stack's buffers,
// reused by every layer), else a new tensor; float32 for float_out, else x's dtype.
static torch::Tensor output(const torch::Tensor& x, int64_t M, int64_t N, bool float_out, const torch::Tensor* into) {
  const auto dtype = float_out ? at::kFloat : x.scalar_type();
  if (!into) return torch::empty({M, N}, x.options().dtype(dtype));
  TORCH_CHECK(into->dim() == 2 && into->size(0) == M && into->size(1) == N && into->is_contiguous() &&
              into->scalar_type() == dtype, "into: contiguous [M, N] of the output's dtype");
  return *into;
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& wp, const c10::optional<torch::Tensor>& bias,
                            bool float_out, const torch::Tensor* into = nullptr) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: contiguous bf16 [M, K]");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 64 && wp.scalar_type() == at::kBFloat16, "wp: pack_bf16 output");
  const int64_t M = x.size(0), K = wp.size(1) * 2, N = wp.size(0) * 32;
  TORCH_CHECK(x.size(1) == K, "x [M, K] does not match the packed weight's K");
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16, "bias");
  torch::Tensor y = output(x, M, N, float_out, into);
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto wpp = reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>());
  auto bp = bias ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) : nullptr;
  float* yf = float_out ? y.data_ptr<float>() : nullptr;
  uint16_t* yh = float_out ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // (only where each tile is read once: past PACKED_TILE_M rows a tile is read again per block of
  // rows, from L2, or from L1 span by span in the AVX2 loop, and should find it there)
  const bool nta = nta_streams && (stream_nta || wp.numel() * 2 > STREAM_NTA_BYTES) && M <= PACKED_TILE_M;
  // out[j][32] of a tile -> y, plus the bias, in 16-lane vectors (scalar, it took 12.4 ms of
  // 16 rows over all layers against 10.8 vectorised: scratch bench_linear runs). VCVTNEPS2BF16
  // rounds to nearest even like to_bf16 but flushes denormals to 0 and keeps a NaN's sign and
  // payload (to_bf16, which the row layout still uses, keeps denormals, NaN -> 0x7fc0).
  auto epilogue = [&](int64_t t, int64_t m, int mb, const float* out) {
    using namespace eagle_simd;
    const vf b0 = bp ? load16(reinterpret_cast<const at::BFloat16*>(bp + t * 32)) : vzero();
    const vf b1 = bp ? load16(reinterpret_cast<const at::BFloat16*>(bp + t * 32 + 16)) : vzero();
    for (int j = 0; j < mb; ++j) {
      const vf v0 = vadd(load16(out + j * 32), b0);
      const vf v1 = vadd(load16(out + j * 32 + 16), b1);
      const int64_t at = (m + j) * N + t * 32;
      if (yf) {
        store16(yf + at, v0);
        store16(yf + at + 16, v1);
      } else {
        store16(reinterpret_cast<at::BFloat16*>(yh + at), v0);
        store16(reinterpret_cast<at::BFloat16*>(yh + at + 16), v1);
      }
    }
  };
#if EAGLE_DPBF16
  const PackedIn* xin = xp;
#else
  const torch::Tensor x32 = x.to(at::kFloat);  // the AVX2 loop broadcasts float32 inputs
  const PackedIn* xin = x32.data_ptr<float>();
#endif
  // AMX tiles take up to AMX_ROWS rows a pass, the AVX-512 / AVX2 loop PACKED_TILE_M; the choice is per
  // weight (K), never per row count, so a row's result does not depend on the rows beside it
  const bool tiles = use_amx && K % 32 == 0;
  const int64_t block = tiles ? AMX_ROWS : PACKED_TILE_M;
  const int64_t K2 = K / 2, span = std::min(SPAN_PAIRS, K2);
  at::parallel_for(0, N / 32, 2, [&](int64_t t0, int64_t t1) {
    // every row's 32 sums of the tile: on the stack up to 32 rows (decode, trees, AMX's 16); a
    // tile's first span (K > 0: pack_bf16) writes them all before anything reads them
    alignas(64) float few[32 * 32];
    std::vector<float> many(M > 32 ? M * 32 : 0);
    float* out = M > 32 ? many.data() : few;
    int configured = 0;  // the rows this thread's tile configuration is for (0: none loaded)
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* wt = wpp + t * K2 * 64;
      if (tiles) {
        for (int64_t m = 0; m < M; m += block) {
          const int mb = static_cast<int>(std::min<int64_t>(block, M - m));
          if (mb != configured) amx_configure(configured = mb);
          amx_tile(xp + m * K, K, wt, out);
          epilogue(t, m, mb, out);
        }
        continue;
      }
      for (int64_t k0 = 0; k0 < K2; k0 += span)
        for (int64_t m = 0; m < M; m += block) {
          const int mb = static_cast<int>(std::min<int64_t>(block, M - m));
          const Span sp{k0, std::min(K2, k0 + span), k0 == 0};
          if (nta) packed_rows<true>(mb, xin + m * K, K, wt, sp, out + m * 32);
          else packed_rows<false>(mb, xin + m * K, K, wt, sp, out + m * 32);
        }
      for (int64_t m = 0; m < M; m += block) epilogue(t, m, static_cast<int>(std::min<int64_t>(block, M - m)), out + m * 32);
    }
    if (configured) amx_release();
  });
  return y;
}

// Int8 weights for draft heads (pack_int8): [N/64, K + 4, 64] int8. For every tile of 64 outputs,
// K rows of their 64 weights (one 64-byte line per input k), then their 64 float32 scales (256
// bytes): w[n, k] ~ q[n, k] * scale[n], symmetric, scale = max |w[n, :]| / 127 per output. A draft
// head reads its ~20 MB of weights once a draft level, from memory right after the target's
// stream; int8 halves those bytes. The products are float32: each weight widened exactly, times
// the float32 input, summed in k order, the scale applied once at the end (no input quantisation);
// or, with int8_inputs (pack_int8's VNNI layout, vnni_linear), each input row rounded to 8 bits
// as well and the products summed in int32. Drafting is a proposal only: the target verifies
// every token, so the head's rounding never reaches the output.
constexpr int INT8_TILE = 64;
#if EAGLE_DPBF16 && defined(__AVX512VNNI__)
#define EAGLE_VNNI 1
#else
#define EAGLE_VNNI 0
#endif
// Software prefetch this many inputs (64-byte lines of a tile's stream) ahead: 8 KB, as the bf16
// loop's PREFETCH_PAIRS (a draft level's weights come from memory after the target's stream);
// against 1 KB it measures the same within noise (bench/bench_kernels_ab.py).
constexpr int64_t INT8_PREFETCH_ROWS = 128;
#if EAGLE_DPBF16
constexpr int INT8_TILE_M = 4;  // 16 accumulators + 4 weight vectors of 32 registers
#else
constexpr int INT8_TILE_M = 1;  // AVX2: 8 accumulators (two halves each) of 16 registers
#endif

namespace {

template <int MB>
__attribute__((always_inline)) inline void int8_tile(const float* x, int64_t K, const int8_t* wt, float* out) {
  using namespace eagle_simd;
  vf acc[MB][4];
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* w = wt + k * INT8_TILE;
    _mm_prefetch(reinterpret_cast<const char*>(w + INT8_PREFETCH_ROWS * INT8_TILE), _MM_HINT_T0);
#if EAGLE_DPBF16
    const vf w0 = load16(w), w1 = load16(w + 16), w2 = load16(w + 32), w3 = load16(w + 48);
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      const vf xb = vset1(x[j * K + k]);
      acc[j][0] = vfmadd(xb, w0, acc[j][0]);
      acc[j][1] = vfmadd(xb, w1, acc[j][1]);
      acc[j][2] = vfmadd(xb, w2, acc[j][2]);
      acc[j][3] = vfmadd(xb, w3, acc[j][3]);
    }
#else
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const vf wi = load16(w + 16 * i);
#pragma GCC unroll 8
      for (int j = 0; j < MB; ++j) acc[j][i] = vfmadd(vset1(x[j * K + k]), wi, acc[j][i]);
    }
#endif
  }
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < 4; ++i) store16(out + j * INT8_TILE + 16 * i, acc[j][i]);
}

// tile(std::integral_constant<int, mb>{}) for a row count mb of 1..INT8_TILE_M known at compile time
template <int MB = 1, typename Tile>
inline void with_rows(int mb, Tile&& tile) {
  if constexpr (MB < INT8_TILE_M) {
    if (mb > MB) return with_rows<MB + 1>(mb, tile);
  }
  tile(std::integral_constant<int, MB>{});
}

}  // namespace

// An int8 product's epilogue: its bias (x's dtype) and its output (float32 or x's dtype).
struct Int8Out {
  float* yf;
  at::BFloat16* yh;
  const at::BFloat16* bh;
  const float* bfl;
  Int8Out(const torch::Tensor& y, const torch::Tensor& x, const c10::optional<torch::Tensor>& bias, bool float_out) {
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    yf = float_out || !bf16 ? y.data_ptr<float>() : nullptr;
    yh = yf ? nullptr : y.data_ptr<at::BFloat16>();
    bh = bias && bf16 ? bias->data_ptr<at::BFloat16>() : nullptr;
    bfl = bias && !bf16 ? bias->data_ptr<float>() : nullptr;
  }
  eagle_simd::vf bias16(int64_t at) const {
    return bh ? eagle_simd::load16(bh + at) : bfl ? eagle_simd::load16(bfl + at) : eagle_simd::vzero();
  }
  void store(int64_t at, eagle_simd::vf v) const {
    if (yf) eagle_simd::store16(yf + at, v);
    else eagle_simd::store16(yh + at, v);
  }
};

// The int8 weights' [N, K] float32 quantisation: q [N, K] int8 and scale [N] (q * scale ~ w).
static std::pair<torch::Tensor, torch::Tensor> quantize_int8_rows(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "w: bf16 or float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % INT8_TILE == 0 && K > 0, "int8 packing needs N % 64 == 0 and K > 0");
  const auto wf = w.to(at::kFloat);
  TORCH_CHECK(wf.isfinite().all().item<bool>(), "int8 packing needs finite weights (a NaN / inf has no scale)");
  auto scale = wf.abs().amax({1}).div(127.0);
  scale = torch::where(scale > 0, scale, torch::ones_like(scale));  // an all-zero row: zeros, scale 1
  return {wf.div(scale.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar), scale};
}

// Two layouts. The float-input layout, [N/64, K + 4, 64] int8: for every tile of 64 outputs, K
// rows of their 64 weights (one 64-byte line per input k), then their 64 float32 scales (256
// bytes). The VNNI layout (int8 inputs too), [N/64, Kp/4 + 3, 256] int8 with Kp = K rounded up
// to a multiple of 4 (zero weights past K): for every tile of 64 outputs and every group of 4
// inputs, each output's 4 weights side by side (one 32-bit lane of VPDPBUSD: 64 outputs, 4 zmm
// registers), then three 256-byte rows: the 64 float32 scales, the 64 int32 sums of each
// output's weights (for the +128 offset of the unsigned inputs), and K (an int32 at the row's start).
torch::Tensor pack_int8(torch::Tensor w, bool int8_inputs) {
  TORCH_CHECK(!int8_inputs || EAGLE_VNNI, "int8 inputs need the AVX512-VNNI build of the kernels");
  auto [q, scale] = quantize_int8_rows(w);
  const int64_t N = q.size(0), K = q.size(1), T = N / INT8_TILE;
  if (!int8_inputs) {
    const auto body = q.view({T, INT8_TILE, K}).permute({0, 2, 1});  // [N/64, K, 64]
    const auto scales = scale.view({T, INT8_TILE}).contiguous().view(at::kChar).view({T, 4, INT8_TILE});
    return torch::cat({body, scales}, 1).contiguous();
  }
  const int64_t Kp = (K + 3) / 4 * 4;
  if (Kp != K) q = torch::cat({q, torch::zeros({N, Kp - K}, q.options())}, 1);
  // [T, 64, Kp/4, 4] -> [T, Kp/4, 64, 4]
  const auto body = q.view({T, INT8_TILE, Kp / 4, 4}).permute({0, 2, 1, 3}).reshape({T, Kp / 4, 4 * INT8_TILE});
  const auto scales = scale.view({T, 1, INT8_TILE}).contiguous().view(at::kChar);
  const auto sums = q.to(at::kInt).sum(1).to(at::kInt).view({T, 1, INT8_TILE}).contiguous().view(at::kChar);
  auto k_row = torch::zeros({T, 1, 4 * INT8_TILE}, q.options());
  const int32_t k32 = static_cast<int32_t>(K);
  for (int64_t t = 0; t < T; ++t) std::memcpy(k_row.data_ptr<int8_t>() + t * 4 * INT8_TILE, &k32, 4);
  return torch::cat({body, scales, sums, k_row}, 1).contiguous();
}

static bool is_vnni_layout(const torch::Tensor& wq) {
  return wq.dim() == 3 && wq.scalar_type() == at::kChar && wq.size(2) == 4 * INT8_TILE && wq.size(1) > 3;
}

// The inputs K of a pack_int8 tensor (either layout).
int64_t int8_in_features(const torch::Tensor& wq) {
  if (!is_vnni_layout(wq)) return wq.size(1) - 4;
  int32_t k;
  std::memcpy(&k, wq.data_ptr<int8_t>() + (wq.size(1) - 1) * 4 * INT8_TILE, 4);
  return k;
}

// The float32 [N, K] weights a pack_int8 tensor stands for (q * scale): tests and checks.
torch::Tensor unpack_int8(torch::Tensor wq) {
  TORCH_CHECK(wq.dim() == 3 && wq.scalar_type() == at::kChar && wq.is_contiguous(), "wq: pack_int8 output");
  const int64_t T = wq.size(0);
  if (is_vnni_layout(wq)) {
    const int64_t G = wq.size(1) - 3, K = int8_in_features(wq);
    const auto q = wq.narrow(1, 0, G).reshape({T, G, INT8_TILE, 4}).permute({0, 2, 1, 3}).reshape({T, INT8_TILE, 4 * G});
    const auto scale = wq.narrow(1, G, 1).contiguous().view(at::kFloat).view({T, INT8_TILE, 1});
    return q.to(at::kFloat).mul(scale).reshape({T * INT8_TILE, 4 * G}).narrow(1, 0, K).contiguous();
  }
  TORCH_CHECK(wq.size(2) == INT8_TILE && wq.size(1) > 4, "wq: pack_int8 output");
  const int64_t K = wq.size(1) - 4;
  const auto q = wq.narrow(1, 0, K).to(at::kFloat);  // [T, K, 64]
  const auto scale = wq.narrow(1, K, 4).contiguous().view(at::kFloat).view({T, 1, INT8_TILE});
  return q.mul(scale).permute({0, 2, 1}).reshape({T * INT8_TILE, K});
}

#if EAGLE_VNNI
namespace {
// acc[j][i] += sum over the tile's groups of 4 inputs of u8 x (row j) times s8 w (outputs 16i..16i+15)
template <int MB>
__attribute__((always_inline)) inline void vnni_tile(const uint8_t* xq, int64_t Kp, const int8_t* wt, __m512i* out) {
  __m512i acc[MB][4];
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm512_setzero_si512();
  for (int64_t g = 0; g < Kp / 4; ++g) {
    const int8_t* w = wt + g * 4 * INT8_TILE;
    for (int c = 0; c < 4; ++c)  // 8 KB ahead, as the other loops
      _mm_prefetch(reinterpret_cast<const char*>(w + INT8_PREFETCH_ROWS * INT8_TILE + 64 * c), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64), w2 = _mm512_loadu_si512(w + 128),
                  w3 = _mm512_loadu_si512(w + 192);
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      int32_t four;
      std::memcpy(&four, xq + j * Kp + 4 * g, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      acc[j][0] = _mm512_dpbusd_epi32(acc[j][0], xb, w0);
      acc[j][1] = _mm512_dpbusd_epi32(acc[j][1], xb, w1);
      acc[j][2] = _mm512_dpbusd_epi32(acc[j][2], xb, w2);
      acc[j][3] = _mm512_dpbusd_epi32(acc[j][3], xb, w3);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < 4; ++i) out[j * 4 + i] = acc[j][i];
}
}  // namespace

// int8 x int8 products (AVX512-VNNI): each input row is quantised to 8 bits too, symmetric with
// its own scale (max |x| / 127, +128 for VPDPBUSD's unsigned operand, the weights' sums taking
// the offset back out), so a group of 4 inputs and 16 outputs is one instruction instead of four
// FMAs and the widening of the weights. A draft proposes only (the target verifies every token),
// so this rounding reaches how many drafts are accepted, never the output.
static torch::Tensor vnni_linear(const torch::Tensor& x, const torch::Tensor& wq, const c10::optional<torch::Tensor>& bias,
                                 bool float_out, const torch::Tensor* into) {
  const int64_t M = x.size(0), K = int8_in_features(wq), G = wq.size(1) - 3, Kp = 4 * G, N = wq.size(0) * INT8_TILE;
  TORCH_CHECK(x.size(1) == K, "x [M, K] does not match the int8 weight's K");
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(), "bias");
  torch::Tensor y = output(x, M, N, float_out, into);
  if (M == 0) return y;
  // the inputs as unsigned bytes (q + 128, q = nearest of x / sx in [-127, 127]; 128 past K),
  // read in x's own dtype (a float32 copy was one more ATen op a product, run cold in a draft)
  const torch::Tensor xc = x.contiguous();
  std::vector<uint8_t> xq(M * Kp, 128);
  std::vector<float> sx(M);
  auto quantize = [&](auto* xp) {
    for (int64_t m = 0; m < M; ++m) {
      const auto* r = xp + m * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(r[k])));
      sx[m] = amax > 0.f ? amax / 127.f : 0.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      uint8_t* o = xq.data() + m * Kp;
      for (int64_t k = 0; k < K; ++k) {
        const float v = static_cast<float>(r[k]) * inv;  // (a NaN input counts as 0: the draft is a proposal either way)
        o[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(v == v ? std::min(std::max(v, -127.f), 127.f) : 0.f)) + 128);
      }
    }
  };
  if (xc.scalar_type() == at::kBFloat16) quantize(xc.data_ptr<at::BFloat16>());
  else quantize(xc.data_ptr<float>());
  const int8_t* wp = wq.data_ptr<int8_t>();
  const Int8Out io(y, x, bias, float_out);
  at::parallel_for(0, N / INT8_TILE, 1, [&](int64_t t0, int64_t t1) {
    using namespace eagle_simd;
    alignas(64) __m512i acc[INT8_TILE_M * 4];
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* wt = wp + t * (G + 3) * 4 * INT8_TILE;
      const float* scale = reinterpret_cast<const float*>(wt + G * 4 * INT8_TILE);
      const int32_t* sums = reinterpret_cast<const int32_t*>(wt + (G + 1) * 4 * INT8_TILE);
      vf sc[4], b[4];
      __m512i off[4];
      for (int i = 0; i < 4; ++i) {
        sc[i] = load16(scale + 16 * i);
        off[i] = _mm512_slli_epi32(_mm512_loadu_si512(sums + 16 * i), 7);  // 128 x the weights' sum
        b[i] = io.bias16(t * INT8_TILE + 16 * i);
      }
      for (int64_t m = 0; m < M; m += INT8_TILE_M) {
        const int mb = static_cast<int>(std::min<int64_t>(INT8_TILE_M, M - m));
        with_rows(mb, [&](auto rows) { vnni_tile<decltype(rows)::value>(xq.data() + m * Kp, Kp, wt, acc); });
        for (int j = 0; j < mb; ++j) {
          const vf s = vset1(sx[m + j]);
          for (int i = 0; i < 4; ++i) {
            const vf dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[j * 4 + i], off[i]));
            const vf v = vfmadd(dot, vmul(sc[i], s), b[i]);
            const int64_t at = (m + j) * N + t * INT8_TILE + 16 * i;
            io.store(at, v);
          }
        }
      }
    }
  });
  return y;
}
#endif

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& wq, const c10::optional<torch::Tensor>& bias,
                          bool float_out, const torch::Tensor* into = nullptr) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: bf16 or float32 [M, K]");
  if (is_vnni_layout(wq)) {
#if EAGLE_VNNI
    TORCH_CHECK(wq.is_contiguous(), "wq: pack_int8 output");
    return vnni_linear(x, wq, bias, float_out, into);
#else
    TORCH_CHECK(false, "int8 inputs need the AVX512-VNNI build of the kernels");
#endif
  }
  TORCH_CHECK(wq.dim() == 3 && wq.scalar_type() == at::kChar && wq.size(2) == INT8_TILE && wq.size(1) > 4 &&
              wq.is_contiguous(), "wq: pack_int8 output");
  const int64_t M = x.size(0), K = wq.size(1) - 4, N = wq.size(0) * INT8_TILE;
  TORCH_CHECK(x.size(1) == K, "x [M, K] does not match the int8 weight's K");
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(), "bias");
  torch::Tensor y = output(x, M, N, float_out, into);
  if (M == 0) return y;
  const torch::Tensor x32 = x.to(at::kFloat).contiguous();  // broadcast from memory, one input at a time
  const float* xp = x32.data_ptr<float>();
  const int8_t* wp = wq.data_ptr<int8_t>();
  const Int8Out io(y, x, bias, float_out);
  at::parallel_for(0, N / INT8_TILE, 1, [&](int64_t t0, int64_t t1) {
    using namespace eagle_simd;
    alignas(64) float out[INT8_TILE_M * INT8_TILE];
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* wt = wp + t * (K + 4) * INT8_TILE;
      const float* scale = reinterpret_cast<const float*>(wt + K * INT8_TILE);
      vf sc[4], b[4];
      for (int i = 0; i < 4; ++i) {
        sc[i] = load16(scale + 16 * i);
        b[i] = io.bias16(t * INT8_TILE + 16 * i);
      }
      for (int64_t m = 0; m < M; m += INT8_TILE_M) {
        const int mb = static_cast<int>(std::min<int64_t>(INT8_TILE_M, M - m));
        with_rows(mb, [&](auto rows) { int8_tile<decltype(rows)::value>(xp + m * K, K, wt, out); });
        for (int j = 0; j < mb; ++j)
          for (int i = 0; i < 4; ++i) {
            const vf v = vfmadd(load16(out + j * INT8_TILE + 16 * i), sc[i], b[i]);
            const int64_t at = (m + j) * N + t * INT8_TILE + 16 * i;
            io.store(at, v);
          }
      }
    }
  });
  return y;
}

bool is_gguf_weight(const torch::Tensor& w);
torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                          bool float_out, const torch::Tensor* into);

torch::Tensor skinny_linear_into(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                                bool float_out, const torch::Tensor* into) {
  if (is_gguf_weight(w)) return gguf_linear(x, w, bias, float_out, into);  // engine/quant.py's packed GGUF blocks
  if (w.dim() == 3 && w.scalar_type() == at::kChar) return int8_linear(x, w, bias, float_out, into);  // pack_int8's layout
  if (w.dim() == 3) return packed_linear(x, w, bias, float_out, into);  // pack_bf16's layout
  check(x, w, bias);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  // float_out keeps the float32 accumulator instead of rounding to bf16 (the LM head: rounding
  // logits of ~25 to bf16 steps of 0.125 would manufacture exact ties)
  torch::Tensor y = output(x, M, N, float_out, into);
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
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M; ++m)  // the row is in L1 after the first input row
          put(m, n, dot_bf16(xp + m * K, wp + n * K, K));
    });
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

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool float_out) {
  return skinny_linear_into(x, w, bias, float_out, nullptr);
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_gather,
                              torch::Tensor kv_lens, torch::Tensor q_seq, torch::Tensor q_row, torch::Tensor mask,
                              double scale);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor rms_norm_chunks(torch::Tensor x, int64_t n, double eps);
torch::Tensor argmax_rows(torch::Tensor x);
std::vector<torch::Tensor> topk_log_softmax(torch::Tensor x, int64_t k, torch::Tensor d2t);
void register_decode_stack(pybind11::module& m);
void register_gguf(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_bf16", &pack_bf16, "bf16 weight [N, K] -> the packed layout skinny_linear also takes");
  m.def("pack_int8", &pack_int8, "weight [N, K] -> int8 weights and per-output scales, a layout skinny_linear takes "
        "(int8_inputs: products round each input row to 8 bits too, AVX512-VNNI)",
        py::arg("w"), py::arg("int8_inputs") = false);
  m.def("unpack_int8", &unpack_int8, "pack_int8 output -> the float32 [N, K] weights it stands for");
  m.def("int8_inputs_available", []() { return static_cast<bool>(EAGLE_VNNI); },
        "whether pack_int8 takes int8_inputs (the AVX512-VNNI build)");
  m.def("skinny_linear", &skinny_linear, "y = x @ w.T (+ bias) for few rows of x (w [N, K] or pack_bf16(w))",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("float_out") = false);
  m.def("paged_attention", &paged_attention, "attention of few queries over block-table slots");
  m.def("add_rms_norm", &add_rms_norm, "x += delta; return rms_norm(x) * weight");
  m.def("argmax_rows", &argmax_rows, "per row of float32 [R, V], max(-1).indices (first index; NaN propagates)");
  m.def("topk_log_softmax", &topk_log_softmax,
        "per row of float32 [R, V], the k best log_softmax values (descending, ties by index) and their indices "
        "(through d2t [V] where non-empty)", py::arg("x"), py::arg("k"), py::arg("d2t"));
  m.def("rms_norm_chunks", &rms_norm_chunks, "each of n equal chunks of every row RMS-normalised, no weight");
  m.def("set_nta_streams", [](bool on) { nta_streams = on; },
        "stream large weights with non-temporal prefetches (default: on AMD CPUs only)");
  m.def("nta_streams", []() { return nta_streams; }, "whether large weights stream non-temporally");
  m.def("set_amx", [](bool on) { TORCH_CHECK(!on || amx_available, "this CPU (or OS) has no AMX"); use_amx = on; },
        "packed bf16 products through AMX tiles (default: where the CPU and OS have them)");
  m.def("amx", []() { return use_amx; }, "whether packed bf16 products use AMX tiles");
  register_decode_stack(m);
  register_gguf(m);
}
