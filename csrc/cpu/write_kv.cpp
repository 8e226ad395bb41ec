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
// Registered as torch.ops.kvserve_cpu.write_kv.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

template <typename T>
void write_all(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
               const int64_t* slots) {
  const int64_t num_tokens = key.size(0), kv_heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = value_cache.size(2);
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* kc = key_cache.data_ptr<T>();
  T* vc = value_cache.data_ptr<T>();
  const int64_t k_block = key_cache.stride(0), k_head = key_cache.stride(1);
  const int64_t v_block = value_cache.stride(0), v_head = value_cache.stride(1);
  at::parallel_for(0, num_tokens * kv_heads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / kv_heads, h = item % kv_heads;
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // a token whose K/V is not to be stored
      const int64_t block = slot / block_size, offset = slot % block_size;
      const T* k_row = k + (t * kv_heads + h) * head_size;
      T* k_tile = kc + block * k_block + h * k_head;
      for (int64_t d = 0; d < head_size; ++d) k_tile[d * block_size + offset] = k_row[d];
      std::memcpy(vc + block * v_block + h * v_head + offset * head_size, v + (t * kv_heads + h) * head_size,
                  head_size * sizeof(T));
    }
  });
}

// key, value: [num_tokens, num_kv_heads, head_size]; slot_mapping: [num_tokens] int64, -1 = skip
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
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type() &&
                  key_cache.scalar_type() == value_cache.scalar_type(), "write_kv: one dtype for K/V and caches");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == key.size(0),
              "write_kv: one int64 slot per token");
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t) {
    TORCH_CHECK(slot_ptr[t] < num_blocks * block_size, "write_kv: slot ", slot_ptr[t], " beyond the cache");
  }
  const auto k = key.contiguous(), v = value.contiguous();
  switch (key.scalar_type()) {
    case at::kFloat: write_all<float>(k, v, key_cache, value_cache, slot_ptr); break;
    case at::kBFloat16: write_all<c10::BFloat16>(k, v, key_cache, value_cache, slot_ptr); break;
    case at::kHalf: write_all<c10::Half>(k, v, key_cache, value_cache, slot_ptr); break;
    default: TORCH_CHECK(false, "write_kv: dtype ", key.scalar_type(), " is not float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("write_kv", &write_kv); }
