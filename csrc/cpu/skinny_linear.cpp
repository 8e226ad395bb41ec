// y = x @ W^T (+ bias) for a few rows of x: the bf16 projections of a decode step.
//
// With one to a few tokens a step, a projection reads every weight once and does two flops
// per weight read: it is bound by memory bandwidth. oneDNN's packed bf16 matmul reads the
// weights at 9-16 GB/s on one core of the machine it was measured on, where a single
// sequential stream of loads reaches ~21 GB/s (docs/executor.md). This kernel stores the
// weight so that the whole matmul is that one stream: tiles of 16 output rows, and within a
// tile, for each pair of input columns (k, k+1), the 16 rows' two values side by side —
// 64 bytes, one AVX-512 register, consumed by one VDPBF16PS against the broadcast pair
// x[m, k:k+2] (or, without AVX512-BF16, two FMAs on the widened halves).
//
//   packed: [ceil(N / 16), K / 2, 16, 2] bf16   (rows past N are zero)
//
// Each weight register is used for every row of x in a chunk of up to 8 rows, so a batch of
// 8 reads the weights once; the tile (16 × K × 2 bytes, 18-48 KiB here) stays in L1/L2 for
// the next chunk (the loop over tiles and chunks, and its prefetching: skinny_tiles.h).
// Accumulation is float32, rounded to bf16 once at the end, as oneDNN does; only the order of the
// additions differs. Where the CPU has AMX bf16 tiles the same layout is their B operand, and every
// call multiplies on them instead (amx_tiles_dot). The int8 and int4 weights' kernels:
// skinny_quantized.cpp.
//
// Registered as torch.ops.kvserve_cpu.{pack_skinny_weight, skinny_linear, has_amx}.

#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "packed_layout.h"
#include "skinny_tiles.h"
#include "vec16.h"

namespace {

using namespace kvserve_cpu;

// Independent accumulator chains per row of x, so that one row alone is not bound by the latency
// of its multiply-adds. The same for any number of rows: a row's sums, and so its rounding, do
// not depend on what else is in the step (a token gets the same result alone or in a batch).
constexpr int kChains = 2;

// acc[j][m][0..16) = sum over k of x[m, k] * W[row of tile j, k], for TILES consecutive tiles
// (tile_stride elements apart) and ROWS rows of x. Two tiles a call load two weight registers for
// each broadcast input pair: on the Zen 4 box a decode step's bf16 matmuls at 16-48 rows run 8-15 %
// faster than one tile a call, and than oneDNN's (the rows' sums are the same either way).
#if defined(__AVX512BF16__)
template <int TILES, int ROWS>
void tiles_dot(const uint16_t* w, int64_t tile_stride, const uint16_t* x, int64_t x_stride, int64_t pairs,
               float* acc, Prefetcher prefetch) {
  __m512 sums[TILES][ROWS][kChains];
  for (int j = 0; j < TILES; ++j)
    for (int m = 0; m < ROWS; ++m)
      for (int c = 0; c < kChains; ++c) sums[j][m][c] = _mm512_setzero_ps();
  int64_t kp = 0;
  for (; kp + kChains <= pairs; kp += kChains) {
    for (int c = 0; c < kChains; ++c) {
      __m512bh wv[TILES];
      for (int j = 0; j < TILES; ++j) {
        prefetch(w + j * tile_stride + (kp + c) * 2 * kTile);
        wv[j] = (__m512bh)_mm512_loadu_si512(w + j * tile_stride + (kp + c) * 2 * kTile);
      }
      for (int m = 0; m < ROWS; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(load_32_bits(x + m * x_stride + 2 * (kp + c)));
        for (int j = 0; j < TILES; ++j) sums[j][m][c] = _mm512_dpbf16_ps(sums[j][m][c], wv[j], xv);
      }
    }
  }
  for (; kp < pairs; ++kp) {
    for (int j = 0; j < TILES; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * tile_stride + kp * 2 * kTile);
      for (int m = 0; m < ROWS; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(load_32_bits(x + m * x_stride + 2 * kp));
        sums[j][m][0] = _mm512_dpbf16_ps(sums[j][m][0], wv, xv);
      }
    }
  }
  for (int j = 0; j < TILES; ++j) {
    for (int m = 0; m < ROWS; ++m) {
      __m512 total = sums[j][m][0];
      for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, sums[j][m][c]);
      _mm512_storeu_ps(acc + (j * ROWS + m) * kTile, total);
    }
  }
}
#else
template <int TILES, int ROWS>
void tiles_dot(const uint16_t* w, int64_t tile_stride, const uint16_t* x, int64_t x_stride, int64_t pairs,
               float* acc, Prefetcher prefetch) {
  for (int j = 0; j < TILES; ++j) {
    portable_pair_tile_dot<ROWS>(w + j * tile_stride, x, x_stride, pairs, acc + j * ROWS * kTile);
  }
}
#endif

