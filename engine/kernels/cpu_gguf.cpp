// Products with GGUF block-quantized weights (llama.cpp's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), kept in
// their block formats: a decode step streams the file's bytes, not a bf16 copy of them.
//
// A weight is one uint8 tensor (engine/quant.py packs it): a 128-byte header of int64s
//   [MAGIC, N, K, segments, (ggml type, rows, byte offset) x up to 4]
// then the segments' rows, each in its GGUF block layout. Segments stack along N, so a fused
// q/k/v (or gate/up) whose parts were quantized to different types (Q4_K_M's Q6_K value rows)
// is still one weight.
//
// Weights are decoded to float32 (the exact value d * scale * q + offset llama.cpp's
// dequantize_row_* computes) and multiplied into the inputs in float32 (`row_products` in the
// AVX-512 build; in the AVX2 one a row dequantized, then a dot product per input row): a row's
// result does not depend on how many rows share the call, and it differs from a float64 product
// with the dequantized weights only by accumulation order (tests/test_quant.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "simd.h"
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t MAGIC = 0x31544e5146474745;  // "EGGFQNT1" little-endian
constexpr int64_t HEADER_BYTES = 128;
constexpr int MAX_SEGMENTS = 4;
// ggml type ids
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14;

struct BlockType {
  int64_t elements, bytes;
};

constexpr int64_t block_bytes(int64_t type) {
  return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : type == Q4_K ? 144 : 210;
}

BlockType block_type(int64_t type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK(false, "GGUF block type ", type, " has no native kernel");
  }
  return {0, 0};
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

struct Segment {
  int64_t type, rows, first_row, row_bytes;
  const uint8_t* data;
};

struct Weight {
  int64_t N = 0, K = 0;
  std::vector<Segment> segs;
};

Weight parse(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() >= HEADER_BYTES,
              "w: a packed GGUF weight (engine/quant.py)");
  const auto* base = w.data_ptr<uint8_t>();
  int64_t h[HEADER_BYTES / 8];
  std::memcpy(h, base, HEADER_BYTES);
  TORCH_CHECK(h[0] == MAGIC && h[3] >= 1 && h[3] <= MAX_SEGMENTS, "w: not a packed GGUF weight");
  Weight out;
  out.N = h[1];
  out.K = h[2];
  int64_t row = 0;
  for (int64_t s = 0; s < h[3]; ++s) {
    const int64_t type = h[4 + 3 * s], rows = h[5 + 3 * s], offset = h[6 + 3 * s];
    const BlockType bt = block_type(type);
    TORCH_CHECK(out.K % bt.elements == 0, "w: K is not a multiple of the block size");
    const int64_t row_bytes = out.K / bt.elements * bt.bytes;
    TORCH_CHECK(offset >= HEADER_BYTES && offset + rows * row_bytes <= w.numel(), "w: segment out of bounds");
    out.segs.push_back({type, rows, row, row_bytes, base + offset});
    row += rows;
  }
  TORCH_CHECK(row == out.N, "w: segments do not add up to N rows");
  return out;
}

// row n's bytes and type
inline const uint8_t* row_of(const Weight& w, int64_t n, int64_t& type) {
  for (const auto& s : w.segs)
    if (n < s.first_row + s.rows) {
      type = s.type;
      return s.data + (n - s.first_row) * s.row_bytes;
    }
  return nullptr;
}

// 6-bit scale and min j of a Q4_K super-block's 12 scale bytes (llama.cpp's get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Scalar dequantization of whole blocks (llama.cpp's dequantize_row_*): the AVX2 build's, and the
// AVX-512 build's for a row's last 32 weights where K is not a multiple of 64.
void dequant_q8_0(const uint8_t* p, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += 32, p += 34) {
    const float d = half(p);
    for (int i = 0; i < 32; ++i) out[k + i] = d * static_cast<float>(static_cast<int8_t>(p[2 + i]));
  }
}

