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
// the next chunk. Accumulation is float32, rounded to bf16 once at the end, as oneDNN does;
// only the order of the additions differs.
//
// Registered as torch.ops.kvserve_cpu.{pack_skinny_weight, skinny_linear}.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "vec16.h"

namespace {

using namespace kvserve_cpu;

constexpr int64_t kTile = 16;    // output rows per tile: one register of float32 accumulators
constexpr int kMaxChunkRows = 8;  // rows of x sharing each weight load

inline int32_t load_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// acc[m][0..16) = sum over k of x[m, k] * W[tile row, k], for ROWS rows of x.
#if defined(__AVX512BF16__)
template <int ROWS>
void tile_dot(const uint16_t* w, const uint16_t* x, int64_t x_stride, int64_t pairs, float* acc) {
  // Independent accumulator chains per row, so that one row alone is not bound by the
  // instruction's latency.
  constexpr int kChains = ROWS > 4 ? 1 : 2;
  __m512 sums[ROWS][kChains];
  for (int m = 0; m < ROWS; ++m)
    for (int c = 0; c < kChains; ++c) sums[m][c] = _mm512_setzero_ps();
  int64_t kp = 0;
  for (; kp + kChains <= pairs; kp += kChains) {
    for (int c = 0; c < kChains; ++c) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (kp + c) * 2 * kTile);
      for (int m = 0; m < ROWS; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(load_pair(x + m * x_stride + 2 * (kp + c)));
        sums[m][c] = _mm512_dpbf16_ps(sums[m][c], wv, xv);
      }
    }
  }
  for (; kp < pairs; ++kp) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + kp * 2 * kTile);
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(load_pair(x + m * x_stride + 2 * kp));
      sums[m][0] = _mm512_dpbf16_ps(sums[m][0], wv, xv);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    __m512 total = sums[m][0];
    for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, sums[m][c]);
    _mm512_storeu_ps(acc + m * kTile, total);
  }
}
#else
template <int ROWS>
void tile_dot(const uint16_t* w, const uint16_t* x, int64_t x_stride, int64_t pairs, float* acc) {
  Vec16 sums[ROWS] = {};
  for (int64_t kp = 0; kp < pairs; ++kp) {
    // Each 32-bit lane holds one row's (k, k+1) pair: k in the low half, k+1 in the high.
    UInt16 raw;
    std::memcpy(&raw, w + kp * 2 * kTile, sizeof(raw));
    const UInt16 lo = raw << 16, hi = raw & 0xFFFF0000u;
    Vec16 w_even, w_odd;
    std::memcpy(&w_even, &lo, sizeof(w_even));
    std::memcpy(&w_odd, &hi, sizeof(w_odd));
    for (int m = 0; m < ROWS; ++m) {
      const uint16_t* xm = x + m * x_stride + 2 * kp;
      const uint32_t even_bits = static_cast<uint32_t>(xm[0]) << 16, odd_bits = static_cast<uint32_t>(xm[1]) << 16;
      float even, odd;
      std::memcpy(&even, &even_bits, sizeof(even));
      std::memcpy(&odd, &odd_bits, sizeof(odd));
      sums[m] += w_even * even + w_odd * odd;
    }
  }
  for (int m = 0; m < ROWS; ++m) store16(acc + m * kTile, sums[m]);
}
#endif

using TileDot = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, float*);

template <size_t... I>
constexpr std::array<TileDot, sizeof...(I)> make_tile_dots(std::index_sequence<I...>) {
  return {&tile_dot<static_cast<int>(I) + 1>...};
}

// kTileDots[r - 1] handles a chunk of r rows.
constexpr auto kTileDots = make_tile_dots(std::make_index_sequence<kMaxChunkRows>{});

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

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "skinny_linear: x must be [rows, in_features] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "skinny_linear: packed must come from pack_skinny_weight");
  const int64_t rows = x.size(0), k = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == k, "skinny_linear: x has ", k, " features, the weight ", packed.size(1) * 2);
  TORCH_CHECK(out_features > (tiles - 1) * kTile && out_features <= tiles * kTile,
              "skinny_linear: out_features ", out_features, " does not match the packed weight");
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "skinny_linear: bias must be [out_features]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const int64_t x_stride = xc.stride(0);
  const float* b = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  auto* y = out.data_ptr<at::BFloat16>();
  const int64_t pairs = k / 2;
  // A thread's share: enough tiles to be worth the wake-up (~64 KiB of weights).
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(k * 2 * kTile, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    float acc[kMaxChunkRows * kTile];
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* wt = w + t * pairs * 2 * kTile;
      const int64_t col0 = t * kTile, cols = std::min(kTile, out_features - col0);
      const Vec16 bias_v = b ? (cols == kTile ? load16(b + col0) : Vec16{}) : Vec16{};
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxChunkRows) {
        const int64_t chunk = std::min<int64_t>(kMaxChunkRows, rows - m0);
        kTileDots[chunk - 1](wt, xp + m0 * x_stride, x_stride, pairs, acc);
        for (int64_t m = 0; m < chunk; ++m) {
          at::BFloat16* dst = y + (m0 + m) * out_features + col0;
          if (cols == kTile) {
            store16(dst, load16(acc + m * kTile) + bias_v);
          } else {
            for (int64_t j = 0; j < cols; ++j) dst[j] = static_cast<at::BFloat16>(acc[m * kTile + j] + (b ? b[col0 + j] : 0.f));
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("pack_skinny_weight(Tensor weight) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("pack_skinny_weight", &pack_skinny_weight);
  m.impl("skinny_linear", &skinny_linear);
}
