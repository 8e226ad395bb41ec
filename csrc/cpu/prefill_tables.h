// What both prefill attention kernels (prefill_attention.cpp, prefill_attention_f32.cpp) check of a
// step's query, cache tiles, block tables and positions before they read a block.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kvserve_cpu {

// q: [num_seqs, kv_heads, rows, d] of `dtype` (named `dtype_name` in the message), d a multiple of
// d_multiple up to max_d, rows a whole number of query_len; q and the caches on the CPU.
inline void check_prefill_query(const char* op, const at::Tensor& q, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, at::ScalarType dtype, const char* dtype_name,
                                int64_t d_multiple, int64_t max_d, int64_t query_len) {
  TORCH_CHECK(q.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu(), op,
              ": CPU tensors only");
  TORCH_CHECK(q.scalar_type() == dtype && q.dim() == 4, op, ": q must be ", dtype_name, " [seqs, kv_heads, rows, d]");
  const int64_t rows = q.size(2), d = q.size(3);
  TORCH_CHECK(d % d_multiple == 0 && d > 0 && d <= max_d, op, ": head_size must be a multiple of ", d_multiple,
              " up to ", max_d, ", got ", d);
  TORCH_CHECK(query_len > 0 && rows % query_len == 0, op, ": rows (", rows, ") must be a multiple of query_len (",
              query_len, ")");
}

// The cpu backend's tiles for the query's kv_heads and head size d: K [num_blocks, kv_heads, d, block]
// and V [num_blocks, kv_heads, block, d], each tile contiguous.
inline void check_prefill_tile_caches(const char* op, int64_t heads, int64_t d, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, int64_t block) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.size(2) == d && key_cache.size(3) == block &&
                  value_cache.size(2) == block && value_cache.size(3) == d && key_cache.size(0) == value_cache.size(0) &&
                  key_cache.stride(3) == 1 && key_cache.stride(2) == block && value_cache.stride(3) == 1 &&
                  value_cache.stride(2) == d,
              op, ": caches must be K [num_blocks, kv_heads, head_size, 16] and V [num_blocks, kv_heads, 16, head_size]"
              " with contiguous tiles");
  TORCH_CHECK(key_cache.size(1) == heads && value_cache.size(1) == heads, op, ": q has ", heads,
              " KV heads, the caches ", key_cache.size(1));
}

// The int8 cache's records for the query's kv_heads and head size d: [num_blocks, kv_heads, block x d
// codes + block float32 scales], each record contiguous.
inline void check_prefill_int8_records(const char* op, int64_t heads, int64_t d, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, int64_t block) {
  TORCH_CHECK(key_cache.dim() == 3 && value_cache.sizes() == key_cache.sizes() &&
                  key_cache.size(2) == block * d + block * 4 && key_cache.stride(2) == 1 && value_cache.stride(2) == 1,
              op, ": int8 caches must be [num_blocks, kv_heads, 16 x head_size codes + 16 float32 scales]");
  TORCH_CHECK(key_cache.size(1) == heads && value_cache.size(1) == heads, op, ": q has ", heads,
              " KV heads, the caches ", key_cache.size(1));
}

// The caches' layout for their type (int8 records, else tiles), for kv_heads KV heads of size d.
inline void check_prefill_caches(const char* op, int64_t kv_heads, int64_t d, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, int64_t block) {
  if (key_cache.scalar_type() == at::kChar) {
    check_prefill_int8_records(op, kv_heads, d, key_cache, value_cache, block);
  } else {
    check_prefill_tile_caches(op, kv_heads, d, key_cache, value_cache, block);
  }
}

struct PrefillTables {
  at::Tensor tables, first, lens;  // block_tables, first_query_pos, seq_lens: contiguous int32
  int64_t max_blocks;              // the tables' width

  const int32_t* table_ptr() const { return tables.data_ptr<int32_t>(); }
  const int32_t* first_ptr() const { return first.data_ptr<int32_t>(); }
  const int32_t* lens_ptr() const { return lens.data_ptr<int32_t>(); }
};

// block_tables [num_seqs, max_blocks], first_query_pos and seq_lens [num_seqs], int32, such that each
// sequence's keys fit its blocks, its first query token lies among them, and every block it reads is
// one of the cache's num_blocks.
inline PrefillTables checked_prefill_tables(const char* op, const at::Tensor& block_tables,
                                            const at::Tensor& first_query_pos, const at::Tensor& seq_lens,
                                            int64_t num_seqs, int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  first_query_pos.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  first_query_pos.numel() == num_seqs && seq_lens.numel() == num_seqs,
              op, ": block_tables [seqs, max_blocks], first_query_pos and seq_lens [seqs], int32");
  PrefillTables t{block_tables.contiguous(), first_query_pos.contiguous(), seq_lens.contiguous(), block_tables.size(1)};
  const int32_t* tables = t.table_ptr();
  const int32_t* first = t.first_ptr();
  const int32_t* lens = t.lens_ptr();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] > 0 && lens[s] <= t.max_blocks * block_size && first[s] >= 0 && first[s] < lens[s], op,
                ": sequence ", s, " has seq_len ", lens[s], " and first query at ", first[s], " for ", t.max_blocks,
                " blocks");
    for (int64_t b = 0; b < (lens[s] + block_size - 1) / block_size; ++b) {
      const int32_t block = tables[s * t.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, op, ": block id ", block, " out of range");
    }
  }
  return t;
}

}  // namespace kvserve_cpu
