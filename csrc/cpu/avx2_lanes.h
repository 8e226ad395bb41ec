// 16 float lanes as two AVX2 registers, for the hot loops of kernels written over Vec16 (vec16.h).
//
// Without AVX-512 a Vec16 is wider than a register. GCC then keeps arrays of them (a kernel's
// accumulators) on the stack and moves them through 128-bit halves: the paged decode attention,
// written over Vec16, ran at ~2.5 GFLOP/s on an AVX2 EPYC, whatever its cache's dtype. Loops that
// hold several accumulators use these instead there, each half a named register.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define KVSERVE_AVX2_LANES 1

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace kvserve_cpu {

struct Lanes16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline Lanes16 zero_lanes() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

inline Lanes16 load_lanes(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

inline __m256 widen_bf16(__m128i raw) {  // bf16 is the top half of an fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline Lanes16 load_lanes(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {widen_bf16(_mm256_castsi256_si128(raw)), widen_bf16(_mm256_extracti128_si256(raw, 1))};
}

// 16 bf16 as {elements 0, 2, ..., 14; elements 1, 3, ..., 15}: a bf16 is the top half of an fp32,
// so one load widens by a shift and a mask where the ordered form takes an extraction, two
// extensions and two shifts. For loops whose lanes need not come out in order (a sum per lane).
inline Lanes16 load_lanes_even_odd(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
}

inline Lanes16 load_lanes(const c10::Half* p) {
#if defined(__F16C__)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(raw)), _mm256_cvtph_ps(_mm256_extracti128_si256(raw, 1))};
#else
  alignas(32) float wide[16];
  for (int i = 0; i < 16; ++i) wide[i] = static_cast<float>(p[i]);
  return load_lanes(wide);
#endif
}

inline Lanes16 load_lanes(const int8_t* p) {  // the int8 KV cache's codes, widened exactly
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)))};
}

inline void store_lanes(float* p, Lanes16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}

// acc + a * v, lane by lane (one rounding: FMA)
inline Lanes16 fma_lanes(float a, Lanes16 v, Lanes16 acc) {
  const __m256 s = _mm256_set1_ps(a);
  return {_mm256_fmadd_ps(s, v.lo, acc.lo), _mm256_fmadd_ps(s, v.hi, acc.hi)};
}

inline Lanes16 add_lanes(Lanes16 a, Lanes16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }

// Lanes 0 to 15 added in turn, as reduce_sum adds a Vec16's (vec16.h): the same bits.
inline float sum_in_lane_order(Lanes16 v) {
  alignas(32) float lanes[16];
  store_lanes(lanes, v);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
}

}  // namespace kvserve_cpu

#endif