// Q4_0 (w = d * (q - 8)) and Q4_1 (w = d * q + m): element i of a block is the low nibble of
// byte i, element 16 + i its high nibble
template <bool with_min>
void dequant_q4(const uint8_t* p, int64_t K, float* out) {
  constexpr int64_t bytes = with_min ? 20 : 18, qs = with_min ? 4 : 2;
  for (int64_t k = 0; k < K; k += 32, p += bytes) {
    const float d = half(p), b = with_min ? half(p + 2) : -8.f * d;
    for (int i = 0; i < 16; ++i) {
      out[k + i] = d * static_cast<float>(p[qs + i] & 0xF) + b;
      out[k + 16 + i] = d * static_cast<float>(p[qs + i] >> 4) + b;
    }
  }
}

// Q4_K: 256 weights in 8 sub-blocks of 32, w = d * sc_j * q - dmin * m_j; bytes 32c..32c+31 of
// qs hold sub-block 2c in their low nibbles, 2c + 1 in their high ones
void dequant_q4_k(const uint8_t* p, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += 256, p += 144) {
    const float d = half(p), dmin = half(p + 2);
    for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1;
      scale_min_k4(2 * c, p + 4, sc0, m0);
      scale_min_k4(2 * c + 1, p + 4, sc1, m1);
      const float a0 = d * sc0, b0 = -dmin * m0, a1 = d * sc1, b1 = -dmin * m1;
      const uint8_t* q = p + 16 + 32 * c;
      for (int i = 0; i < 32; ++i) {
        out[k + 64 * c + i] = a0 * static_cast<float>(q[i] & 0xF) + b0;
        out[k + 64 * c + 32 + i] = a1 * static_cast<float>(q[i] >> 4) + b1;
      }
    }
  }
}

// Q6_K: 256 weights, w = d * sc[e / 16] * (q - 32), q 6 bits: its low 4 in ql, its high 2 in
// qh. Per half of 128: element l (< 32) has ql[l] low, qh[l] bits 0-1; 32 + l: ql[32 + l] low,
// qh[l] bits 2-3; 64 + l: ql[l] high, bits 4-5; 96 + l: ql[32 + l] high, bits 6-7
void dequant_q6_k(const uint8_t* p, int64_t K, float* out) {
  for (int64_t k = 0; k < K; k += 256, p += 210) {
    const float d = half(p + 208);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = p + 64 * h;
      const uint8_t* qh = p + 128 + 32 * h;
      const auto* s = reinterpret_cast<const int8_t*>(p + 192) + 8 * h;
      float* o = out + k + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const int q1 = (ql[l] & 0xF) | ((qh[l] & 3) << 4), q2 = (ql[32 + l] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        const int q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), q4 = (ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4);
        const int is = l / 16;
        o[l] = d * s[is] * static_cast<float>(q1 - 32);
        o[32 + l] = d * s[is + 2] * static_cast<float>(q2 - 32);
        o[64 + l] = d * s[is + 4] * static_cast<float>(q3 - 32);
        o[96 + l] = d * s[is + 6] * static_cast<float>(q4 - 32);
      }
    }
  }
}

void dequant_scalar(int64_t type, const uint8_t* p, int64_t K, float* out) {
  switch (type) {
    case Q8_0: return dequant_q8_0(p, K, out);
    case Q4_0: return dequant_q4<false>(p, K, out);
    case Q4_1: return dequant_q4<true>(p, K, out);
    case Q4_K: return dequant_q4_k(p, K, out);
    case Q6_K: return dequant_q6_k(p, K, out);
    default: TORCH_CHECK(false, "GGUF block type ", type, " has no native kernel");
  }
}


#if EAGLE_DPBF16
// The AVX-512 build multiplies a weight row at a time, its blocks decoded into registers: 64
// weights as four vectors of 16 floats, each multiplied into up to MB input rows; a thread's rows
// are one sequential stream, read PREFETCH_BYTES ahead.
constexpr int64_t PREFETCH_BYTES = 2048;

// A block's scales: for the K-quants a super-block's (decoded once for its 8 sub-blocks of 32)
struct Scales {
  float a[16], o[16];  // per 16 weights: w = a * q + o
};