constexpr auto kTileDots = per_row_count<kMaxChunkRows>([](auto rows) { return &tiles_dot<1, rows>; });
constexpr auto kTilePairDots = per_row_count<kMaxChunkRows>([](auto rows) { return &tiles_dot<2, rows>; });

// ---- AMX: the same layout as TDPBF16PS's B operand ---------------------------------------------
// A tile's 32 inputs x 16 outputs, [16 pairs][16][2], are 1 KiB of the packed weight as it lies.
// Per chunk of up to 32 rows of x (two row tiles of `rows` rows each: none is padded, so one row
// reads one row) and one or two weight tiles, the sums run over all of K in the accumulator tiles.
// Each row's products and additions are the same whatever the other rows: a token's bits do not
// depend on the batch, one row or 32, as with tiles_dot (but in another order than tiles_dot's).
#if defined(KVSERVE_AMX_INT8) && defined(__AMX_BF16__)
constexpr int64_t kAmxChunkRows = 32;  // two row tiles
constexpr int64_t kAmxDepth = 32;      // inputs per tile multiply

// Tiles 0-3: accumulators (row tile r, weight tile j in 2r + j); 4-5: the row tiles' 32 inputs;
// 6-7: the weight tiles'. Its rows set the row tiles' height: loaded per thread and call where every
// chunk has the same rows (a step of at most 32), else per chunk; never kept between calls, since
// oneDNN's and the other kernels' tiles run on the same threads with their own configurations.
void load_bf16_tile_config(int64_t rows) {
  const uint8_t upper = static_cast<uint8_t>(std::min<int64_t>(rows, kTile)), lower = static_cast<uint8_t>(rows - upper);
  AmxConfig config;
  for (int t : {0, 1, 4}) config.rows[t] = upper, config.colsb[t] = 64;
  if (lower) {
    for (int t : {2, 3, 5}) config.rows[t] = lower, config.colsb[t] = 64;
  }
  for (int t : {6, 7}) config.rows[t] = kTile, config.colsb[t] = 64;
  load_tile_config(config);
}

