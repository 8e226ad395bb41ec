// The packed weight layouts of skinny_linear.cpp (pack_skinny_weight / _int8 / _int4), which
// prompt_linear.cpp reads as well, and what every kernel on them checks of its outputs and bias.
#pragma once

#include <ATen/ATen.h>

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

}  // namespace kvserve_cpu