template <int64_t TYPE>
inline void scales(const uint8_t* row, int64_t sb, Scales& sc) {  // super-block sb (K-quants)
  if constexpr (TYPE == Q4_K) {
    const uint8_t* p = row + sb * 144;
    const float d = half(p), dmin = half(p + 2);
    for (int j = 0; j < 8; ++j) {
      int s, m;
      scale_min_k4(j, p + 4, s, m);
      sc.a[2 * j] = sc.a[2 * j + 1] = d * s;
      sc.o[2 * j] = sc.o[2 * j + 1] = -dmin * m;
    }
  } else if constexpr (TYPE == Q6_K) {  // per 16 weights in order: sc[e / 16]
    const uint8_t* p = row + sb * 210;
    const float d = half(p + 208);
    const auto* s = reinterpret_cast<const int8_t*>(p + 192);
    for (int i = 0; i < 16; ++i) {
      sc.a[i] = d * s[i];
      sc.o[i] = -32.f * sc.a[i];
    }
  }
}

inline __m512i u8_lanes(const uint8_t* p) {  // 16 bytes -> 16 int32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 nib(__m512i v, int shift) {  // a nibble of each lane, as float
  return _mm512_cvtepi32_ps(_mm512_and_si512(shift ? _mm512_srli_epi32(v, 4) : v, _mm512_set1_epi32(0xF)));
}

// weights 64u..64u+63 of a row as four vectors of 16 (for the K-quants the super-block's scales
// are in `sc`)
template <int64_t TYPE>
inline void decode(const uint8_t* row, int64_t u, const Scales& sc, __m512* w) {
  if constexpr (TYPE == Q8_0) {
    for (int i = 0; i < 2; ++i) {
      const uint8_t* p = row + (2 * u + i) * 34;
      const __m512 d = _mm512_set1_ps(half(p));
      w[2 * i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)))));
      w[2 * i + 1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18)))));
    }
  } else if constexpr (TYPE == Q4_0 || TYPE == Q4_1) {
    constexpr int64_t bytes = TYPE == Q4_1 ? 20 : 18, qs = TYPE == Q4_1 ? 4 : 2;
    for (int i = 0; i < 2; ++i) {
      const uint8_t* p = row + (2 * u + i) * bytes;
      const float dv = half(p);
      const __m512 d = _mm512_set1_ps(dv), m = _mm512_set1_ps(TYPE == Q4_1 ? half(p + 2) : -8.f * dv);
      const __m512i q = u8_lanes(p + qs);
      w[2 * i] = _mm512_fmadd_ps(d, nib(q, 0), m);
      w[2 * i + 1] = _mm512_fmadd_ps(d, nib(q, 4), m);
    }
  } else if constexpr (TYPE == Q4_K) {  // chunk c = u % 4: qs[32c..] low nibbles sub-block 2c, high 2c + 1
    const int c = static_cast<int>(u & 3);
    const uint8_t* q = row + (u >> 2) * 144 + 16 + 32 * c;
    const __m512i v0 = u8_lanes(q), v1 = u8_lanes(q + 16);
    const __m512 a0 = _mm512_set1_ps(sc.a[4 * c]), o0 = _mm512_set1_ps(sc.o[4 * c]);
    const __m512 a1 = _mm512_set1_ps(sc.a[4 * c + 2]), o1 = _mm512_set1_ps(sc.o[4 * c + 2]);
    w[0] = _mm512_fmadd_ps(a0, nib(v0, 0), o0);
    w[1] = _mm512_fmadd_ps(a0, nib(v1, 0), o0);
    w[2] = _mm512_fmadd_ps(a1, nib(v0, 4), o1);
    w[3] = _mm512_fmadd_ps(a1, nib(v1, 4), o1);
  } else {  // Q6_K: half h, u2 = u % 2: sub-blocks g = 2 u2 + t (t = 0, 1) read ql[32t + l] nibble u2, qh[l] bits 2g
    const uint8_t* p = row + (u >> 2) * 210;
    const int h = static_cast<int>((u >> 1) & 1), u2 = static_cast<int>(u & 1);
    const uint8_t* ql = p + 64 * h;
    const uint8_t* qh = p + 128 + 32 * h;
    const __m512i lo2 = _mm512_set1_epi32(0x3);
    for (int i = 0; i < 2; ++i) {  // l in 16i..16i+15
      const __m512i hb = u8_lanes(qh + 16 * i);
      for (int t = 0; t < 2; ++t) {
        const int g = 2 * u2 + t;
        const __m512i l = u8_lanes(ql + 32 * t + 16 * i);
        const __m512i lo = _mm512_and_si512(u2 ? _mm512_srli_epi32(l, 4) : l, _mm512_set1_epi32(0xF));
        const __m512i q = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 2 * g), lo2), 4));
        const int e = 8 * h + 2 * g + i;  // weights 16e..16e+15 of the super-block
        w[2 * t + i] = _mm512_fmadd_ps(_mm512_set1_ps(sc.a[e]), _mm512_cvtepi32_ps(q), _mm512_set1_ps(sc.o[e]));
      }
    }
  }
}

