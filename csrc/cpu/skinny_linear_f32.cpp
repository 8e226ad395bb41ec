// y = x @ W^T (+ bias) for float32 rows of x, W stored in bf16: the projections of a float32 model
// on a CPU without native bf16 (AVX2 only), whose checkpoint is bf16, at every step.
//
// Such a CPU runs the executor in float32 (bf16 matmuls are emulated there, many times slower),
// and a decode step then reads every weight as 4 bytes although the checkpoint's values fit in 2.
// A step of few rows is bound by that read. This kernel reads skinny_linear's bf16 layout
// (pack_skinny_weight: tiles of 16 output rows, input columns in pairs) and widens each weight to
// float32 in registers — a shift, exact — so it reads half the bytes and computes the same
// products as the float32 matmul; only the order of the additions differs.
//
//   x: [rows, K] float32    packed: [ceil(N / 16), K / 2, 16, 2] bf16    y: [rows, N] float32
//
// With AVX2 a tile's 16 outputs are two 8-lane halves; each row of x keeps an accumulator per half.
// Up to 3 rows, one chunk widens each weight pair in registers and multiplies (8 accumulators, 2
// widened weight registers, 2 broadcasts fit the 16 registers). From kWidenedMinRows rows, chunks of
// up to 6 rows, as even as they go: up to kWidenOnlyMaxRows rows each chunk widens the tile in
// registers again; beyond, the tile's first chunk also stores what it widens and the others multiply
// from there (below). The loop over tiles and chunks of rows, and where it
// prefetches the weights: skinny_tiles.h. A row's sums run in the same order whatever the number
// of rows, so a token gets the same result alone or in a batch.
//
// Registered as torch.ops.kvserve_cpu.skinny_linear_f32.

#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <vector>

#include "packed_layout.h"
#include "skinny_tiles.h"
#include "vec16.h"

namespace {

using namespace kvserve_cpu;

constexpr int kChunkRows = 4;  // rows of x sharing each widened weight register

// acc[m][0..16) = sum over k of x[m, k] * W[tile row, k], for ROWS rows of x.
#if defined(__AVX2__) && defined(__FMA__)
// The widened weights of one half (8 output rows) of a pair: k's and k+1's. Each 32-bit lane
// holds one output row's (k, k+1) weights: k in the low half, k+1 in the high.
struct HalfPair {
  __m256 even, odd;
  explicit HalfPair(const uint16_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    odd = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(raw, 16), 16));
  }
};

template <int ROWS>
void tile_dot_f32(const uint16_t* w, const float* x, int64_t x_stride, int64_t pairs, float* acc,
                  Prefetcher prefetch) {
  // One half at a time, so that 4 rows' accumulators stay in registers.
  __m256 lo[ROWS], hi[ROWS];
  for (int m = 0; m < ROWS; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* pair = w + kp * 2 * kTile;
    prefetch(pair);
    const float* xk = x + 2 * kp;
    const HalfPair first(pair);
    for (int m = 0; m < ROWS; ++m)
      lo[m] = _mm256_fmadd_ps(first.odd, _mm256_broadcast_ss(xk + m * x_stride + 1),
                              _mm256_fmadd_ps(first.even, _mm256_broadcast_ss(xk + m * x_stride), lo[m]));
    const HalfPair second(pair + kTile);
    for (int m = 0; m < ROWS; ++m)
      hi[m] = _mm256_fmadd_ps(second.odd, _mm256_broadcast_ss(xk + m * x_stride + 1),
                              _mm256_fmadd_ps(second.even, _mm256_broadcast_ss(xk + m * x_stride), hi[m]));
  }
  for (int m = 0; m < ROWS; ++m) {
    _mm256_storeu_ps(acc + m * kTile, lo[m]);
    _mm256_storeu_ps(acc + m * kTile + 8, hi[m]);
  }
}

