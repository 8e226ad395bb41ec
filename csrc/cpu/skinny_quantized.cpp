// y = x @ W^T (+ bias) for a few rows of x, W quantized (executor/quantization.py): int8 per output
// row, or int4 per group of 32 inputs. The layouts: packed_layout.h; the loop over tiles and chunks
// of rows that both share with the bf16 kernel: skinny_tiles.h. The activations are quantized to
// int8 as well (below), and each group's dot product is integer arithmetic: VPDPBUSD (AVX512-VNNI),
// AMX tile multiplies where the CPU has them, or AVX2 / portable code with the same bits.
//
// Registered as torch.ops.kvserve_cpu.{pack_skinny_int4, skinny_linear_int4, pack_skinny_int8,
// skinny_linear_int8}.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "avx2_lanes.h"
#include "packed_layout.h"
#include "skinny_tiles.h"
#include "vec16.h"

namespace {

using namespace kvserve_cpu;

// The quantized kernels' x: bfloat16, or float32 where the model computes in it (a CPU without
// native bf16); the output has x's dtype.
at::Tensor quantizable_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat), op,
              ": x must be [rows, in_features] bfloat16 or float32");
  return x.stride(1) == 1 ? x : x.contiguous();
}

// ---- int8 activations (both quantized formats) ------------------------------------------------
//
// With int8 or int4 weights the activations are quantized as well, per row of x and group of 32
// inputs, symmetric: x ~ a * sx, a in [-127, 127] (what OpenVINO's CPU plugin does for its int8
// weights, and llama.cpp's Q8_1 blocks for its Q4_1 ones), so that a group's dot product is
// integer arithmetic: VPDPBUSD multiplies 4 unsigned bytes (the weight codes) by 4 signed ones
// into each 32-bit lane, 64 multiply-adds an instruction where an FMA does 16. Integer sums are
// exact, and the float ones run in the same order whatever the batch, so a row's result does not
// depend on the batch, and the fallback without VNNI computes the same numbers.

// v rounded to the nearest integer, ties to even (|v| < 2^22).
inline Vec16 round_to_integer(Vec16 v) {
#if defined(__AVX512F__)
  // One instruction (the zero-masked form: GCC 12 warns that the unmasked one reads an
  // uninitialized register).
  __m512 raw;
  std::memcpy(&raw, &v, sizeof(raw));
  const __m512 rounded = _mm512_maskz_roundscale_ps(0xFFFF, raw, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  std::memcpy(&v, &rounded, sizeof(v));
  return v;
#else
  const Vec16 bias = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  return (v + bias) - bias;
#endif
}

// x quantized per row and group of 32 inputs, as executor/quantization.py's
// quantize_activations_int8 computes it: sx = max|x| / 127 and a = x / sx rounded to the nearest
// integer (ties to even); with each group's sx * sum(a), which both formats' offsets need.
struct QuantizedRows {
  at::Tensor storage;   // one allocation for the three arrays below (one dispatched op a matmul, not three)
  int64_t rows;         // including the padding rows
  int8_t* codes;        // [rows, K]
  float* scales;        // [rows, K / 32]: sx (0 for an all-zero group, NaN for one with NaN or inf)
  float* scaled_sums;   // [rows, K / 32]: sx * sum(a)
  int32_t* code_sums;   // [rows, K / 32]: sum(a)
};

// run_tiles' panels for `rows` rows of K int8 codes: from 512 KiB of codes (a prompt step of ~900
// rows at K = 576), panels of at most 96 KiB, so that each tile's chunks read their codes from L2
// rather than L3. A layer's four projections, 2 threads on the AVX2 EPYC: int8 0.95x the time at
// 2,048 rows and 0.97-0.98x at 1,024, int4 0.94x and 0.97x; at 512 rows and below within 1 %
// (192 KiB panels: 0.96-0.97x at 2,048 rows).
int64_t activation_panel_rows(int64_t rows, int64_t k) {
  return rows_per_panel(rows, k, 96 << 10, 512 << 10, kMaxChunkRows);
}

#if defined(KVSERVE_AVX2_LANES)
// One group of 32 inputs as the generic loop below quantizes it, in AVX2 registers, for a group
// whose inputs are all finite and not all zero (false for any other, which the generic loop takes):
// written over Vec16, GCC made scalar code of the selects and the narrowing (~10 cycles an input on
// the AVX2 EPYC, a quarter of the down projection's int4 matmul at 256 rows). VROUNDPS rounds ties to
// even as the generic addition of 1.5 * 2^23 does; the division and the clamp are the same.
template <typename T>
bool quantize_group_avx2(const T* src, int8_t* out, float& scale_out, int32_t& sum_out) {
  const Lanes16 first = load_lanes(src), second = load_lanes(src + kLanes);
  const __m256 v[4] = {first.lo, first.hi, second.lo, second.hi};
  const __m256 sign = _mm256_set1_ps(-0.f), zero = _mm256_setzero_ps();
  __m256 finite = _mm256_cmp_ps(_mm256_sub_ps(v[0], v[0]), zero, _CMP_EQ_OQ);
  __m256 magnitude = _mm256_andnot_ps(sign, v[0]);
  for (int i = 1; i < 4; ++i) {
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_sub_ps(v[i], v[i]), zero, _CMP_EQ_OQ));
    magnitude = _mm256_max_ps(magnitude, _mm256_andnot_ps(sign, v[i]));
  }
  if (_mm256_movemask_ps(finite) != 0xFF) return false;
  const float amax = max_of_lanes8(magnitude);  // NaN-free: the group is finite
  if (!(amax > 0.f)) return false;
  const float scale = amax / 127.f;
  const __m256 scale_v = _mm256_set1_ps(scale), high = _mm256_set1_ps(127.f), low = _mm256_set1_ps(-127.f);
  __m256i codes[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], scale_v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    codes[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, high), low));
  }
  const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(codes[0], codes[1]), _mm256_add_epi32(codes[2], codes[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  sum_out = _mm_cvtsi128_si32(s);
  scale_out = scale;
  // The packs interleave the 128-bit halves: bytes come out as inputs 0-3, 8-11, 16-19, 24-27,
  // 4-7, ...; the permutation puts the 4-byte pieces back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return true;
}
#endif

// Rows [begin, end) of x (float32 or bf16) into q's codes, scales and scaled sums.
template <typename T>
void quantize_groups(const T* xp, int64_t x_stride, int64_t begin, int64_t end, int64_t k, QuantizedRows& q) {
  const int64_t groups = k / kGroup;
  int8_t* codes = q.codes;
  float* scales = q.scales;
  float* scaled_sums = q.scaled_sums;
  int32_t* code_sums = q.code_sums;
  for (int64_t m = begin; m < end; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = xp + m * x_stride + g * kGroup;
      const int64_t slot = m * groups + g;
      int8_t* out = codes + m * k + g * kGroup;
#if defined(KVSERVE_AVX2_LANES)
      if (quantize_group_avx2(src, out, scales[slot], code_sums[slot])) {
        scaled_sums[slot] = scales[slot] * static_cast<float>(code_sums[slot]);
        continue;
      }
#endif
      const Vec16 v[2] = {load16(src), load16(src + kLanes)};
      Vec16 magnitude = v[0] < 0 ? -v[0] : v[0];
      magnitude = magnitude > (v[1] < 0 ? -v[1] : v[1]) ? magnitude : (v[1] < 0 ? -v[1] : v[1]);
      // With every input finite the sum below cannot be NaN, and any order of the max is exact:
      // a vector test and a tree max then, the group's original sum only for a group with NaN or inf.
      const bool all_finite = all_lanes(((v[0] - v[0]) == 0.f) & ((v[1] - v[1]) == 0.f));
      const float amax = all_finite ? reduce_max_any_order(magnitude) : reduce_max(magnitude);
      const bool finite = all_finite || !std::isnan(reduce_sum(v[0] + v[1]));
      if (!(amax > 0.f) || !finite) {
        // All zero: the group adds nothing. NaN (or inf): a NaN scale, so that it reaches the
        // output as it would through a float matmul instead of vanishing.
        std::memset(out, 0, kGroup);
        scales[slot] = scaled_sums[slot] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
        code_sums[slot] = 0;
        continue;
      }
      // A division, not a product with 127 / amax: GCC may fuse a product with the rounding's
      // addition below into one FMA, which skips the product's own rounding and moves ties, so
      // that builds for different CPUs would disagree on a code.
      const float scale = amax / 127.f;
      Int16 total{};
      for (int half = 0; half < 2; ++half) {
        Vec16 r = round_to_integer(v[half] / scale);
        r = r > 127.f ? splat(127.f) : r;
        r = r < -127.f ? splat(-127.f) : r;
        const Int16 codes16 = __builtin_convertvector(r, Int16);
        total += codes16;
        store_narrowed(out + half * kLanes, codes16);
      }
      const int32_t sum = reduce_sum(total);
      scales[slot] = scale;
      scaled_sums[slot] = scale * static_cast<float>(sum);
      code_sums[slot] = sum;
    }
  }
}

