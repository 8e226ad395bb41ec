// Launchers for the kvserve kernels. Raw pointers + sizes + a stream: no torch
// types cross this boundary, so the .cu files compile with nvcc/mcc alone and
// the torch binding (bindings.cpp) is the only file that sees ATen.
//
// Every launcher returns nullptr on success, or a static/driver error string.
#pragma once

#include <cstdint>

#include "compat.h"

namespace kvserve {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// Decode attention over the paged cache (vLLM layouts; x = 16 / sizeof(elem)):
//   query        [num_seqs, num_heads, head_size]            row stride q_seq_stride
//   key_cache    [num_blocks, num_kv_heads, head_size/x, block_size, x]
//   value_cache  [num_blocks, num_kv_heads, head_size, block_size]
//   block_tables [num_seqs, max_blocks_per_seq] int32
//   seq_lens     [num_seqs] int32 (tokens of context, the new one included)
//   out          [num_seqs, num_heads, head_size] contiguous
// partition_size == 0 → v1 (one pass per sequence). partition_size > 0 → v2:
// each partition of that many tokens writes a partial result into
//   exp_sums, max_logits [num_seqs, num_heads, max_num_partitions] fp32
//   tmp_out              [num_seqs, num_heads, max_num_partitions, head_size] fp32
// and a reduce kernel merges them into out. partition_size must be a multiple
// of 128 (the kernel's token tile).
struct PagedAttentionParams {
  DType dtype;
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  float* exp_sums;
  float* max_logits;
  float* tmp_out;
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_size;
  int block_size;
  int max_blocks_per_seq;
  int64_t q_seq_stride;     // elements between consecutive sequences in query
  int64_t kv_block_stride;  // elements between consecutive blocks in a cache
  int64_t kv_head_stride;   // elements between kv heads within a block
  float scale;
  int partition_size;
  int max_num_partitions;
};

// Tile of tokens one CTA processes per step; partitions are multiples of it.
constexpr int kAttnTokensPerTile = 128;

bool paged_attention_supported(DType dtype, int head_size, int block_size);
const char* paged_attention_launch(const PagedAttentionParams& p, kvStream_t stream);

// Scatter this step's K/V into their slots. slot = block * block_size + offset;
// slot < 0 is skipped (padding tokens).
//   key, value    [num_tokens, num_kv_heads, head_size], token stride given
//   slot_mapping  [num_tokens] int64
// Element-wise byte copies: works for any 2- or 4-byte dtype.
const char* reshape_and_cache_launch(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping, int num_tokens,
                                     int num_kv_heads, int head_size, int block_size,
                                     int64_t key_token_stride, int64_t value_token_stride,
                                     int elem_bytes, kvStream_t stream);

// Copy-on-write for every layer in one launch.
//   key_cache_ptrs, value_cache_ptrs  [num_layers] device arrays of base addresses
//   block_mapping                     [num_pairs, 2] int64 (src, dst)
// bytes_per_block: bytes of one block of one cache (K and V are the same size).
const char* copy_blocks_launch(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                               const int64_t* block_mapping, int num_layers, int num_pairs,
                               int64_t bytes_per_block, kvStream_t stream);

// Per-dtype entry points, one translation unit each (compiled in parallel).
const char* paged_attention_launch_f32(const PagedAttentionParams& p, kvStream_t stream);
const char* paged_attention_launch_f16(const PagedAttentionParams& p, kvStream_t stream);
const char* paged_attention_launch_bf16(const PagedAttentionParams& p, kvStream_t stream);

}  // namespace kvserve