// acc[j][m][0..16) as tiles_dot<TILES, rows> gives it, for `rows` <= 32 rows of x and `count`
// (1 or 2) tiles `tile_stride` elements apart; `prefetch` is told of every weight line read;
// `configured`: the thread's tiles are configured for `rows` already.
// GCC's tile intrinsics are asm without a memory clobber, hence the compiler barriers.
void amx_tiles_dot(const uint16_t* w, int64_t tile_stride, int64_t count, const uint16_t* x, int64_t x_stride,
                   int64_t k, int64_t rows, float* acc, Prefetcher prefetch, bool configured) {
  if (!configured) load_bf16_tile_config(rows);
  const bool lower = rows > kTile, two = count == 2;
  const int64_t x_bytes = x_stride * 2;
  asm volatile("" ::: "memory");
  _tile_zero(0);
  _tile_zero(1);
  if (lower) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k0 = 0; k0 < k; k0 += kAmxDepth) {
    const uint16_t* b0 = w + k0 * kTile;  // 32 inputs of a tile: 16 pairs x 16 outputs x 2
    const uint16_t* b1 = b0 + tile_stride;
    prefetch.lines(b0, kTile);  // a B tile's 16 rows of 64 bytes
    if (two) prefetch.lines(b1, kTile);
    _tile_loadd(4, x + k0, x_bytes);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (lower) {
      _tile_loadd(5, x + kTile * x_stride + k0, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (two) {
      _tile_loadd(7, b1, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (lower) _tile_dpbf16ps(3, 5, 7);
    }
  }
  // acc's tile j holds `rows` rows of 16: the lower row tile's rows follow the upper's.
  const int64_t tile_floats = rows * kTile;
  _tile_stored(0, acc, 64);
  if (lower) _tile_stored(2, acc + kTile * kTile, 64);
  if (two) {
    _tile_stored(1, acc + tile_floats, 64);
    if (lower) _tile_stored(3, acc + tile_floats + kTile * kTile, 64);
  }
  asm volatile("" ::: "memory");
}
#endif

at::Tensor pack_skinny_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_skinny_weight: weight must be [out_features, in_features]");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "pack_skinny_weight: weight must be bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "pack_skinny_weight: in_features must be even, got ", k);
  const int64_t tiles = (n + kTile - 1) / kTile;
  at::Tensor padded = at::zeros({tiles * kTile, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [tiles, 16, K/2, 2] → [tiles, K/2, 16, 2]
  return padded.view({tiles, kTile, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor bf16_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be [rows, in_features] bfloat16");
  return x.stride(1) == 1 ? x : x.contiguous();
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features) {
  const at::Tensor xc = bf16_rows("skinny_linear", x);
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "skinny_linear: packed must come from pack_skinny_weight");
  const int64_t k = xc.size(1), pairs = packed.size(1);
  TORCH_CHECK(pairs * 2 == k, "skinny_linear: x has ", k, " features, the weight ", pairs * 2);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const int64_t x_stride = xc.stride(0);
  const int64_t tile_stride = pairs * 2 * kTile;  // bf16 elements of a tile
  const int64_t tile_bytes = tile_stride * static_cast<int64_t>(sizeof(uint16_t));
  const auto tile_chunk = [&](int64_t t, int64_t count, int64_t m0, int64_t chunk, float* acc,
                              Prefetcher prefetch) {
    const auto& dots = count == 2 ? kTilePairDots : kTileDots;
    dots[chunk - 1](w + t * tile_stride, tile_stride, xp + m0 * x_stride, x_stride, pairs, acc, prefetch);
  };
#if defined(KVSERVE_AMX_INT8) && defined(__AMX_BF16__)
  if (k % kAmxDepth == 0 && amx_bf16_usable()) {
    // Configured once per thread where all rows are one chunk: LDTILECFG per chunk made a decode
    // step's projections at 16-32 rows 3-4 % slower, 12-19 % with their weights in cache (AMX Xeon).
    const bool one_chunk = xc.size(0) <= kAmxChunkRows;
    const auto configure = [&] {
      if (one_chunk) load_bf16_tile_config(xc.size(0));
    };
    return run_tiles<kAmxChunkRows, 2, PrefetchPolicy::kAhead>(
        "skinny_linear", xc, w, packed.size(0), tile_bytes, bias, out_features,
        [&](int64_t t, int64_t count, int64_t m0, int64_t chunk, float* acc, Prefetcher prefetch) {
          amx_tiles_dot(w + t * tile_stride, tile_stride, count, xp + m0 * x_stride, x_stride, k, chunk, acc, prefetch,
                        one_chunk);
        },
        configure);
  }
#endif
  // Two tiles a call pay where the rows take several chunks; up to one chunk, where the weight
  // stream bounds the step, one tile a call is faster (one stream in bf16: 4 % a token).
  if (xc.size(0) > kMaxChunkRows) {
    return run_tiles<kMaxChunkRows, 2>("skinny_linear", xc, w, packed.size(0), tile_bytes, bias, out_features,
                                       tile_chunk);
  }
  return run_tiles<kMaxChunkRows, 1>("skinny_linear", xc, w, packed.size(0), tile_bytes, bias, out_features,
                                     tile_chunk);
}

// Whether this build runs AMX tiles here: the CPU has them (the build is for this CPU's features)
// and the kernel lets this process use them. oneDNN's bf16 and int8 GEMMs use them then too.
bool has_amx() { return amx_bf16_usable(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("has_amx", &has_amx);
  m.def("pack_skinny_weight(Tensor weight) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("pack_skinny_weight", &pack_skinny_weight);
  m.impl("skinny_linear", &skinny_linear);
}