// Inputs a thread quantizes at least (~7 us of work): fewer are not worth its wake-up.
constexpr int64_t kQuantizeGrainElements = 8192;

// `padded_rows` (>= x's rows): rows past x's are all-zero groups (for whole AMX tiles of rows).
QuantizedRows quantize_rows(const at::Tensor& x, int64_t padded_rows = 0) {
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup, total = std::max(rows, padded_rows);
  const int64_t float_bytes = 3 * total * groups * static_cast<int64_t>(sizeof(float));
  const int64_t codes_offset = (float_bytes + 63) / 64 * 64;
  QuantizedRows q{at::empty({codes_offset + total * k}, x.options().dtype(at::kByte)), total};
  auto* base = q.storage.data_ptr<uint8_t>();
  q.scales = reinterpret_cast<float*>(base);
  q.scaled_sums = q.scales + total * groups;
  q.code_sums = reinterpret_cast<int32_t*>(q.scaled_sums + total * groups);
  q.codes = reinterpret_cast<int8_t*>(base + codes_offset);
  const int64_t padding = total - rows;
  std::fill_n(q.scales + rows * groups, padding * groups, 0.f);
  std::fill_n(q.scaled_sums + rows * groups, padding * groups, 0.f);
  std::fill_n(q.code_sums + rows * groups, padding * groups, 0);
  std::memset(q.codes + rows * k, 0, padding * k);
  // Each row's codes are its own, whichever thread makes them. Single-threaded, this took a fifth
  // of an int8 matmul's time at 32 rows and at 1024 (Zen 4, two threads).
  const int64_t grain = std::max<int64_t>(1, kQuantizeGrainElements / k);
  const auto quantize_all = [&](const auto* xp) {
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      quantize_groups(xp, x.stride(0), begin, end, k, q);
    });
  };
  if (x.scalar_type() == at::kFloat) {
    quantize_all(x.data_ptr<float>());
  } else {
    quantize_all(x.data_ptr<at::BFloat16>());
  }
  return q;
}

// ---- AMX: both formats' integer dot products as tile multiplies ------------------------------
//
// Beyond a few rows the VNNI kernels are bound by VPDPBUSD's rate (64 multiply-adds an
// instruction, issued once per row of x); where the CPU has AMX, one TDPBSUD multiplies a 16 x 32
// tile of activation codes (16 rows of x, one group) by a 32 x 16 tile of weight codes (the
// group's 8 quads of 64 bytes, as both layouts hold them, int4's after unpacking its nibbles):
// 8,192 multiply-adds. Each group's 16 x 16 exact integer dots then take the same float32
// operations, in the same order, as in the VNNI kernels, so a row's result is bit for bit the same
// on either path, whatever the batch. The weights are unchanged: no second copy.
#if defined(KVSERVE_AMX_INT8)
constexpr int kAmxRows = 16;

// Tiles 0-1 (and 6-7, for every other pair): two groups' 16 x 16 int32 dots; 2-3: their 16 rows x
// 32 activation codes; 4-5: their 8 quads x 16 weight rows x 4 codes. Loaded per thread and call:
// oneDNN's AMX kernels run on the same threads with their own configurations.
struct LoadAmxConfig {
  void operator()() const {
    AmxConfig config;
    for (int t : {0, 1, 6, 7}) config.rows[t] = kAmxRows, config.colsb[t] = kTile * 4;
    for (int t : {2, 3}) config.rows[t] = kAmxRows, config.colsb[t] = kGroup;
    for (int t : {4, 5}) config.rows[t] = kGroup / 4, config.colsb[t] = kQuadBytes;
    load_tile_config(config);
  }
};

