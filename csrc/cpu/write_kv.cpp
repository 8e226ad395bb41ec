// Reshape-and-cache for the CPU backend's layout: one step's new K/V into their slots.
//
//   K: [num_blocks, num_kv_heads, head_size, block_size]  (tiles transposed, see paged_decode_attention.cpp)
//   V: [num_blocks, num_kv_heads, block_size, head_size]
// each (block, head) tile contiguous, blocks and heads at any stride.
//
// In torch this is an index_put_ through a permuted view plus an index_copy_, two dispatches
// and index tensors per layer, ~60 us per layer for a batch of 32 decode tokens; a loop
// over tokens and heads is a few microseconds.
//
// The int8 cache (--kv-cache-dtype int8) keeps each (block, head) tile as a record: the tile's
// codes in the layout above, then the block's 16 per-token float32 scales. A token's head is
// rounded symmetrically with one scale, x ~ code * scale, scale = max|x| / 127, as OpenVINO's
// CPU plugin rounds its u8 cache per token and head (there with a zero point).
//
// Registered as torch.ops.kvserve_cpu.write_kv and write_kv_int8.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

using namespace kvserve_cpu;

// Calls write(k_row, v_row, k_tile, v_tile, offset) for each token and KV head whose slot is not
// -1: that head's new K and V ([head_size] each, T) and the (block, head) tiles of the two caches
// (element type C) its slot falls in, the token being row `offset` of the block.
template <typename T, typename C, typename Write>
void for_each_written_head(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const int64_t* slots, int64_t block_size, const Write& write) {
  const int64_t num_tokens = key.size(0), kv_heads = key.size(1), head_size = key.size(2);
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  C* kc = key_cache.data_ptr<C>();
  C* vc = value_cache.data_ptr<C>();
  const int64_t k_block = key_cache.stride(0), k_head = key_cache.stride(1);
  const int64_t v_block = value_cache.stride(0), v_head = value_cache.stride(1);
  at::parallel_for(0, num_tokens * kv_heads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t slot = slots[item / kv_heads], h = item % kv_heads;
      if (slot < 0) continue;  // a token whose K/V is not to be stored
      const int64_t block = slot / block_size;
      write(k + item * head_size, v + item * head_size, kc + block * k_block + h * k_head,
            vc + block * v_block + h * v_head, slot % block_size);
    }
  });
}

// Each head's K and V stored as the cache's type C: copied where C is T, else rounded as
// torch's .to() rounds (to nearest even for bfloat16), so a float32 model can keep a bf16 cache.
template <typename T, typename C>
void write_all(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
               const int64_t* slots) {
  const int64_t head_size = key.size(2), block_size = value_cache.size(2);
  for_each_written_head<T, C>(key, value, key_cache, value_cache, slots, block_size,
                              [&](const T* k_row, const T* v_row, C* k_tile, C* v_tile, int64_t offset) {
    auto stored = [](T x) { return static_cast<C>(static_cast<float>(x)); };
    for (int64_t d = 0; d < head_size; ++d) k_tile[d * block_size + offset] = stored(k_row[d]);
    if constexpr (std::is_same_v<T, C>) {
      std::memcpy(v_tile + offset * head_size, v_row, head_size * sizeof(T));
    } else {
      for (int64_t d = 0; d < head_size; ++d) v_tile[offset * head_size + d] = stored(v_row[d]);
    }
  });
}

// quantize_head for n a multiple of 16, 16 lanes at a time: the same division and the same rounding
// to nearest even (adding and subtracting 1.5 * 2^23 rounds any |q| < 2^22 so), so the same codes.
template <typename T>
float quantize_head_lanes(const T* x, int64_t n, int8_t* codes, int64_t code_stride) {
  const Vec16 largest = splat(std::numeric_limits<float>::max());
  Vec16 amax{};
  Int16 finite = Int16{} - 1;
  for (int64_t i = 0; i < n; i += kLanes) {
    const Vec16 v = load16(x + i);
    const Vec16 magnitude = v < 0.f ? -v : v;
    finite &= magnitude <= largest;  // false for NaN and for either infinity
    amax = magnitude > amax ? magnitude : amax;
  }
  const float m = reduce_max_any_order(amax);
  if (!all_lanes(finite) || m == 0.f) {
    for (int64_t i = 0; i < n; ++i) codes[i * code_stride] = 0;
    return all_lanes(finite) ? 0.f : std::numeric_limits<float>::quiet_NaN();
  }
  const float scale = m / 127.f;
  const Vec16 round_even = splat(12582912.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    Vec16 code = (load16(x + i) / scale + round_even) - round_even;
    code = code > 127.f ? splat(127.f) : code;
    code = code < -127.f ? splat(-127.f) : code;
    const Int16 narrow = __builtin_convertvector(code, Int16);
    if (code_stride == 1) {
      store_narrowed(codes + i, narrow);
    } else {
      for (int64_t j = 0; j < kLanes; ++j) codes[(i + j) * code_stride] = static_cast<int8_t>(narrow[j]);
    }
  }
  return scale;
}

