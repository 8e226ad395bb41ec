// Element types as seen by the kernels: a storage type plus conversions to and
// from fp32 (all arithmetic is fp32). Every cache access is a 16-byte vector
// (uint4), which is exactly one "x" group of the vLLM key layout, so unpacking
// a uint4 into kVec floats is the only vector operation the kernels need.
#pragma once

#include <cstdint>

#include "compat.h"

namespace kvserve {

struct F32 {
  using storage = float;
  static constexpr int kVec = 4;  // 16 bytes / 4
  static KV_DEVICE float to_float(float v) { return v; }
  static KV_DEVICE float from_float(float v) { return v; }
  static KV_DEVICE void unpack(const uint4& r, float (&f)[kVec]) {
    f[0] = __uint_as_float(r.x);
    f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z);
    f[3] = __uint_as_float(r.w);
  }
};

// Two 16-bit elements per 32-bit word, element 0 in the low half (little endian).
struct F16 {
  using storage = uint16_t;
  static constexpr int kVec = 8;
  static KV_DEVICE float to_float(uint16_t v) { return kv_half_bits_to_float(v); }
  static KV_DEVICE uint16_t from_float(float v) { return kv_float_to_half_bits(v); }
  static KV_DEVICE void unpack_word(uint32_t w, float* f) {
    f[0] = kv_half_bits_to_float(static_cast<uint16_t>(w & 0xffffu));
    f[1] = kv_half_bits_to_float(static_cast<uint16_t>(w >> 16));
  }
  static KV_DEVICE void unpack(const uint4& r, float (&f)[kVec]) {
    unpack_word(r.x, f + 0);
    unpack_word(r.y, f + 2);
    unpack_word(r.z, f + 4);
    unpack_word(r.w, f + 6);
  }
};

// bf16 is the top half of an fp32, so conversions are pure bit operations and
// need no vendor bf16 header (their names differ between CUDA and MUSA).
struct BF16 {
  using storage = uint16_t;
  static constexpr int kVec = 8;
  static KV_DEVICE float to_float(uint16_t v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }
  static KV_DEVICE uint16_t from_float(float v) {
    uint32_t u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays a quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
    return static_cast<uint16_t>(u >> 16);
  }
  static KV_DEVICE void unpack_word(uint32_t w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  static KV_DEVICE void unpack(const uint4& r, float (&f)[kVec]) {
    unpack_word(r.x, f + 0);
    unpack_word(r.y, f + 2);
    unpack_word(r.z, f + 4);
    unpack_word(r.w, f + 6);
  }
};

}  // namespace kvserve