// For groups g and g + 1 (when `two`): dots[i][m * 16 + n] = sum over the group of
// a[m, k] * b_i[k, n], with a 16 rows of codes `a_stride` apart and b_i the group's B tile.
// GCC's tile intrinsics are asm without a memory clobber, hence the compiler barriers: b_i may
// have just been written (int4's unpacked nibbles), and dots is read afterwards.
// Two sets of dot tiles, (0, 1) and (6, 7), taken in turn by consecutive pairs of groups: a pair's
// multiplies then need not wait for the previous pair's dots to be stored out of the same tiles
// (int4 at 9-24 rows 6-9% faster; int8 unchanged). GCC's tile intrinsics take the tile's number as
// a literal, hence the macro.
#define KVSERVE_AMX_GROUP_DOTS(NAME, C0, C1)                                                                   \
  inline void NAME(const int8_t* a, int64_t a_stride, const uint8_t* b0, const uint8_t* b1, bool two,         \
                   int32_t(*dots)[kAmxRows * kTile]) {                                                       \
    asm volatile("" ::: "memory");                                                                           \
    _tile_zero(C0);                                                                                          \
    _tile_loadd(2, a, a_stride);                                                                             \
    _tile_loadd(4, b0, kQuadBytes);                                                                          \
    _tile_dpbsud(C0, 2, 4);                                                                                  \
    if (two) {                                                                                               \
      _tile_zero(C1);                                                                                        \
      _tile_loadd(3, a + kGroup, a_stride);                                                                  \
      _tile_loadd(5, b1, kQuadBytes);                                                                        \
      _tile_dpbsud(C1, 3, 5);                                                                                \
    }                                                                                                        \
    _tile_stored(C0, dots[0], kTile * 4);                                                                    \
    if (two) _tile_stored(C1, dots[1], kTile * 4);                                                           \
    asm volatile("" ::: "memory");                                                                           \
  }
KVSERVE_AMX_GROUP_DOTS(amx_group_dots_first, 0, 1)
KVSERVE_AMX_GROUP_DOTS(amx_group_dots_second, 6, 7)
#undef KVSERVE_AMX_GROUP_DOTS

inline void amx_group_dots(int set, const int8_t* a, int64_t a_stride, const uint8_t* b0, const uint8_t* b1, bool two,
                           int32_t (*dots)[kAmxRows * kTile]) {
  if (set == 0) {
    amx_group_dots_first(a, a_stride, b0, b1, two, dots);
  } else {
    amx_group_dots_second(a, a_stride, b0, b1, two, dots);
  }
}

// Runs multiply(g, two, buffer) for the group pairs (g, g + 1) in order, and epilogue(g, two, buffer)
// on each pair's dots one pair later, so that the vector loads of the dots do not wait on the tile
// stores just issued (a tile store's data is not forwarded to loads).
template <typename Multiply, typename Epilogue>
inline void for_each_group_pair(int64_t groups, Multiply&& multiply, Epilogue&& epilogue) {
  int64_t pending = -1;
  bool pending_two = false;
  int buffer = 0;
  for (int64_t g = 0; g < groups; g += 2) {
    const bool two = g + 1 < groups;
    multiply(g, two, buffer);
    if (pending >= 0) epilogue(pending, pending_two, 1 - buffer);
    pending = g, pending_two = two, buffer = 1 - buffer;
  }
  if (pending >= 0) epilogue(pending, pending_two, 1 - buffer);
}

inline __m512 dot_as_float(const int32_t* dots, int m) {
  return _mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_load_si512(dots + m * kTile));
}

// acc[m][0..16) for the first ROWS of 16 rows of quantized x (padded with zero rows):
// int8_tile_dot's sums. The tiles multiply all 16 rows; only the ROWS that are rows of x are taken
// out of them, because that epilogue, not the multiply, bounds the kernel (20 rows of x are a tile
// of 16 and one of 4: 32 rows' epilogue for 20 rows' work otherwise).
template <int ROWS>
void int8_amx_chunk(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const int32_t*,
                    const float* offsets, float* acc, Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  alignas(64) int32_t dots[2][2][kAmxRows * kTile];
  __m512 totals[ROWS];
  for (int m = 0; m < ROWS; ++m) totals[m] = _mm512_setzero_ps();
  for_each_group_pair(groups, [&](int64_t g, bool two, int buffer) {
    prefetch.lines(w + g * 8 * kQuadBytes, 16);  // groups g and g + 1: 8 quads of 64 codes each
    amx_group_dots(buffer, a + g * kGroup, k, w + g * 8 * kQuadBytes, w + (g + 1) * 8 * kQuadBytes, two, dots[buffer]);
  }, [&](int64_t g, bool two, int buffer) {
    for (int i = 0; i < 1 + two; ++i) {
      for (int m = 0; m < ROWS; ++m) {
        totals[m] = _mm512_fmadd_ps(dot_as_float(dots[buffer][i], m), _mm512_set1_ps(sx[m * groups + g + i]), totals[m]);
      }
    }
  });
  const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + (k / 4) * kQuadBytes));
  for (int m = 0; m < ROWS; ++m) {
    _mm512_storeu_ps(acc + m * kTile, _mm512_mul_ps(_mm512_sub_ps(totals[m], _mm512_set1_ps(offsets[m])), scale));
  }
}


#endif

// Up to one VNNI chunk of rows (whose weight loads all rows share) the VNNI kernels keep up
// with AMX's (measured on a Sapphire Rapids-class Xeon: int8 at 8 rows 18.7 vs 17.3 ms a step,
// int4 15.8 vs 17.1); beyond, a second chunk reads the weights again, and AMX is ahead (12 rows:
// 22.6 vs 18.1, 20.1 vs 18.1; 32 rows: 37.3 vs 28.6, 36.6 vs 33.3; docs/executor.md).
constexpr int64_t kAmxMinRows = kMaxChunkRows + 1;

