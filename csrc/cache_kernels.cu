// reshape_and_cache (scatter new K/V into their slots) and copy_blocks
// (copy-on-write for all layers at once). Both move bytes without arithmetic,
// so they are instantiated on element width, not dtype.
#include <cstdint>

#include "compat.h"
#include "kernels.h"

namespace kvserve {
namespace {

// One CTA per token. Both caches keep a (block, kv head) pair as one contiguous
// chunk of head_size * block_size elements; inside it the key puts dim d of
// token `off` at (d / x, off, d % x) and the value at (d, off).
template <typename E>
__global__ void reshape_and_cache_kernel(const E* __restrict__ key, const E* __restrict__ value,
                                         E* __restrict__ key_cache, E* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int num_kv_heads,
                                         int head_size, int block_size, int64_t key_stride,
                                         int64_t value_stride) {
  constexpr int x = 16 / sizeof(E);
  const int64_t t = blockIdx.x;
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;  // padding token: no slot
  const int64_t blk = slot / block_size;
  const int off = static_cast<int>(slot % block_size);
  const int n = num_kv_heads * head_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int h = i / head_size, d = i % head_size;
    const int64_t base = (blk * num_kv_heads + h) * static_cast<int64_t>(head_size) * block_size;
    key_cache[base + (d / x) * block_size * x + off * x + d % x] = key[t * key_stride + i];
    value_cache[base + static_cast<int64_t>(d) * block_size + off] = value[t * value_stride + i];
  }
}

// grid (num_layers, num_pairs); 16-byte vectors (a block is always a multiple
// of 16 bytes because head_size is a multiple of x).
__global__ void copy_blocks_kernel(const int64_t* __restrict__ key_cache_ptrs,
                                   const int64_t* __restrict__ value_cache_ptrs,
                                   const int64_t* __restrict__ block_mapping, int64_t vecs_per_block) {
  const int layer = blockIdx.x;
  const int pair = blockIdx.y;
  const int64_t src = block_mapping[2 * pair] * vecs_per_block;
  const int64_t dst = block_mapping[2 * pair + 1] * vecs_per_block;
  uint4* k = reinterpret_cast<uint4*>(key_cache_ptrs[layer]);
  uint4* v = reinterpret_cast<uint4*>(value_cache_ptrs[layer]);
  for (int64_t i = threadIdx.x; i < vecs_per_block; i += blockDim.x) {
    k[dst + i] = k[src + i];
    v[dst + i] = v[src + i];
  }
}

const char* last_error() {
  const kvError_t err = kvGetLastError();
  return err == kvSuccess ? nullptr : kvGetErrorString(err);
}

}  // namespace

const char* reshape_and_cache_launch(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping, int num_tokens,
                                     int num_kv_heads, int head_size, int block_size,
                                     int64_t key_token_stride, int64_t value_token_stride,
                                     int elem_bytes, kvStream_t stream) {
  if (num_tokens == 0) return nullptr;
  const int threads = num_kv_heads * head_size < 512 ? num_kv_heads * head_size : 512;
  if (elem_bytes == 2) {
    KV_LAUNCH(reshape_and_cache_kernel<uint16_t>, num_tokens, threads, 0, stream,
        static_cast<const uint16_t*>(key), static_cast<const uint16_t*>(value),
        static_cast<uint16_t*>(key_cache), static_cast<uint16_t*>(value_cache), slot_mapping,
        num_kv_heads, head_size, block_size, key_token_stride, value_token_stride);
  } else if (elem_bytes == 4) {
    KV_LAUNCH(reshape_and_cache_kernel<uint32_t>, num_tokens, threads, 0, stream,
        static_cast<const uint32_t*>(key), static_cast<const uint32_t*>(value),
        static_cast<uint32_t*>(key_cache), static_cast<uint32_t*>(value_cache), slot_mapping,
        num_kv_heads, head_size, block_size, key_token_stride, value_token_stride);
  } else {
    return "reshape_and_cache: element size must be 2 or 4 bytes";
  }
  return last_error();
}

const char* copy_blocks_launch(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                               const int64_t* block_mapping, int num_layers, int num_pairs,
                               int64_t bytes_per_block, kvStream_t stream) {
  if (num_layers == 0 || num_pairs == 0) return nullptr;
  if (bytes_per_block % 16 != 0) return "copy_blocks: block bytes must be a multiple of 16";
  if (num_pairs > 65535) return "copy_blocks: at most 65535 pairs per launch";
  const dim3 grid(num_layers, num_pairs);
  KV_LAUNCH(copy_blocks_kernel, grid, 256, 0, stream, key_cache_ptrs, value_cache_ptrs, block_mapping,
            bytes_per_block / 16);
  return last_error();
}

// ---- paged attention: dtype dispatch to the per-dtype translation units.

bool paged_attention_supported(DType dtype, int head_size, int block_size) {
  const bool head_ok = head_size == 64 || head_size == 80 || head_size == 96 || head_size == 112 ||
                       head_size == 128 || head_size == 256;
  const bool block_ok = block_size == 8 || block_size == 16 || block_size == 32;
  const bool dtype_ok = dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  return head_ok && block_ok && dtype_ok;
}

const char* paged_attention_launch(const PagedAttentionParams& p, kvStream_t stream) {
  if (p.num_seqs == 0) return nullptr;
  switch (p.dtype) {
    case DType::kFloat32: return paged_attention_launch_f32(p, stream);
    case DType::kFloat16: return paged_attention_launch_f16(p, stream);
    case DType::kBFloat16: return paged_attention_launch_bf16(p, stream);
  }
  return "paged_attention: unsupported dtype";
}

}  // namespace kvserve