template <int64_t TYPE, int MB>
void row_products(const uint8_t* row, int64_t K, const float* x, int64_t ldx, float* out) {
  constexpr bool k_quant = TYPE == Q4_K || TYPE == Q6_K;
  constexpr int NA = 2;  // accumulators a row (the same for every MB: a row's sum must not depend on M)
  __m512 acc[MB][NA];
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NA; ++i) acc[j][i] = _mm512_setzero_ps();
  Scales sc;
  constexpr int64_t per_block = TYPE == Q4_K || TYPE == Q6_K ? 256 : 32;
  const char* ahead = reinterpret_cast<const char*>(row) + PREFETCH_BYTES;
  for (int64_t u = 0; u < K / 64; ++u) {
    // the bytes PREFETCH_BYTES past this unit's (the next rows follow this one in memory: the
    // stream runs on into them); a unit is at most 68 bytes, two lines cover it
    const char* p = ahead + u * 64 * block_bytes(TYPE) / per_block;
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 63, _MM_HINT_T0);
    if (k_quant && (u & 3) == 0) scales<TYPE>(row, u >> 2, sc);
    __m512 w[4];
    decode<TYPE>(row, u, sc, w);
#pragma GCC unroll 8
    for (int j = 0; j < MB; ++j) {
      const float* xu = x + j * ldx + 64 * u;
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[j][i % NA] = _mm512_fmadd_ps(w[i], _mm512_loadu_ps(xu + 16 * i), acc[j][i % NA]);
    }
  }
  if (K % 64) {  // a last block of 32 (the 32-weight types)
    alignas(64) float tail[32];
    const int64_t last = K / 32 - 1;
    dequant_scalar(TYPE, row + last * block_type(TYPE).bytes, 32, tail);
    for (int j = 0; j < MB; ++j)
      for (int i = 0; i < 2; ++i)
        acc[j][i] = _mm512_fmadd_ps(_mm512_load_ps(tail + 16 * i), _mm512_loadu_ps(x + j * ldx + 32 * last + 16 * i), acc[j][i]);
  }
  for (int j = 0; j < MB; ++j) {
    __m512 t = acc[j][0];
    for (int i = 1; i < NA; ++i) t = _mm512_add_ps(t, acc[j][i]);
    out[j] = _mm512_reduce_add_ps(t);
  }
}

template <int64_t TYPE>
void row_products_any(const uint8_t* row, int64_t K, const float* x, int64_t M, float* out) {
  constexpr int MAXB = 8;
  for (int64_t m = 0; m < M; m += MAXB) {
    const float* xm = x + m * K;
    float* o = out + m;
    switch (std::min<int64_t>(MAXB, M - m)) {
      case 1: row_products<TYPE, 1>(row, K, xm, K, o); break;
      case 2: row_products<TYPE, 2>(row, K, xm, K, o); break;
      case 3: row_products<TYPE, 3>(row, K, xm, K, o); break;
      case 4: row_products<TYPE, 4>(row, K, xm, K, o); break;
      case 5: row_products<TYPE, 5>(row, K, xm, K, o); break;
      case 6: row_products<TYPE, 6>(row, K, xm, K, o); break;
      case 7: row_products<TYPE, 7>(row, K, xm, K, o); break;
      default: row_products<TYPE, 8>(row, K, xm, K, o); break;
    }
  }
}