// The rows to quantize x to for the kernel that takes `rows` rows: a whole number of AMX tiles of
// rows, or 0 (as many as x has) for the VNNI kernels.
int64_t amx_padded_rows(int64_t rows) {
#if defined(KVSERVE_AMX_INT8)
  if (rows >= kAmxMinRows && amx_permitted()) return (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
#endif
  (void)rows;
  return 0;
}

// ---- int4 weights (--quantization int4) -----------------------------------------------------
//
// The codes of executor/quantization.py: per group of 32 inputs of a row, w = (c - 8) * scale + zero
// with c in [0, 15]. Per tile of 16 rows and group, one 320-byte record read front to back:
//
//   bytes   0..255: 4 blocks of 64 bytes; block b holds, for each of the 16 rows, 4 bytes: byte j
//                   has input 4b + j in its low nibble and input 16 + 4b + j in its high one
//   bytes 256..319: the 16 rows' scales, then their zeros, bf16
//
// So a mask gives one register of VPDPBUSD's unsigned operand (4 codes per row, inputs 4b..4b+3)
// and a shift and the mask a second (inputs 16 + 4b..). With the group's D = sum c a (exact) and
// A = sum a, the group contributes
//
//   sx * (scale * (D - 8 A) + zero * A) = (D sx) * scale + (sx A) * (zero - 8 scale)
//
// to each row: a conversion, a product and two FMAs per group and row for eight VPDPBUSDs.

inline Vec16 load_bf16_16(const uint8_t* p) { return load16(reinterpret_cast<const c10::BFloat16*>(p)); }

#if defined(__AVX512F__)
// A group record's per-row coefficients: `scale` for the integer dot and `zero - 8 scale` for the
// activation code sum.
struct Int4GroupCoefficients {
  __m512 scale, a_coef;
};

inline Int4GroupCoefficients int4_group_coefficients(const uint8_t* record) {
  const Vec16 scale = load_bf16_16(record + kInt4CodeBytes), zero = load_bf16_16(record + kInt4CodeBytes + 32);
  const Vec16 a_coef = zero - 8.f * scale;  // 8 * scale is exact: one rounding
  Int4GroupCoefficients coef;
  std::memcpy(&coef.scale, &scale, sizeof(coef.scale));
  std::memcpy(&coef.a_coef, &a_coef, sizeof(coef.a_coef));
  return coef;
}
#endif

// acc[m][0..16) = the tile's 16 weight rows . row m of x, for ROWS rows of quantized x.
#if defined(__AVX512VNNI__)
template <int ROWS>
void int4_tile_dot(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const float* sxa, float* acc,
                   Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 totals[ROWS];
  for (int m = 0; m < ROWS; ++m) totals[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = w + g * kInt4RecordBytes;
    __m512i dots[ROWS];
    for (int m = 0; m < ROWS; ++m) dots[m] = _mm512_setzero_si512();
    prefetch(record + 4 * kQuadBytes);  // the record's scales and zeros
    for (int block = 0; block < 4; ++block) {
      prefetch(record + block * kQuadBytes);
      const __m512i both = _mm512_loadu_si512(record + block * kQuadBytes);
      const __m512i low = _mm512_and_si512(both, nibble), high = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
      const int64_t k0 = g * kGroup + 4 * block;
      for (int m = 0; m < ROWS; ++m) {
        dots[m] = _mm512_dpbusd_epi32(dots[m], low, _mm512_set1_epi32(load_32_bits(a + m * k + k0)));
        dots[m] = _mm512_dpbusd_epi32(dots[m], high, _mm512_set1_epi32(load_32_bits(a + m * k + k0 + 16)));
      }
    }
    const Int4GroupCoefficients coef = int4_group_coefficients(record);
    const __m512 scale_v = coef.scale, a_coef_v = coef.a_coef;
    for (int m = 0; m < ROWS; ++m) {
      const __m512 dot = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, dots[m]), _mm512_set1_ps(sx[m * groups + g]));
      totals[m] = _mm512_fmadd_ps(dot, scale_v, totals[m]);
      totals[m] = _mm512_fmadd_ps(_mm512_set1_ps(sxa[m * groups + g]), a_coef_v, totals[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(acc + m * kTile, totals[m]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// Without VNNI: VPMADDUBSW multiplies the unsigned codes by the signed activation codes into 16-bit
// pairs (at most 2 * 15 * 127 each, so a group's eight fit in 16 bits), VPMADDWD widens them to
// the VNNI kernel's 32-bit dots, and the float steps after it are its own, in its order: both
// builds give the same bits. The 16 weight rows are two 8-lane halves, both taken per load of a
// row's activation codes, for up to 4 rows of x at a time (kQuantizedAvx2Rows, as int8's).
constexpr int kQuantizedAvx2Rows = 4;

// piece(std::integral_constant<int, R>{}, std::integral_constant<int, M0>{}) for rows [M0, M0 + R) of a
// chunk of ROWS rows, in pieces of kQuantizedAvx2Rows: the tile's weights stay in L1 between them, so
// only the first piece prefetches (the Prefetcher's address arithmetic in every piece was an eighth
// of the int4 kernel's instructions).
template <int ROWS, int M0 = 0, typename Piece>
inline void for_each_avx2_row_piece(const Piece& piece) {
  constexpr int kRows = ROWS - M0 < kQuantizedAvx2Rows ? ROWS - M0 : kQuantizedAvx2Rows;
  piece(std::integral_constant<int, kRows>{}, std::integral_constant<int, M0>{});
  if constexpr (M0 + kRows < ROWS) for_each_avx2_row_piece<ROWS, M0 + kRows>(piece);
}

template <int ROWS, bool PREFETCH>
void int4_rows_dot(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const float* sxa, float* acc,
                   Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 totals[ROWS][2];
  for (int m = 0; m < ROWS; ++m) totals[m][0] = totals[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = w + g * kInt4RecordBytes;
    if constexpr (PREFETCH) {
      // The record's five lines from one address: its arithmetic once a line took 3-5 % of the
      // kernel's time at 4-2,048 rows on the AVX2 EPYC (int8's eight quads a group: no difference).
      const char* ahead = prefetch.target_of(record);
      for (int64_t line = 0; line < kInt4RecordBytes / 64; ++line) __builtin_prefetch(ahead + 64 * line, 0, 3);
    }
    __m256i pair_sums[ROWS][2];
    for (int m = 0; m < ROWS; ++m) pair_sums[m][0] = pair_sums[m][1] = _mm256_setzero_si256();
    for (int block = 0; block < 4; ++block) {
      const __m256i both0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + block * kQuadBytes));
      const __m256i both1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + block * kQuadBytes + 32));
      const __m256i low0 = _mm256_and_si256(both0, nibble), high0 = _mm256_and_si256(_mm256_srli_epi16(both0, 4), nibble);
      const __m256i low1 = _mm256_and_si256(both1, nibble), high1 = _mm256_and_si256(_mm256_srli_epi16(both1, 4), nibble);
      const int64_t k0 = g * kGroup + 4 * block;
      for (int m = 0; m < ROWS; ++m) {
        const __m256i codes_low = _mm256_set1_epi32(load_32_bits(a + m * k + k0));
        const __m256i codes_high = _mm256_set1_epi32(load_32_bits(a + m * k + k0 + 16));
        pair_sums[m][0] = _mm256_add_epi16(pair_sums[m][0], _mm256_maddubs_epi16(low0, codes_low));
        pair_sums[m][1] = _mm256_add_epi16(pair_sums[m][1], _mm256_maddubs_epi16(low1, codes_low));
        pair_sums[m][0] = _mm256_add_epi16(pair_sums[m][0], _mm256_maddubs_epi16(high0, codes_high));
        pair_sums[m][1] = _mm256_add_epi16(pair_sums[m][1], _mm256_maddubs_epi16(high1, codes_high));
        in_register(pair_sums[m][0]);  // else kept on the stack: a store for each VPMADDUBSW, 10 % of the int4 kernel
        in_register(pair_sums[m][1]);
      }
    }
    const Vec16 scale = load_bf16_16(record + kInt4CodeBytes), zero = load_bf16_16(record + kInt4CodeBytes + 32);
    const Vec16 a_coef = zero - 8.f * scale;  // 8 * scale is exact: one rounding
    __m256 scale_halves[2], a_coef_halves[2];
    std::memcpy(scale_halves, &scale, sizeof(scale));
    std::memcpy(a_coef_halves, &a_coef, sizeof(a_coef));
    for (int m = 0; m < ROWS; ++m) {
      for (int half = 0; half < 2; ++half) {
        const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pair_sums[m][half], ones)),
                                         _mm256_set1_ps(sx[m * groups + g]));
        totals[m][half] = _mm256_fmadd_ps(dot, scale_halves[half], totals[m][half]);
        totals[m][half] = _mm256_fmadd_ps(_mm256_set1_ps(sxa[m * groups + g]), a_coef_halves[half], totals[m][half]);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    _mm256_storeu_ps(acc + m * kTile, totals[m][0]);
    _mm256_storeu_ps(acc + m * kTile + 8, totals[m][1]);
  }
}

