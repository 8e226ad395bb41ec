// 16-lane float vectors for the CPU kernels: GCC/Clang vector extensions, so the same
// source becomes AVX-512 where the machine has it (the build uses -march=native), else
// two AVX2 or four SSE registers.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvserve_cpu {

constexpr int64_t kLanes = 16;
typedef float Vec16 __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Int16 __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t UInt16 __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Half16Bits __attribute__((vector_size(kLanes * sizeof(uint16_t))));

inline Vec16 splat(float x) { return Vec16{} + x; }

#if defined(__AVX2__)
// A value kept in its register as it is. Without it GCC folds a load that several FMAs share into
// each of them (one load of the same 32 bytes an FMA: the kernel waits on loads, not FMAs), and
// regroups integer sums into trees it then keeps on the stack.
inline void in_register(__m256& v) { __asm__("" : "+x"(v)); }
inline void in_register(__m256i& v) { __asm__("" : "+x"(v)); }
#endif

// Calls f with a value of the C++ type of `type` (float32, bfloat16 or float16); `op` names the
// kernel in the error for any other type.
template <typename F>
void dispatch_float_types(c10::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case c10::kFloat: f(float{}); break;
    case c10::kBFloat16: f(c10::BFloat16{}); break;
    case c10::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": dtype ", type, " is not float32, bfloat16 or float16");
  }
}

inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline Vec16 load16(const c10::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift.
#ifdef __AVX512F__
  // GCC lowers the generic widening below to two 256-bit halves and a shuffle; one
  // VPMOVZXWD does it (the masked form: GCC 12 warns that the unmasked one reads an
  // uninitialized register).
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const UInt16 bits = reinterpret_cast<UInt16>(_mm512_maskz_cvtepu16_epi32(static_cast<__mmask16>(0xFFFF), raw)) << 16;
#else
  Half16Bits raw;
  std::memcpy(&raw, p, sizeof(raw));
  const UInt16 bits = __builtin_convertvector(raw, UInt16) << 16;
#endif
  Vec16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline Vec16 load16(const c10::Half* p) {
  float tmp[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}

// The int8 KV cache's codes (write_kv.cpp), widened exactly.
inline Vec16 load16(const int8_t* p) {
#ifdef __AVX512F__
  // One VPMOVSXBD and one VCVTDQ2PS (GCC scalarizes the generic conversion below; the masked
  // forms: GCC 12 warns that the unmasked ones read an uninitialized register).
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512 wide = _mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_maskz_cvtepi8_epi32(0xFFFF, raw));
  Vec16 v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
#else
  typedef int8_t Int8x16 __attribute__((vector_size(kLanes)));
  Int8x16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(__builtin_convertvector(raw, Int16), Vec16);
#endif
}

// A tile of packed bf16 pairs (pack_skinny_weight): 16 lanes of 32 bits, lane r holding output
// row r's weights for inputs k (low half) and k + 1 (high half), widened to float.
inline void load_bf16_pairs(const uint16_t* tile, Vec16& even, Vec16& odd) {
  UInt16 raw;
  std::memcpy(&raw, tile, sizeof(raw));
  const UInt16 low = raw << 16, high = raw & 0xFFFF0000u;
  std::memcpy(&even, &low, sizeof(even));
  std::memcpy(&odd, &high, sizeof(odd));
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline void store16(float* p, Vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// v rounded to bfloat16 (to nearest even, NaN kept NaN, as c10::BFloat16 converts), in float lanes.
inline Vec16 round_bf16(Vec16 v) {
  UInt16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  UInt16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  rounded = v != v ? UInt16{} + 0x7FC00000u : rounded;
  std::memcpy(&v, &rounded, sizeof(v));
  return v;
}

// v's lanes already bf16 values (round_bf16's result): their top halves, with no second rounding.
inline void store_rounded16(c10::BFloat16* p, Vec16 v) {
  UInt16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const Half16Bits raw = __builtin_convertvector(bits >> 16, Half16Bits);
  std::memcpy(p, &raw, sizeof(raw));
}

inline void store16(c10::BFloat16* p, Vec16 v) { store_rounded16(p, round_bf16(v)); }

// Two vectors already bf16 values (round_bf16's results) as 32 consecutive bf16 at p, first's then
// second's: with AVX-512 BW one 64-byte store from one permute, where the matmuls' epilogues paid a
// narrowing and a 32-byte store for each (docs/executor.md).
inline void store_rounded_pair(c10::BFloat16* p, Vec16 first, Vec16 second) {
#if defined(__AVX512BW__)
  alignas(64) static constexpr int16_t kUpperHalves[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                                           23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                                           45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  __m512i a, b;
  std::memcpy(&a, &first, sizeof(a));
  std::memcpy(&b, &second, sizeof(b));
  _mm512_storeu_si512(p, _mm512_permutex2var_epi16(a, _mm512_load_si512(kUpperHalves), b));
#else
  store_rounded16(p, first);
  store_rounded16(p + kLanes, second);
#endif
}

inline void store16(c10::Half* p, Vec16 v) {
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<c10::Half>(v[i]);
}

// v's lanes already values of T (round16's result): stored as they are, not rounded a second time.
inline void store_rounded16(float* p, Vec16 v) { store16(p, v); }
inline void store_rounded16(c10::Half* p, Vec16 v) { store16(p, v); }

// v as it reads after a store to T and a load back: what an op computing in float and
// returning T leaves for the next op.
inline Vec16 round16(Vec16 v, const float*) { return v; }
inline Vec16 round16(Vec16 v, const c10::BFloat16*) { return round_bf16(v); }
inline Vec16 round16(Vec16 v, const c10::Half*) {
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(static_cast<c10::Half>(v[i]));
  return v;
}

// Blocks are scattered, so the hardware prefetcher, which follows strides, stalls at every
// tile boundary; ask for a tile ahead of time, one cache line at a time.
constexpr int64_t kPrefetchDistance = 2;  // tiles ahead

// The Bytes from p on, one line at a time, into L2.
template <int64_t Bytes, typename T>
inline void prefetch_lines(const T* p) {
  for (int64_t offset = 0; offset < Bytes; offset += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(p) + offset, 0, 1);
  }
}

template <typename T>
inline void prefetch_tile(const T* tile, int64_t elements) {
  const char* bytes = reinterpret_cast<const char*>(tile);
  for (int64_t offset = 0; offset < elements * static_cast<int64_t>(sizeof(T)); offset += 64) {
    __builtin_prefetch(bytes + offset, 0, 3);
  }
}

inline float reduce_max(Vec16 v) {
  float m = v[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// The max of v's lanes, NaN-free v: any order gives the same bits.
inline float reduce_max_any_order(Vec16 v) {
  const auto max = [](Vec16 a, Vec16 b) { return a > b ? a : b; };
  v = max(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = max(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// Lane i combined with lane i ^ 8, then i ^ 4, i ^ 2, i ^ 1: four shuffles, where a loop over the
// lanes compiles to sixteen extractions (a fifth of the activations' quantization, Zen 4).
template <typename Combine>
inline int32_t fold_lanes(Int16 v, Combine combine) {
  v = combine(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = combine(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = combine(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = combine(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// Whether every lane of a comparison's result (0 or -1 each) is true.
inline bool all_lanes(Int16 mask) {
  return fold_lanes(mask, [](Int16 a, Int16 b) { return a & b; }) != 0;
}

// Exact in any order: integer sums (each lane's value small enough not to overflow).
inline int32_t reduce_sum(Int16 v) {
  return fold_lanes(v, [](Int16 a, Int16 b) { return a + b; });
}

// The 16 lanes, each in [-128, 127], as 16 bytes at p.
inline void store_narrowed(int8_t* p, Int16 v) {
#ifdef __AVX512F__
  __m512i raw;
  std::memcpy(&raw, &v, sizeof(raw));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_maskz_cvtepi32_epi8(0xFFFF, raw));
#else
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<int8_t>(v[i]);
#endif
}

inline float reduce_sum(Vec16 v) {
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// e^x for x <= 0 (softmax after subtracting the max): Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2/2, and the Cephes expf polynomial (relative error ~1e-7);
// below -87 the result flushes to ~1e-38.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// With AVX2 the generic form below went through the stack op by op (a 16-lane vector is two
// registers): ~6 ns an element for the SiLU on the AVX2 EPYC. The same steps on each 8-lane half.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 nf = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fmadd_ps(nf, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i n = _mm256_cvtps_epi32(nf);  // exact: nf is an integer
  const __m256 two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(p, two_n);
}

// The largest of v's 8 lanes (NaN-free v: any order gives the same bits).
inline float max_of_lanes8(__m256 v) {
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

inline Vec16 exp_nonpositive(Vec16 x) {
  __m256 halves[2];
  std::memcpy(halves, &x, sizeof(x));
  halves[0] = exp_nonpositive8(halves[0]);
  halves[1] = exp_nonpositive8(halves[1]);
  std::memcpy(&x, halves, sizeof(x));
  return x;
}
#elif defined(__AVX512F__)
// The same steps as the generic form below, operation for operation (the same bits), in fewer
// instructions: the floor is one VRNDSCALEPS where GCC builds the truncate-and-correct from four
// conversions and compares, and p * 2^n one VSCALEFPS (both exact scalings, rounded alike where
// the result is subnormal). max(-87, x) keeps a NaN, as the generic comparison does. (Masked forms
// with every lane set: GCC 12 warns that the unmasked ones read an uninitialized register.)
inline Vec16 exp_nonpositive(Vec16 v) {
  const __m512 x = _mm512_maskz_max_ps(0xFFFF, _mm512_set1_ps(-87.f), v);
  const __m512 y = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  const __m512 nf = _mm512_maskz_roundscale_ps(0xFFFF, y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(nf, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(0xFFFF, p, nf);
}
#else
inline Vec16 exp_nonpositive(Vec16 x) {
  x = x < -87.f ? splat(-87.f) : x;
  const Vec16 y = x * 1.44269504088896341f + 0.5f;
  Int16 n = __builtin_convertvector(y, Int16);  // truncates toward zero
  Vec16 nf = __builtin_convertvector(n, Vec16);
  const Int16 above = nf > y;  // -1 where truncation rounded up: floor = trunc - 1
  n += above;
  nf = __builtin_convertvector(n, Vec16);
  const Vec16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  Vec16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const Int16 bits = (n + 127) << 23;
  Vec16 two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}
#endif

// x * sigmoid(x), with exp taken of -|x| only (no overflow).
inline Vec16 silu(Vec16 x) {
#if defined(__AVX512F__)
  // -|x| as one OR of the sign bit where the generic select takes three instructions: the same
  // value but at x = -0 (the select gives +0 there), and exp(+0) == exp(-0).
  const __m512 e = exp_nonpositive(_mm512_or_ps(x, _mm512_set1_ps(-0.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 numerator = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
  return _mm512_mul_ps(x, _mm512_div_ps(numerator, _mm512_add_ps(one, e)));
#else
  const Vec16 e = exp_nonpositive(x < 0.f ? x : -x);
  return x * ((x >= 0.f ? splat(1.f) : e) / (1.f + e));
#endif
}

// Where position i (0..15) of 16 values lies when they are held as the even positions, then the odd.
constexpr int64_t even_odd_lane(int64_t i) { return i / 2 + (i % 2) * 8; }

// The numerators of a softmax over x[0..n) (n a multiple of 16; lanes out of it -inf), in place:
// exp(x - max x), with a vectorized exp. Returns 1 / their sum.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The generic form's max went lane by lane through the stack on AVX2 (three quarters of the
// decode attention's softmax, a quarter of the whole kernel). The same sums in the same order:
// each of 16 lanes accumulates its own elements, then lanes 0..15 are added in turn. EvenOdd:
// each 16 elements hold positions 0, 2, ..., 14 then 1, 3, ..., 15 (the decode attention's bf16
// tiles, avx2_lanes.h), and the lanes are added in the order of their positions all the same.
template <bool EvenOdd = false>
inline float softmax_numerators(float* x, int64_t n) {
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
  const __m256 m = _mm256_set1_ps(max_of_lanes8(vmax));
  __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __m256 lo = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    const __m256 hi = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m));
    _mm256_storeu_ps(x + i, lo);
    _mm256_storeu_ps(x + i + 8, hi);
    sum_lo = _mm256_add_ps(sum_lo, lo);
    sum_hi = _mm256_add_ps(sum_hi, hi);
  }
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, sum_lo);
  _mm256_store_ps(lanes + 8, sum_hi);
  float sum = 0.f;
  for (int64_t position = 0; position < kLanes; ++position) {
    sum += lanes[EvenOdd ? even_odd_lane(position) : position];
  }
  return 1.f / sum;
}
#else
template <bool EvenOdd = false>
inline float softmax_numerators(float* x, int64_t n) {
  static_assert(!EvenOdd, "tiles are widened to even/odd lanes on AVX2 only");
  Vec16 vmax = splat(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += kLanes) vmax = vmax > load16(x + i) ? vmax : load16(x + i);
  const float m = reduce_max(vmax);
  Vec16 vsum{};
  for (int64_t i = 0; i < n; i += kLanes) {
    const Vec16 e = exp_nonpositive(load16(x + i) - m);
    store16(x + i, e);
    vsum += e;
  }
  return 1.f / reduce_sum(vsum);
}
#endif

}  // namespace kvserve_cpu