// out[m] = row . x[m] for m < M
void row_dots(int64_t type, const uint8_t* row, int64_t K, const float* x, int64_t M, float* out) {
  switch (type) {
    case Q8_0: return row_products_any<Q8_0>(row, K, x, M, out);
    case Q4_0: return row_products_any<Q4_0>(row, K, x, M, out);
    case Q4_1: return row_products_any<Q4_1>(row, K, x, M, out);
    case Q4_K: return row_products_any<Q4_K>(row, K, x, M, out);
    case Q6_K: return row_products_any<Q6_K>(row, K, x, M, out);
    default: TORCH_CHECK(false, "GGUF block type ", type, " has no native kernel");
  }
}

template <int64_t TYPE>
void dequant_units(const uint8_t* row, int64_t K, float* out) {  // decode's vectors, stored
  Scales sc;
  for (int64_t u = 0; u < K / 64; ++u) {
    if ((TYPE == Q4_K || TYPE == Q6_K) && (u & 3) == 0) scales<TYPE>(row, u >> 2, sc);
    __m512 w[4];
    decode<TYPE>(row, u, sc, w);
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + 64 * u + 16 * i, w[i]);
  }
  if (K % 64) dequant_scalar(TYPE, row + (K / 32 - 1) * block_type(TYPE).bytes, 32, out + K - 32);
}
#endif

// a weight row dequantized to float32 [K]
void dequant_row(int64_t type, const uint8_t* p, int64_t K, float* out) {
#if EAGLE_DPBF16
  switch (type) {
    case Q8_0: return dequant_units<Q8_0>(p, K, out);
    case Q4_0: return dequant_units<Q4_0>(p, K, out);
    case Q4_1: return dequant_units<Q4_1>(p, K, out);
    case Q4_K: return dequant_units<Q4_K>(p, K, out);
    case Q6_K: return dequant_units<Q6_K>(p, K, out);
    default: TORCH_CHECK(false, "GGUF block type ", type, " has no native kernel");
  }
#else
  dequant_scalar(type, p, K, out);
#endif
}

#if !EAGLE_DPBF16
inline float dot(const float* x, const float* w, int64_t K) {  // (K a multiple of 32)
  using namespace eagle_simd;
  vf a0 = vzero(), a1 = vzero();
  for (int64_t k = 0; k < K; k += 2 * VL) {
    a0 = vfmadd(load16(x + k), load16(w + k), a0);
    a1 = vfmadd(load16(x + k + VL), load16(w + k + VL), a1);
  }
  return vsum(vadd(a0, a1));
}
#endif

}  // namespace

int64_t gguf_in_features(const torch::Tensor& w) { return parse(w).K; }

bool is_gguf_weight(const torch::Tensor& w) { return w.dim() == 1 && w.scalar_type() == at::kByte; }