template <int ROWS>
void int4_tile_dot(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const float* sxa, float* acc,
                   Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  for_each_avx2_row_piece<ROWS>([&](auto rows, auto m0) {
    int4_rows_dot<rows, m0 == 0>(w, a + m0 * k, k, sx + m0 * groups, sxa + m0 * groups, acc + m0 * kTile, prefetch);
  });
}
#else
template <int ROWS>
void int4_tile_dot(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const float* sxa, float* acc,
                   Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  Vec16 totals[ROWS] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* record = w + g * kInt4RecordBytes;
    Int16 dots[ROWS] = {};
    for (int block = 0; block < 4; ++block) {
      UInt16 both;
      std::memcpy(&both, record + block * kQuadBytes, sizeof(both));
      const int64_t k0 = g * kGroup + 4 * block;
      for (int j = 0; j < 4; ++j) {
        const UInt16 bytes = (both >> (8 * j)) & 0xFFu;
        const Int16 low = __builtin_convertvector(bytes & 0xFu, Int16);
        const Int16 high = __builtin_convertvector(bytes >> 4, Int16);
        for (int m = 0; m < ROWS; ++m) {
          dots[m] += low * static_cast<int32_t>(a[m * k + k0 + j]) + high * static_cast<int32_t>(a[m * k + k0 + 16 + j]);
        }
      }
    }
    const Vec16 scale = load_bf16_16(record + kInt4CodeBytes), zero = load_bf16_16(record + kInt4CodeBytes + 32);
    const Vec16 a_coef = zero - 8.f * scale;
    for (int m = 0; m < ROWS; ++m) {
      totals[m] += __builtin_convertvector(dots[m], Vec16) * sx[m * groups + g] * scale;
      totals[m] += sxa[m * groups + g] * a_coef;
    }
  }
  for (int m = 0; m < ROWS; ++m) store16(acc + m * kTile, totals[m]);
}
#endif

#if defined(KVSERVE_AMX_INT8)
// The group's B tile from its record: quads 0-3 are the blocks' low nibbles, quads 4-7 their high.
inline void unpack_int4_group(const uint8_t* record, uint8_t* b) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int block = 0; block < 4; ++block) {
    const __m512i both = _mm512_loadu_si512(record + block * kQuadBytes);
    _mm512_store_si512(b + block * kQuadBytes, _mm512_and_si512(both, nibble));
    _mm512_store_si512(b + (4 + block) * kQuadBytes, _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble));
  }
}

// acc[m][0..16) for the first ROWS of 16 rows of quantized x: int4_tile_dot's sums (as int8_amx_chunk).
template <int ROWS>
void int4_amx_chunk(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const float* sxa, float* acc,
                    Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  alignas(64) int32_t dots[2][2][kAmxRows * kTile];
  alignas(64) uint8_t b[2][kGroup * kTile];
  __m512 totals[ROWS];
  for (int m = 0; m < ROWS; ++m) totals[m] = _mm512_setzero_ps();
  for_each_group_pair(groups, [&](int64_t g, bool two, int buffer) {
    prefetch.lines(w + g * kInt4RecordBytes, kInt4RecordBytes / 64);
    unpack_int4_group(w + g * kInt4RecordBytes, b[0]);
    if (two) unpack_int4_group(w + (g + 1) * kInt4RecordBytes, b[1]);
    amx_group_dots(buffer, a + g * kGroup, k, b[0], b[1], two, dots[buffer]);
  }, [&](int64_t g, bool two, int buffer) {
    for (int i = 0; i < 1 + two; ++i) {
      const Int4GroupCoefficients coef = int4_group_coefficients(w + (g + i) * kInt4RecordBytes);
      const __m512 scale_v = coef.scale, a_coef_v = coef.a_coef;
      for (int m = 0; m < ROWS; ++m) {
        const int64_t slot = m * groups + g + i;
        const __m512 dot = _mm512_mul_ps(dot_as_float(dots[buffer][i], m), _mm512_set1_ps(sx[slot]));
        totals[m] = _mm512_fmadd_ps(dot, scale_v, totals[m]);
        totals[m] = _mm512_fmadd_ps(_mm512_set1_ps(sxa[slot]), a_coef_v, totals[m]);
      }
    }
  });
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(acc + m * kTile, totals[m]);
}