// x[0..n) as codes (code_stride apart) in [-127, 127]; returns the scale: 0 for an all-zero row,
// NaN for one holding a NaN or an infinity (so that it reaches the output as it would from a float
// cache instead of vanishing).
template <typename T>
float quantize_head(const T* x, int64_t n, int8_t* codes, int64_t code_stride) {
  if (n % kLanes == 0) return quantize_head_lanes(x, n, codes, code_stride);
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  if (!finite || amax == 0.f) {
    for (int64_t i = 0; i < n; ++i) codes[i * code_stride] = 0;
    return finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
  }
  const float scale = amax / 127.f;
  for (int64_t i = 0; i < n; ++i) {
    const float code = std::nearbyint(static_cast<float>(x[i]) / scale);  // ties to even
    codes[i * code_stride] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
  }
  return scale;
}

template <typename T>
void write_all_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                    const int64_t* slots, int64_t block_size) {
  const int64_t head_size = key.size(2), tile = block_size * head_size;
  for_each_written_head<T, int8_t>(key, value, key_cache, value_cache, slots, block_size,
                                   [&](const T* k_row, const T* v_row, int8_t* k_record, int8_t* v_record,
                                       int64_t offset) {
    const float k_scale = quantize_head(k_row, head_size, k_record + offset, block_size);
    const float v_scale = quantize_head(v_row, head_size, v_record + offset * head_size, 1);
    std::memcpy(k_record + tile + offset * sizeof(float), &k_scale, sizeof(float));
    std::memcpy(v_record + tile + offset * sizeof(float), &v_scale, sizeof(float));
  });
}

// slot_mapping, contiguous, once every token's slot is checked to be -1 or one of the cache's num_slots.
at::Tensor checked_slots(const char* op, const at::Tensor& slot_mapping, int64_t num_tokens, int64_t num_slots) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == num_tokens, op,
              ": one int64 slot per token");
  auto slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slot_ptr[t] < num_slots, op, ": slot ", slot_ptr[t], " beyond the cache");
  }
  return slots;
}

// key, value: [num_tokens, num_kv_heads, head_size]; slot_mapping: [num_tokens] int64, -1 = skip. The caches
// may be of another float type than key and value (a float32 model's bf16 cache).
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "write_kv: key and value [tokens, kv_heads, d]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4, "write_kv: 4-d caches");
  const int64_t num_blocks = value_cache.size(0), kv_heads = value_cache.size(1);
  const int64_t block_size = value_cache.size(2), head_size = value_cache.size(3);
  TORCH_CHECK(key.size(1) == kv_heads && key.size(2) == head_size, "write_kv: key shape does not match the cache");
  TORCH_CHECK(key_cache.size(0) == num_blocks && key_cache.size(1) == kv_heads && key_cache.size(2) == head_size &&
                  key_cache.size(3) == block_size, "write_kv: K must be V's shape with the last two dims swapped");
  TORCH_CHECK(key_cache.stride(3) == 1 && key_cache.stride(2) == block_size && value_cache.stride(3) == 1 &&
                  value_cache.stride(2) == head_size, "write_kv: each cache tile must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "write_kv: one dtype for K and V, one for the two caches");
  const auto slots = checked_slots("write_kv", slot_mapping, key.size(0), num_blocks * block_size);
  const auto k = key.contiguous(), v = value.contiguous();
  dispatch_float_types(key.scalar_type(), "write_kv", [&](auto type) {
    dispatch_float_types(key_cache.scalar_type(), "write_kv", [&](auto cache_type) {
      write_all<decltype(type), decltype(cache_type)>(k, v, key_cache, value_cache, slots.data_ptr<int64_t>());
    });
  });
}

// key, value: [num_tokens, num_kv_heads, head_size] float32, bfloat16 or float16; the caches
// [num_blocks, num_kv_heads, record] int8 with record = 16 * head_size codes + 16 float32 scales.
void write_kv_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                   const at::Tensor& slot_mapping) {
  constexpr int64_t kBlockSize = 16;
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "write_kv_int8: key and value [tokens, kv_heads, d]");
  TORCH_CHECK(key_cache.dim() == 3 && value_cache.sizes() == key_cache.sizes() &&
                  key_cache.scalar_type() == at::kChar && value_cache.scalar_type() == at::kChar,
              "write_kv_int8: K and V caches [blocks, kv_heads, record] int8");
  const int64_t num_blocks = key_cache.size(0), kv_heads = key_cache.size(1), head_size = key.size(2);
  TORCH_CHECK(key.size(1) == kv_heads && key_cache.size(2) == kBlockSize * (head_size + 4),
              "write_kv_int8: key shape does not match the cache's records");
  TORCH_CHECK(key_cache.stride(2) == 1 && value_cache.stride(2) == 1, "write_kv_int8: each record must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "write_kv_int8: one dtype for K and V");
  const auto slots = checked_slots("write_kv_int8", slot_mapping, key.size(0), num_blocks * kBlockSize);
  const auto k = key.contiguous(), v = value.contiguous();
  dispatch_float_types(key.scalar_type(), "write_kv_int8", [&](auto type) {
    write_all_int8<decltype(type)>(k, v, key_cache, value_cache, slots.data_ptr<int64_t>(), kBlockSize);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.def("write_kv_int8(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("write_kv_int8", &write_kv_int8);
}