// With more rows than one chunk, tile_dot_f32's chunks of 4 (broadcasting each input for both
// halves) leave the loads, not the FMAs, the bound: per pair 18 loads and 6 shifts for 16 FMAs.
// widened_tile_dot_f32 takes chunks of up to 6 rows, both halves at once: per input 2 weight
// registers and 6 broadcasts for 12 FMAs (12 accumulators, 2 weights, a broadcast: 15 registers).
// Each chunk widens the packed tile (K * 32 bytes, in L1/L2) in registers again (Widen::kOnly), or,
// beyond kWidenOnlyMaxRows rows, the tile's first chunk stores what it widens into `widened`
// ([2 * pairs, 16] float32, twice the bytes) as it multiplies (kStore) and the others read it back
// (kRead). The 121 matmuls of a 135M model's step with distinct weights (from DRAM), 2 threads on the
// AVX2 EPYC, the two builds taking turns in one process: re-widening in every chunk takes 0.91-0.95x
// the time at 4-12 rows, 0.96-0.98x at 16-32, 1.00x at 40-64, 1.01-1.02x at 128-512 (1 thread: 0.89x
// at 6 rows, 0.98x at 32). Each row's sums run in the same order as tile_dot_f32's, so the bits are
// the same in every mode.
constexpr int kWidenedChunkRows = 6;
constexpr int64_t kWidenedMinRows = 4;  // at 2-3 rows widened_tile_dot_f32 took 1.01-1.09x tile_dot_f32's time
constexpr int64_t kWidenOnlyMaxRows = 32;
enum class Widen { kOnly, kStore, kRead };
// Where x outgrows the caches, a thread's tiles pass over panels of its rows in turn (run_tiles'
// panel_rows). With all rows at once, each 6-row chunk's inputs of a 2,048-row prompt step (4.5 MiB
// at K = 576) came in from L3 for every tile; in panels of at most 192 KiB (85 rows at K = 576, 32 at
// K = 1,536) they stay in L2. A layer's four projections, 2 threads on the AVX2 EPYC: 0.96-0.97x the
// time at 2,048 rows, 0.99x at 1,024; at 512 rows and below, within 1 % either way, so panels start
// at 2 MiB of x. (The quantized kernels' 96 KiB panels from 512 KiB took 1.01-1.02x the time at
// 100-512 rows here: each panel widens every tile again.)
constexpr int64_t kPanelBytes = 192 << 10;
constexpr int64_t kPanelsFrom = 2 << 20;

// Accumulators as named variables (a pair per row): held in arrays, GCC stores every one of them to
// the stack at each step (12 stores to 12 FMAs: half the speed).
struct RowSums {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  void add(__m256 w_lo, __m256 w_hi, const float* xk) {
    const __m256 xm = _mm256_broadcast_ss(xk);
    lo = _mm256_fmadd_ps(w_lo, xm, lo);
    hi = _mm256_fmadd_ps(w_hi, xm, hi);
  }
  void store(float* acc) const {
    _mm256_storeu_ps(acc, lo);
    _mm256_storeu_ps(acc + 8, hi);
  }
};

template <int ROWS>
struct ChunkSums {
  static_assert(ROWS >= 1 && ROWS <= 6, "six rows: 12 accumulators, 2 weights and a broadcast in 16 registers");
  RowSums r0, r1, r2, r3, r4, r5;

  // Input k's weights (the tile's 16 output rows as two halves) times x[m, k] for each row m.
  void add(__m256 w_lo, __m256 w_hi, const float* xk, int64_t x_stride) {
    // In registers: else, below 5 rows, GCC loads them again for each row's FMA (4 rows ran slower than 5).
    in_register(w_lo);
    in_register(w_hi);
    r0.add(w_lo, w_hi, xk);
    if constexpr (ROWS > 1) r1.add(w_lo, w_hi, xk + x_stride);
    if constexpr (ROWS > 2) r2.add(w_lo, w_hi, xk + 2 * x_stride);
    if constexpr (ROWS > 3) r3.add(w_lo, w_hi, xk + 3 * x_stride);
    if constexpr (ROWS > 4) r4.add(w_lo, w_hi, xk + 4 * x_stride);
    if constexpr (ROWS > 5) r5.add(w_lo, w_hi, xk + 5 * x_stride);
  }
  void store(float* acc) const {
    r0.store(acc);
    if constexpr (ROWS > 1) r1.store(acc + kTile);
    if constexpr (ROWS > 2) r2.store(acc + 2 * kTile);
    if constexpr (ROWS > 3) r3.store(acc + 3 * kTile);
    if constexpr (ROWS > 4) r4.store(acc + 4 * kTile);
    if constexpr (ROWS > 5) r5.store(acc + 5 * kTile);
  }
};

// One half of a packed pair's weights widened: input k's (the low 16 bits of each lane) or k + 1's.
inline __m256 widen_even(const uint16_t* half) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half)), 16));
}
inline __m256 widen_odd(const uint16_t* half) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half)), high));
}