#endif

constexpr auto kInt4TileDots = per_row_count<kMaxChunkRows>([](auto rows) { return &int4_tile_dot<rows>; });
#if defined(KVSERVE_AMX_INT8)
// A chunk of up to kVnniTailRows (the rows past a step's last full tile of 16) takes the VNNI
// kernel, with the same bits: its fixed tile work (zero, loads, store per group) costs more than the
// VNNI kernel's multiply-adds on so few rows, whose weights the tile before has just brought into
// cache. A step's matmuls at 17 / 20 rows 10-15% / ~5% faster; at 24 (a tail of 8) slower, hence 4.
constexpr int kVnniTailRows = 4;

// {chunk<1>, ..., chunk<16>} for the AMX path: vnni(rows) up to kVnniTailRows rows, amx(rows) beyond.
template <typename Vnni, typename Amx>
constexpr auto amx_path_chunks(Vnni vnni, Amx amx) {
  return per_row_count<kAmxRows>([=](auto rows) {
    if constexpr (rows <= kVnniTailRows) {
      return vnni(rows);
    } else {
      return amx(rows);
    }
  });
}

constexpr auto kInt4AmxChunks = amx_path_chunks([](auto rows) { return &int4_tile_dot<rows>; },
                                                [](auto rows) { return &int4_amx_chunk<rows>; });
#endif

at::Tensor pack_skinny_int4(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "pack_skinny_int4: codes must be [out, in] uint8");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kGroup == 0, "pack_skinny_int4: in_features must be a multiple of ", kGroup, ", got ", k);
  const int64_t groups = k / kGroup, tiles = (n + kTile - 1) / kTile;
  for (const at::Tensor* t : {&scales, &zeros}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == groups && t->scalar_type() == at::kBFloat16,
                "pack_skinny_int4: scales and zeros must be [out, in / 32] bfloat16");
  }
  TORCH_CHECK(codes.max().item<int64_t>() <= 15, "pack_skinny_int4: codes must be in [0, 15]");
  // Padding rows: codes, scales and zeros 0, so their weights are 0.
  at::Tensor c = at::zeros({tiles * kTile, k}, codes.options());
  c.narrow(0, 0, n).copy_(codes);
  // [tiles, 16 rows, groups, 2 halves, 4 blocks, 4] → a byte per (block, j): the first half's code low
  at::Tensor halves = c.view({tiles, kTile, groups, 2, 4, 4});
  at::Tensor bytes = at::bitwise_or(halves.select(3, 0), at::bitwise_left_shift(halves.select(3, 1), 4));
  // [tiles, 16 rows, groups, 4 blocks, 4 bytes] → [tiles, groups, 4 blocks, 16 rows, 4 bytes]
  bytes = bytes.permute({0, 2, 3, 1, 4}).reshape({tiles, groups, kInt4CodeBytes});
  auto per_tile = [&](const at::Tensor& t) {  // [out, groups] → [tiles, groups, 32 bytes]
    at::Tensor padded = at::zeros({tiles * kTile, groups}, t.options());
    padded.narrow(0, 0, n).copy_(t);
    return padded.view({tiles, kTile, groups}).permute({0, 2, 1}).contiguous().view(at::kByte).view({tiles, groups, 2 * kTile});
  };
  return at::cat({bytes, per_tile(scales), per_tile(zeros)}, 2).contiguous();
}

at::Tensor skinny_linear_int4(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t out_features) {
  const at::Tensor xc = quantizable_rows("skinny_linear_int4", x);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kInt4RecordBytes && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte,
              "skinny_linear_int4: packed must come from pack_skinny_int4");
  const int64_t k = xc.size(1), groups = packed.size(1);
  TORCH_CHECK(groups * kGroup == k, "skinny_linear_int4: x has ", k, " features, the weight ", groups * kGroup);
  const int64_t padded_rows = amx_padded_rows(xc.size(0));
  const QuantizedRows q = quantize_rows(xc, padded_rows);
  const auto* w = packed.data_ptr<uint8_t>();
  const int8_t* a = q.codes;
  const float* sx = q.scales;
  const float* sxa = q.scaled_sums;
#if defined(KVSERVE_AMX_INT8)
  if (padded_rows > 0) {
    return run_tiles<kAmxRows, 1, PrefetchPolicy::kAhead>("skinny_linear_int4", xc, w, packed.size(0), groups * kInt4RecordBytes, bias, out_features,
                               [&](int64_t t, int64_t, int64_t m0, int64_t chunk, float* acc, Prefetcher prefetch) {
                                 kInt4AmxChunks[chunk - 1](w + t * groups * kInt4RecordBytes, a + m0 * k, k, sx + m0 * groups,
                                                sxa + m0 * groups, acc, prefetch);
                               },
                               LoadAmxConfig{});
  }
#endif
  return run_tiles<kMaxChunkRows, 1, PrefetchPolicy::kAhead>("skinny_linear_int4", xc, w, packed.size(0), groups * kInt4RecordBytes, bias, out_features,
                   [&](int64_t t, int64_t, int64_t m0, int64_t chunk, float* acc, Prefetcher prefetch) {
                     kInt4TileDots[chunk - 1](w + t * groups * kInt4RecordBytes, a + m0 * k, k, sx + m0 * groups,
                                              sxa + m0 * groups, acc, prefetch);
                   },
                   NoThreadSetup{}, activation_panel_rows(xc.size(0), k));
}

