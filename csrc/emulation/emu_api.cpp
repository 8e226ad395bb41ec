// C entry points over the launchers for the CPU emulation (loaded with ctypes
// by tests/test_csrc_emulated.py). Build: see that test.
#include "../kernels.h"

// Built with -fvisibility=hidden: only these entry points are exported.
#define KV_EMU_API __attribute__((visibility("default")))

extern "C" {

KV_EMU_API const char* emu_paged_attention(int dtype, void* out, const void* query, const void* key_cache,
                                const void* value_cache, const int32_t* block_tables, const int32_t* seq_lens,
                                float* exp_sums, float* max_logits, float* tmp_out, int num_seqs, int num_heads,
                                int num_kv_heads, int head_size, int block_size, int max_blocks_per_seq,
                                int64_t q_seq_stride, int64_t kv_block_stride, int64_t kv_head_stride, float scale,
                                int partition_size, int max_num_partitions) {
  kvserve::PagedAttentionParams p{};
  p.dtype = static_cast<kvserve::DType>(dtype);
  p.out = out;
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.exp_sums = exp_sums;
  p.max_logits = max_logits;
  p.tmp_out = tmp_out;
  p.num_seqs = num_seqs;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_size = head_size;
  p.block_size = block_size;
  p.max_blocks_per_seq = max_blocks_per_seq;
  p.q_seq_stride = q_seq_stride;
  p.kv_block_stride = kv_block_stride;
  p.kv_head_stride = kv_head_stride;
  p.scale = scale;
  p.partition_size = partition_size;
  p.max_num_partitions = max_num_partitions;
  return kvserve::paged_attention_launch(p, nullptr);
}

KV_EMU_API const char* emu_reshape_and_cache(const void* key, const void* value, void* key_cache, void* value_cache,
                                  const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_size,
                                  int block_size, int64_t key_stride, int64_t value_stride, int elem_bytes) {
  return kvserve::reshape_and_cache_launch(key, value, key_cache, value_cache, slot_mapping, num_tokens,
                                           num_kv_heads, head_size, block_size, key_stride, value_stride,
                                           elem_bytes, nullptr);
}

KV_EMU_API const char* emu_copy_blocks(const int64_t* key_ptrs, const int64_t* value_ptrs, const int64_t* mapping,
                            int num_layers, int num_pairs, int64_t bytes_per_block) {
  return kvserve::copy_blocks_launch(key_ptrs, value_ptrs, mapping, num_layers, num_pairs, bytes_per_block,
                                     nullptr);
}

}  // extern "C"