torch::Tensor gguf_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                          bool float_out, const torch::Tensor* into) {
  const Weight wt = parse(w);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == wt.K && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: bf16 or float32 [M, K] matching the weight's K");
  const int64_t M = x.size(0), N = wt.N, K = wt.K;
  torch::Tensor b32;
  if (bias) {
    TORCH_CHECK(bias->numel() == N, "bias: N values");
    b32 = bias->to(at::kFloat).contiguous();
  }
  const auto dtype = float_out ? at::kFloat : x.scalar_type();
  torch::Tensor y;
  if (into) {
    TORCH_CHECK(into->dim() == 2 && into->size(0) == M && into->size(1) == N && into->is_contiguous() &&
                into->scalar_type() == dtype, "into: contiguous [M, N] of the output's dtype");
    y = *into;
  } else {
    y = torch::empty({M, N}, x.options().dtype(dtype));
  }
  if (M == 0 || N == 0) return y;
  const torch::Tensor x32 = x.to(at::kFloat).contiguous();
  const float* xp = x32.data_ptr<float>();
  const float* bp = bias ? b32.data_ptr<float>() : nullptr;
  float* yf = dtype == at::kFloat ? y.data_ptr<float>() : nullptr;
  auto* yh = dtype == at::kFloat ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    // denormal inputs treated as zero, denormal results flushed to zero (MXCSR DAZ | FTZ), as the
    // bf16 dot products of the dense path do: a denormal operand costs an FMA ~100 cycles, and a
    // real model's activations hold some
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    std::vector<float> out(M);
#if !EAGLE_DPBF16
    std::vector<float> buf(K);  // the AVX2 build: a row dequantized, then a dot product per input row
#endif
    for (int64_t n = n0; n < n1; ++n) {
      int64_t type = 0;
      const uint8_t* row = row_of(wt, n, type);
#if EAGLE_DPBF16
      row_dots(type, row, K, xp, M, out.data());
#else
      dequant_row(type, row, K, buf.data());
      for (int64_t m = 0; m < M; ++m) out[m] = dot(xp + m * K, buf.data(), K);
#endif
      const float b = bp ? bp[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) {
        const float v = out[m] + b;
        if (yf) yf[m * N + n] = v; else yh[m * N + n] = eagle_simd::to_bf16(v);
      }
    }
    _mm_setcsr(csr);
  });
  return y;
}

// rows `ids` of the weight, dequantized: float32 [len(ids), K] (an embedding lookup)
torch::Tensor gguf_rows(torch::Tensor w, torch::Tensor ids) {
  const Weight wt = parse(w);
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids: int64");
  const torch::Tensor idc = ids.contiguous();
  const int64_t T = idc.numel(), K = wt.K;
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < wt.N, "gguf_rows: row id out of range");
  torch::Tensor out = torch::empty({T, K}, torch::dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t type = 0;
      const uint8_t* row = row_of(wt, ip[t], type);
      dequant_row(type, row, K, op + t * K);
    }
  });
  return out;
}

torch::Tensor gguf_dequantize(torch::Tensor w) {
  const Weight wt = parse(w);
  return gguf_rows(w, torch::arange(wt.N, torch::dtype(at::kLong)));
}

// y = x @ w.T (+ bias) for many rows of x (prompt chunks): tiles of TILE weight rows dequantized
// to float32, each multiplied by the whole input with at::mm (float32 BLAS). The weight is read
// once per call; the float tile stays in cache while the product runs.
constexpr int64_t TILE = 256;

torch::Tensor gguf_mm(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, bool float_out) {
  const Weight wt = parse(w);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == wt.K && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "x: bf16 or float32 [M, K] matching the weight's K");
  const int64_t M = x.size(0), N = wt.N, K = wt.K;
  const torch::Tensor x32 = x.to(at::kFloat).contiguous();
  torch::Tensor y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  torch::Tensor tile = torch::empty({TILE, K}, torch::dtype(at::kFloat));
  float* tp = tile.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += TILE) {
    const int64_t rows = std::min(TILE, N - n0);
    at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        int64_t type = 0;
        const uint8_t* row = row_of(wt, n0 + r, type);
        dequant_row(type, row, K, tp + r * K);
      }
    });
    auto part = y.narrow(1, n0, rows);
    part.copy_(at::mm(x32, tile.narrow(0, 0, rows).t()));
  }
  if (bias) y.add_(bias->to(at::kFloat));
  return float_out ? y : y.to(x.scalar_type());
}

void register_gguf(pybind11::module& m) {
  m.def("gguf_mm", &gguf_mm, "y = x @ w.T (+ bias) for a packed GGUF weight and many rows of x (tiles dequantized)");
  m.def("gguf_rows", &gguf_rows, "rows of a packed GGUF weight, dequantized to float32 [len(ids), K]");
  m.def("gguf_dequantize", &gguf_dequantize, "a packed GGUF weight dequantized to float32 [N, K]");
  m.def("gguf_in_features", &gguf_in_features, "K of a packed GGUF weight");
}