// ---- int8 weights (--quantization int8) -----------------------------------------------------
//
// Per output row w = q * scale, q in [-127, 127] (executor/quantization.py). VPDPBUSD's unsigned
// operand is the weight, stored as q + 128 (in [1, 255]); the offset comes back out through the
// group's code sum A = sum(a):
//
//   sum_k (q + 128) a = sum_k q a + 128 A
//
// The group adds sx * (that integer) to the row's float32 sum; the offset's share, the row's sum
// over groups of 128 * sx * A, is one number per row of x taken off at the end, where the weight
// row's scale multiplies. Per group and row, then, one conversion and one FMA for eight VPDPBUSDs.
//
// Tile layout, 16 output rows: for each 4 inputs k..k+3, the 16 rows' 4 codes (64 bytes, one
// register); then the 16 scales as float32 (64 bytes).

// acc[m][0..16) = the tile's 16 weight rows . row m of x, for ROWS rows of quantized x. One
// accumulator per row: a group's eight multiply-adds into it are a dependency chain, but the
// next group's chain and the other rows' are independent of it.
#if defined(__AVX512VNNI__)
template <int ROWS>
void int8_tile_dot(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const int32_t* code_sums,
                   const float* offsets, float* acc, Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  __m512 totals[ROWS];
  for (int m = 0; m < ROWS; ++m) totals[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group_w = w + g * (kGroup / 4) * kQuadBytes;
    const int8_t* group_a = a + g * kGroup;
    for (int64_t quad = 0; quad < kGroup / 4; ++quad) prefetch(group_w + quad * kQuadBytes);
    __m512i dots[ROWS];
    for (int m = 0; m < ROWS; ++m) dots[m] = _mm512_setzero_si512();
    // Unrolled: GCC 12 leaves this loop rolled for 5-8 rows and copies each
    // accumulator twice per multiply-add (the kernel 15 % slower at 8 rows on a Zen 4).
#pragma GCC unroll 8
    for (int64_t quad = 0; quad < kGroup / 4; ++quad) {
      const __m512i wv = _mm512_loadu_si512(group_w + quad * kQuadBytes);
      for (int m = 0; m < ROWS; ++m) {
        dots[m] = _mm512_dpbusd_epi32(dots[m], wv, _mm512_set1_epi32(load_32_bits(group_a + m * k + 4 * quad)));
      }
    }
    for (int m = 0; m < ROWS; ++m) {
      totals[m] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, dots[m]), _mm512_set1_ps(sx[m * groups + g]),
                                  totals[m]);
    }
  }
  const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + (k / 4) * kQuadBytes));
  for (int m = 0; m < ROWS; ++m) {
    _mm512_storeu_ps(acc + m * kTile, _mm512_mul_ps(_mm512_sub_ps(totals[m], _mm512_set1_ps(offsets[m])), scale));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// Without VNNI: VPMADDUBSW multiplies unsigned by signed bytes into saturating 16-bit pairs, which
// the stored codes q + 128 would overflow (2 * 255 * 127); the signed code q, its sign moved onto
// the activation, cannot (2 * 127 * 127), and VPMADDWD sums the pairs into 32 bits. Started at
// 128 A, each group's integer dot is the VNNI kernel's, sum (q + 128) a, and the float steps after
// it are its own, in its order: both builds give the same bits.
//
// The 16 weight rows are two 8-lane halves, both taken per load of a row's 4 activation codes, for
// up to 4 rows of x at a time (kQuantizedAvx2Rows): 8 accumulators, the two halves' codes and
// magnitudes, a row's broadcast codes and two constants, 15 of the 16 registers. With 8 rows, one
// half at a time, GCC kept more accumulators on the stack, loaded and stored at every multiply-add
// (one thread, a layer's four projections: 39 GMAC/s against 44-45 so; 3 rows: 43).

template <int ROWS, bool PREFETCH>
void int8_rows_dot(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const int32_t* code_sums,
                   const float* offsets, float* acc, Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  const __m256i sign_bit = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 totals[ROWS][2];
  for (int m = 0; m < ROWS; ++m) totals[m][0] = totals[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dots[ROWS][2];
    for (int m = 0; m < ROWS; ++m) dots[m][0] = dots[m][1] = _mm256_set1_epi32(128 * code_sums[m * groups + g]);
    for (int64_t quad = 0; quad < kGroup / 4; ++quad) {
      const int64_t k0 = g * kGroup + 4 * quad;
      const uint8_t* codes = w + (k0 / 4) * kQuadBytes;
      if constexpr (PREFETCH) prefetch(codes);
      const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)), sign_bit);
      const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32)), sign_bit);
      const __m256i magnitude0 = _mm256_abs_epi8(q0), magnitude1 = _mm256_abs_epi8(q1);
      for (int m = 0; m < ROWS; ++m) {
        const __m256i codes_a = _mm256_set1_epi32(load_32_bits(a + m * k + k0));
        dots[m][0] = _mm256_add_epi32(dots[m][0],
                                      _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude0, _mm256_sign_epi8(codes_a, q0)), ones));
        dots[m][1] = _mm256_add_epi32(dots[m][1],
                                      _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude1, _mm256_sign_epi8(codes_a, q1)), ones));
      }
    }
    for (int m = 0; m < ROWS; ++m) {
      const __m256 row_scale = _mm256_set1_ps(sx[m * groups + g]);
      for (int half = 0; half < 2; ++half) {
        totals[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m][half]), row_scale, totals[m][half]);
      }
    }
  }
  const float* scales = reinterpret_cast<const float*>(w + (k / 4) * kQuadBytes);
  for (int m = 0; m < ROWS; ++m) {
    for (int half = 0; half < 2; ++half) {
      _mm256_storeu_ps(acc + m * kTile + 8 * half, _mm256_mul_ps(_mm256_sub_ps(totals[m][half], _mm256_set1_ps(offsets[m])),
                                                                 _mm256_loadu_ps(scales + 8 * half)));
    }
  }
}

