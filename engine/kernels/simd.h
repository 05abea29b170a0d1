// Vector helpers shared by the native CPU kernels (header-only: the loops inline them).
//
// The kernels are written once over `vf`, 16 float32 lanes: one __m512 in the AVX-512 build,
// two __m256 in the AVX2 + FMA build (engine/kernels/__init__.py compiles the module once per
// instruction set, for the CPU it runs on). Only the bf16 dot-product paths (VDPBF16PS, AMX),
// which have no AVX2 counterpart, are written per ISA (EAGLE_DPBF16).
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define EAGLE_DPBF16 1
#else
#define EAGLE_DPBF16 0
#endif

namespace eagle_simd {

inline uint16_t to_bf16(float f) {  // round to nearest even (denormals kept, NaN -> 0x7fc0)
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return 0x7fc0;  // NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

constexpr int VL = 16;  // lanes of vf
// e^f's Taylor coefficients after 1/7!, by Horner's rule from 1/6! down to 1 (exp_ps)
constexpr float EXP_TAYLOR[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

#if EAGLE_DPBF16  // AVX-512 with bf16 dot products: the module's AVX-512 build
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline float vmaxall(vf a) { return _mm512_reduce_max_ps(a); }
inline __mmask16 first_lanes(int n) { return n >= VL ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
// lanes 0..n-1 from p, the rest `fill` (p[n..15] is not read)
inline vf load_first(const float* p, int n, float fill) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_lanes(n), p);
}
inline vf keep_first(vf v, int n) { return _mm512_maskz_mov_ps(first_lanes(n), v); }  // lanes >= n zeroed

inline vf load16(const float* p) { return _mm512_loadu_ps(p); }
inline vf load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf load16(const int8_t* p) {  // 16 int8 -> float32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store16(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, vf v) {  // round to nearest even (VCVTNEPS2BF16 flushes denormals)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2n(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral

#else  // AVX2 + FMA: two 8-lane halves
struct vf {
  __m256 lo, hi;
};
inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vfmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vsum(vf a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float vmaxall(vf a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
// all-ones in the lanes (of 16) below n, as two 8-lane masks
inline void first_lanes(int n, __m256& lo, __m256& hi) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), nv = _mm256_set1_epi32(n);
  lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, idx));
  hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, _mm256_add_epi32(idx, _mm256_set1_epi32(8))));
}
inline vf load_first(const float* p, int n, float fill) {  // p[n..15] is not read
  __m256 ml, mh;
  first_lanes(n, ml, mh);
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, _mm256_maskload_ps(p, _mm256_castps_si256(ml)), ml),
          _mm256_blendv_ps(f, _mm256_maskload_ps(p + 8, _mm256_castps_si256(mh)), mh)};
}
inline vf keep_first(vf v, int n) {
  __m256 ml, mh;
  first_lanes(n, ml, mh);
  return {_mm256_and_ps(v.lo, ml), _mm256_and_ps(v.hi, mh)};
}

inline vf load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(__m128i h) {  // 8 bf16 -> float32 (exact)
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {bf16x8(_mm256_castsi256_si128(h)), bf16x8(_mm256_extracti128_si256(h, 1))};
}
inline __m256 i8x8(const int8_t* p) {  // 8 int8 -> float32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf load16(const int8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
inline void store16(float* p, vf v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline __m256i bf16_bits8(__m256 v) {  // round to nearest even, as to_bf16 (denormals kept, NaN -> 0x7fc0)
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void store16(at::BFloat16* p, vf v) {
  // packus interleaves the halves by 128-bit lane: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> 0xD8 puts them in order
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(v.lo), bf16_bits8(v.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}

inline vf vmin(vf a, vf b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vfnmadd(vf a, vf b, vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf vround(vf a) {
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, nearest), _mm256_round_ps(a.hi, nearest)};
}
// p * 2^n for integral n in [-150, 127] (exp_ps's range): 2^n from exponent bits in two factors,
// 2^(n >> 1) * 2^(n - (n >> 1)), each inside float32's normal range, so a product that is a
// denormal or flushes to 0 is rounded once, as VSCALEFPS rounds it
inline __m256 scale2n8(__m256 p, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
inline vf vscale2n(vf p, vf n) { return {scale2n8(p.lo, n.lo), scale2n8(p.hi, n.hi)}; }
#endif

// e^x in 16 float32 lanes, x clamped to [-104, 88] (e^x then flushes to 0 or stays below
// float32's max, so silu(g) = g / (1 + e^-g) stays finite): 2^n * e^f, n = round(x / ln 2),
// e^f by a degree-7 Taylor polynomial (relative error ~2e-8), 2^n by VSCALEFPS (AVX-512) or
// exponent bits (AVX2).
inline vf exp_ps(vf x) {
  x = vmin(vmax(x, vset1(-104.f)), vset1(88.f));
  const vf n = vround(vmul(x, vset1(1.4426950408889634f)));
  vf f = vfnmadd(n, vset1(0.693145751953125f), x);
  f = vfnmadd(n, vset1(1.428606765330187e-06f), f);
  vf p = vset1(1.f / 5040.f);
  for (float c : EXP_TAYLOR) p = vfmadd(p, f, vset1(c));
  return vscale2n(p, n);
}

}  // namespace eagle_simd