// kMode: widen the packed tile `w` in registers (kOnly), and store it into `widened` as it goes
// (kStore), or read `widened` back (kRead). Either way `prefetch` keys on the packed lines.
template <int ROWS, Widen kMode>
void widened_tile_dot_f32(float* widened, const uint16_t* w, const float* x, int64_t x_stride, int64_t pairs,
                          float* acc, Prefetcher prefetch) {
  ChunkSums<ROWS> sums;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* pair = w + kp * 2 * kTile;
    prefetch(pair);
    float* even = widened + 2 * kp * kTile;  // input 2kp's 16 weights, then 2kp + 1's
    const float* xk = x + 2 * kp;
    if constexpr (kMode != Widen::kRead) {
      // The odd input's halves are loaded again (from L1) rather than kept: 17 registers otherwise.
      __m256 lo = widen_even(pair), hi = widen_even(pair + kTile);
      if constexpr (kMode == Widen::kStore) {
        _mm256_storeu_ps(even, lo);
        _mm256_storeu_ps(even + 8, hi);
      }
      sums.add(lo, hi, xk, x_stride);
      lo = widen_odd(pair);
      hi = widen_odd(pair + kTile);
      if constexpr (kMode == Widen::kStore) {
        _mm256_storeu_ps(even + kTile, lo);
        _mm256_storeu_ps(even + kTile + 8, hi);
      }
      sums.add(lo, hi, xk + 1, x_stride);
    } else {
      sums.add(_mm256_loadu_ps(even), _mm256_loadu_ps(even + 8), xk, x_stride);
      sums.add(_mm256_loadu_ps(even + kTile), _mm256_loadu_ps(even + kTile + 8), xk + 1, x_stride);
    }
  }
  sums.store(acc);
}

// This thread's current tile, widened by its first chunk, on a cache line's boundary: a buffer 16
// bytes off one split every other load across two lines (the 9-row case ran 10 % slower).
float* widened_tile_buffer(int64_t elems) {
  thread_local std::vector<float> storage;
  if (storage.size() < static_cast<size_t>(elems + kTile)) storage.resize(static_cast<size_t>(elems + kTile));
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
}

template <Widen kMode>
constexpr auto kWidenedTileDots =
    per_row_count<kWidenedChunkRows>([](auto rows) { return &widened_tile_dot_f32<rows, kMode>; });
#else
template <int ROWS>
void tile_dot_f32(const uint16_t* w, const float* x, int64_t x_stride, int64_t pairs, float* acc,
                  Prefetcher prefetch) {
  portable_pair_tile_dot<ROWS>(w, x, x_stride, pairs, acc);
}
#endif

constexpr auto kTileDots = per_row_count<kChunkRows>([](auto rows) { return &tile_dot_f32<rows>; });

at::Tensor skinny_linear_f32(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "skinny_linear_f32: x must be [rows, in_features] float32");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "skinny_linear_f32: packed must come from pack_skinny_weight");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t k = xc.size(1), pairs = packed.size(1), tiles = packed.size(0);
  TORCH_CHECK(pairs * 2 == k, "skinny_linear_f32: x has ", k, " features, the weight ", pairs * 2);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* xp = xc.data_ptr<float>();
  const int64_t x_stride = xc.stride(0), tile_elems = pairs * 2 * kTile;
#if defined(__AVX2__) && defined(__FMA__)
  if (xc.size(0) >= kWidenedMinRows && pairs > 0) {
    const int64_t panel_rows = rows_per_panel(xc.size(0), k * sizeof(float), kPanelBytes, kPanelsFrom, kWidenedChunkRows);
    return run_tiles<kWidenedChunkRows, 1, PrefetchPolicy::kNextBlockShare, ChunkSplit::kEven>(
        "skinny_linear_f32", xc, w, tiles, tile_elems * 2, bias, out_features,
        [&](int64_t t, int64_t, int64_t m0, int64_t chunk, float* acc, Prefetcher prefetch) {
          const auto& dots = xc.size(0) <= kWidenOnlyMaxRows ? kWidenedTileDots<Widen::kOnly>
                             : m0 % panel_rows == 0         ? kWidenedTileDots<Widen::kStore>
                                                            : kWidenedTileDots<Widen::kRead>;
          dots[chunk - 1](widened_tile_buffer(tile_elems), w + t * tile_elems, xp + m0 * x_stride, x_stride, pairs,
                          acc, prefetch);
        },
        NoThreadSetup{}, panel_rows);
  }
#endif
  return run_tiles<kChunkRows>("skinny_linear_f32", xc, w, tiles, tile_elems * 2, bias, out_features,
                               [&](int64_t t, int64_t, int64_t m0, int64_t chunk, float* acc, Prefetcher prefetch) {
                                 kTileDots[chunk - 1](w + t * tile_elems, xp + m0 * x_stride, x_stride, pairs, acc,
                                                      prefetch);
                               });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("skinny_linear_f32(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("skinny_linear_f32", &skinny_linear_f32); }