template <int ROWS>
void int8_tile_dot(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const int32_t* code_sums,
                   const float* offsets, float* acc, Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  for_each_avx2_row_piece<ROWS>([&](auto rows, auto m0) {
    int8_rows_dot<rows, m0 == 0>(w, a + m0 * k, k, sx + m0 * groups, code_sums + m0 * groups, offsets + m0, acc + m0 * kTile,
                        prefetch);
  });
}
#else
template <int ROWS>
void int8_tile_dot(const uint8_t* w, const int8_t* a, int64_t k, const float* sx, const int32_t* code_sums,
                   const float* offsets, float* acc, Prefetcher prefetch) {
  const int64_t groups = k / kGroup;
  Vec16 totals[ROWS] = {};
  for (int64_t g = 0; g < groups; ++g) {
    Int16 dots[ROWS] = {};
    for (int64_t quad = 0; quad < kGroup / 4; ++quad) {
      const int64_t k0 = g * kGroup + 4 * quad;
      UInt16 packed;
      std::memcpy(&packed, w + (k0 / 4) * kQuadBytes, sizeof(packed));
      for (int j = 0; j < 4; ++j) {
        const Int16 wj = __builtin_convertvector((packed >> (8 * j)) & 0xFFu, Int16);
        for (int m = 0; m < ROWS; ++m) dots[m] += wj * static_cast<int32_t>(a[m * k + k0 + j]);
      }
    }
    for (int m = 0; m < ROWS; ++m) totals[m] += __builtin_convertvector(dots[m], Vec16) * sx[m * groups + g];
  }
  const Vec16 scale = load16(reinterpret_cast<const float*>(w + (k / 4) * kQuadBytes));
  for (int m = 0; m < ROWS; ++m) store16(acc + m * kTile, (totals[m] - offsets[m]) * scale);
}
#endif

constexpr auto kInt8TileDots = per_row_count<kMaxChunkRows>([](auto rows) { return &int8_tile_dot<rows>; });
#if defined(KVSERVE_AMX_INT8)
constexpr auto kInt8AmxChunks = amx_path_chunks([](auto rows) { return &int8_tile_dot<rows>; },
                                                [](auto rows) { return &int8_amx_chunk<rows>; });
#endif

at::Tensor pack_skinny_int8(const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "pack_skinny_int8: codes must be [out, in] int8");
  const int64_t n = codes.size(0), k = codes.size(1), tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(k % kGroup == 0, "pack_skinny_int8: in_features must be a multiple of ", kGroup, ", got ", k);
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n, "pack_skinny_int8: scales must be [out]");
  // The unsigned operand of VPDPBUSD: q + 128, in [1, 255] (padding rows: 128, i.e. q = 0).
  at::Tensor c = at::full({tiles * kTile, k}, 128, codes.options().dtype(at::kShort));
  c.narrow(0, 0, n).add_(codes.to(at::kShort));
  at::Tensor s = at::zeros({tiles * kTile}, scales.options().dtype(at::kFloat));
  s.narrow(0, 0, n).copy_(scales);
  // [tiles, 16 rows, K / 4, 4] → [tiles, K / 4, 16 rows, 4], then the tile's 16 float32 scales.
  at::Tensor tile_codes = c.to(at::kByte).view({tiles, kTile, k / 4, 4}).permute({0, 2, 1, 3}).reshape({tiles, k * kTile});
  return at::cat({tile_codes, s.view({tiles, kTile}).view(at::kByte)}, 1).contiguous();
}

at::Tensor skinny_linear_int8(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t out_features) {
  const at::Tensor xc = quantizable_rows("skinny_linear_int8", x);
  const int64_t rows = xc.size(0), k = xc.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "skinny_linear_int8: packed must come from pack_skinny_int8");
  TORCH_CHECK(packed.size(1) == k * kTile + kTile * 4, "skinny_linear_int8: x has ", k,
              " features, the weight ", (packed.size(1) - kTile * 4) / kTile);
  TORCH_CHECK(k % kGroup == 0, "skinny_linear_int8: in_features must be a multiple of ", kGroup);
  const int64_t groups = k / kGroup, padded_rows = amx_padded_rows(rows);
  const QuantizedRows q = quantize_rows(xc, padded_rows);
  // Per row, 128 * the sum over groups of sx A, in group order (scaling by 128 is exact).
  std::vector<float> offsets(q.rows);
  for (int64_t m = 0; m < q.rows; ++m) {
    const float* row = q.scaled_sums + m * groups;
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) sum += row[g];
    offsets[m] = 128.f * sum;
  }
  const auto* w = packed.data_ptr<uint8_t>();
  const int8_t* a = q.codes;
  const float* sx = q.scales;
  const int32_t* code_sums = q.code_sums;
  const float* offset = offsets.data();
  const int64_t tile_bytes = packed.size(1);
#if defined(KVSERVE_AMX_INT8)
  if (padded_rows > 0) {
    return run_tiles<kAmxRows, 1, PrefetchPolicy::kAhead>("skinny_linear_int8", xc, w, packed.size(0), tile_bytes, bias, out_features,
                               [&](int64_t t, int64_t, int64_t m0, int64_t chunk, float* acc, Prefetcher prefetch) {
                                 kInt8AmxChunks[chunk - 1](w + t * tile_bytes, a + m0 * k, k, sx + m0 * groups, code_sums + m0 * groups, offset + m0,
                                                           acc, prefetch);
                               },
                               LoadAmxConfig{});
  }
#endif
  return run_tiles("skinny_linear_int8", xc, w, packed.size(0), tile_bytes, bias, out_features,
                   [&](int64_t t, int64_t, int64_t m0, int64_t chunk, float* acc, Prefetcher prefetch) {
                     kInt8TileDots[chunk - 1](w + t * tile_bytes, a + m0 * k, k, sx + m0 * groups, code_sums + m0 * groups, offset + m0, acc,
                                              prefetch);
                   },
                   NoThreadSetup{}, activation_panel_rows(rows, k));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("pack_skinny_int4(Tensor codes, Tensor scales, Tensor zeros) -> Tensor");
  m.def("skinny_linear_int4(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("pack_skinny_int8(Tensor codes, Tensor scales) -> Tensor");
  m.def("skinny_linear_int8(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("pack_skinny_int4", &pack_skinny_int4);
  m.impl("skinny_linear_int4", &skinny_linear_int4);
  m.impl("pack_skinny_int8", &pack_skinny_int8);
  m.impl("skinny_linear_int8", &skinny_linear_int8);
}
