// The packed weight layouts of skinny_linear.cpp and skinny_quantized.cpp (pack_skinny_weight /
// _int8 / _int4), which prompt_linear.cpp reads as well, and what every kernel on them checks of
// its outputs and bias.
#pragma once

#include <ATen/ATen.h>

#include "vec16.h"

namespace kvserve_cpu {

constexpr int64_t kTile = 16;               // output rows per tile: one register of float32 accumulators
constexpr int64_t kGroup = 32;              // inputs per quantization group
constexpr int64_t kQuadBytes = 4 * kTile;   // int8 / int4 codes of 4 inputs of a tile's 16 rows: one register
constexpr int64_t kInt4CodeBytes = kTile * kGroup / 2;                 // 256
constexpr int64_t kInt4RecordBytes = kInt4CodeBytes + 2 * kTile * 2;  // + scales and zeros, bf16

// Refuses an `out_features` the packed weight (`tiles` tiles of `tile_width` outputs) does not
// hold, or a bias that is not [out_features]; returns the bias as float32 (undefined if none).
inline at::Tensor checked_bias_f32(const char* op, int64_t tiles, int64_t tile_width, int64_t out_features,
                                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(out_features > (tiles - 1) * tile_width && out_features <= tiles * tile_width, op, ": out_features ",
              out_features, " does not match the packed weight");
  if (!bias.has_value() || !bias->defined()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, op, ": bias must be [out_features]");
  return bias->to(at::kFloat).contiguous();
}

inline float widen_activation(float x) { return x; }
inline float widen_activation(uint16_t bf16_bits) { return bf16_bits_to_float(bf16_bits); }

// The skinny kernels' tile_dot where the CPU has neither AVX-512 BF16 nor their AVX2 path:
// acc[m * kTile + r] = sum over k of w[r][k] * x[m * x_stride + k] for the ROWS rows of x
// (float32, or bf16 as raw bits), w a tile of packed bf16 pairs.
template <int ROWS, typename X>
void portable_pair_tile_dot(const uint16_t* w, const X* x, int64_t x_stride, int64_t pairs, float* acc) {
  Vec16 sums[ROWS] = {};
  for (int64_t kp = 0; kp < pairs; ++kp) {
    Vec16 w_even, w_odd;
    load_bf16_pairs(w + kp * 2 * kTile, w_even, w_odd);
    for (int m = 0; m < ROWS; ++m) {
      const X* xm = x + m * x_stride + 2 * kp;
      sums[m] += w_even * widen_activation(xm[0]) + w_odd * widen_activation(xm[1]);
    }
  }
  for (int m = 0; m < ROWS; ++m) store16(acc + m * kTile, sums[m]);
}

}  // namespace kvserve_cpu
