// Paged attention for decode tokens on the CPU, reading K/V blocks where they lie.
//
// Layout of the CPU backend (executor/attention/cpu_backend.py), per layer:
//   K: [num_kv_heads, num_blocks, head_size, block_size]  (each block's tile transposed)
//   V: [num_kv_heads, num_blocks, block_size, head_size]
// with block_size == 16 == the lanes of one Vec16. Plain torch must gather a batch's
// blocks into a contiguous tensor before SDPA, which writes and re-reads the whole
// context once more per layer (at batch 32 x 1024 tokens as costly as the attention).
// Here each (sequence, kv head) streams its own blocks in place:
//   scores: a K tile column is one key dimension for all 16 tokens of the block, so a
//           block's scores are broadcast-FMAs over head_size into one vector, no
//           horizontal sums;
//   softmax over the whole row (kept in L1/L2) with a vectorized exp;
//   output: each V row scaled by its probability into float32 accumulators.
// The query heads sharing a KV head (GQA) are served by the same pass over K/V, up to
// four at a time with their accumulators in registers.
//
// Registered as torch.ops.kvserve_cpu.paged_decode_attention (TORCH_LIBRARY, no pybind).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec16.h"

namespace {

using namespace kvserve_cpu;

struct Shape {
  int64_t group;      // query heads per kv head
  int64_t head_size;  // a multiple of kLanes
  float scale;
};

// Query rows served by one pass over K/V: their accumulators live in registers, so a
// K column or a V chunk is loaded once for all of them. Larger GQA groups are split.
constexpr int kMaxRows = 4;

// scores[r][0..16) = q[r] . K[:, t] for one block; K tile [head_size, kLanes].
template <typename T, int R>
inline void block_scores(const float* q, const T* keys, int64_t head_size, float* scores, int64_t row) {
  Vec16 s[R] = {};
  for (int64_t d = 0; d < head_size; ++d) {
    const Vec16 k = load16(keys + d * kLanes);
    for (int r = 0; r < R; ++r) s[r] += q[r * head_size + d] * k;
  }
  for (int r = 0; r < R; ++r) store16(scores + r * row, s[r]);
}

// acc[r] += sum over the block's first n tokens of p[r][t] * V[t]; V tile [kLanes, head_size].
template <typename T, int R>
inline void block_values(const float* p, const T* values, int64_t n, int64_t head_size, int64_t row, float* acc) {
  for (int64_t c = 0; c < head_size; c += kLanes) {
    Vec16 a[R];
    for (int r = 0; r < R; ++r) a[r] = load16(acc + r * head_size + c);
    for (int64_t t = 0; t < n; ++t) {
      const Vec16 v = load16(values + t * head_size + c);
      for (int r = 0; r < R; ++r) a[r] += p[r * row + t] * v;
    }
    for (int r = 0; r < R; ++r) store16(acc + r * head_size + c, a[r]);
  }
}

// Softmax of each of `rows` score rows in place: [rows, row], the first seq_len of each valid.
inline void softmax_rows(float* scores, int64_t rows, int64_t row, int64_t seq_len) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * row;
    // Slots past seq_len hold whatever the block held before: out of the softmax.
    std::fill(s + seq_len, s + row, -std::numeric_limits<float>::infinity());
    Vec16 vmax = splat(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < row; i += kLanes) vmax = vmax > load16(s + i) ? vmax : load16(s + i);
    const float m = reduce_max(vmax);
    Vec16 vsum{};
    for (int64_t i = 0; i < row; i += kLanes) {
      const Vec16 e = exp_nonpositive(load16(s + i) - m);
      store16(s + i, e);
      vsum += e;
    }
    const Vec16 inv = splat(1.f / reduce_sum(vsum));
    for (int64_t i = 0; i < row; i += kLanes) store16(s + i, load16(s + i) * inv);
  }
}

// R query rows (pre-scaled, float) of one (sequence, kv head) against seq_len keys: two
// passes over the blocks (K for the scores, then V) with the softmax between them over the
// whole row, which stays in L1/L2 and vectorizes.
template <typename T, int R>
void attend_rows(const float* q, const T* key_head, const T* value_head, const int32_t* table, int64_t seq_len,
                 int64_t head_size, float* scores, float* acc) {
  const int64_t tile = kLanes * head_size;
  const int64_t num_seq_blocks = (seq_len + kLanes - 1) / kLanes;
  const int64_t row = num_seq_blocks * kLanes;  // a scores row, padded to whole blocks
  for (int64_t b = 0; b < num_seq_blocks; ++b) {
    if (b + kPrefetchDistance < num_seq_blocks) {
      prefetch_tile(key_head + static_cast<int64_t>(table[b + kPrefetchDistance]) * tile, tile);
    }
    block_scores<T, R>(q, key_head + static_cast<int64_t>(table[b]) * tile, head_size, scores + b * kLanes, row);
  }
  softmax_rows(scores, R, row, seq_len);
  std::fill(acc, acc + R * head_size, 0.f);
  for (int64_t b = 0; b < num_seq_blocks; ++b) {
    if (b + kPrefetchDistance < num_seq_blocks) {
      prefetch_tile(value_head + static_cast<int64_t>(table[b + kPrefetchDistance]) * tile, tile);
    }
    const int64_t n = std::min(kLanes, seq_len - b * kLanes);
    block_values<T, R>(scores + b * kLanes, value_head + static_cast<int64_t>(table[b]) * tile, n, head_size, row,
                       acc);
  }
}

// One (sequence, kv head): `group` query rows against `seq_len` keys in `table`'s blocks.
template <typename T>
void attend_one(const T* query,        // [group, head_size], the group's query heads
                const T* key_head,     // [num_blocks, head_size, kLanes] of this kv head
                const T* value_head,   // [num_blocks, kLanes, head_size] of this kv head
                const int32_t* table,  // this sequence's block table
                int64_t seq_len, const Shape& shape,
                T* out,                // [group, head_size]
                std::vector<float>& scratch) {
  const int64_t group = shape.group, head_size = shape.head_size;
  const int64_t row = (seq_len + kLanes - 1) / kLanes * kLanes;
  scratch.resize(static_cast<size_t>(2 * group * head_size + kMaxRows * row));
  float* q = scratch.data();                // [group, head_size], pre-scaled
  float* acc = q + group * head_size;       // [group, head_size]
  float* scores = acc + group * head_size;  // [kMaxRows, row]
  for (int64_t i = 0; i < group * head_size; ++i) q[i] = static_cast<float>(query[i]) * shape.scale;
  for (int64_t g = 0; g < group; g += kMaxRows) {
    const float* qg = q + g * head_size;
    float* ag = acc + g * head_size;
    switch (std::min<int64_t>(kMaxRows, group - g)) {
      case 1: attend_rows<T, 1>(qg, key_head, value_head, table, seq_len, head_size, scores, ag); break;
      case 2: attend_rows<T, 2>(qg, key_head, value_head, table, seq_len, head_size, scores, ag); break;
      case 3: attend_rows<T, 3>(qg, key_head, value_head, table, seq_len, head_size, scores, ag); break;
      default: attend_rows<T, 4>(qg, key_head, value_head, table, seq_len, head_size, scores, ag); break;
    }
  }
  for (int64_t i = 0; i < group * head_size; ++i) out[i] = static_cast<T>(acc[i]);
}

template <typename T>
void attend_all(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& tables, const at::Tensor& lens, const Shape& shape, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_size = q.size(2);
  const int64_t kv_heads = value_cache.size(0), max_blocks = tables.size(1);
  const int64_t head_cache = value_cache.size(1) * kLanes * head_size;
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = key_cache.data_ptr<T>();
  const T* v_ptr = value_cache.data_ptr<T>();
  const int32_t* tables_ptr = tables.data_ptr<int32_t>();
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  T* o_ptr = out.data_ptr<T>();
  // One work item per (sequence, kv head), a sequence's heads side by side.
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const int64_t offset = (s * num_heads + h * shape.group) * head_size;
      attend_one<T>(q_ptr + offset, k_ptr + h * head_cache, v_ptr + h * head_cache, tables_ptr + s * max_blocks,
                    lens_ptr[s], shape, o_ptr + offset, scratch);
    }
  });
}

// query: [num_seqs, num_heads, head_size], one decode token per sequence
// key_cache: [num_kv_heads, num_blocks, head_size, 16]; value_cache: [num_kv_heads, num_blocks, 16, head_size]
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (keys to attend, incl. the new one)
// returns [num_seqs, num_heads, head_size]
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "paged_decode_attention: query [seqs, heads, d], K [kv_heads, blocks, d, 16], V [kv_heads, blocks, 16, d]");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_decode_attention: query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and seq_lens are int32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "paged_decode_attention: contiguous caches");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t kv_heads = value_cache.size(0), num_blocks = value_cache.size(1);
  TORCH_CHECK(value_cache.size(2) == kLanes && value_cache.size(3) == head_size && head_size % kLanes == 0,
              "paged_decode_attention: block_size must be 16 and head_size a multiple of 16");
  TORCH_CHECK(key_cache.size(0) == kv_heads && key_cache.size(1) == num_blocks && key_cache.size(2) == head_size &&
                  key_cache.size(3) == kLanes,
              "paged_decode_attention: K must be V's shape with the last two dims swapped");
  TORCH_CHECK(num_heads % kv_heads == 0, "paged_decode_attention: num_heads not a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && seq_lens.numel() == num_seqs,
              "paged_decode_attention: one block table row and one seq_len per sequence");
  const auto q = query.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t max_blocks = tables.size(1);
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  const int32_t* tables_ptr = tables.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens_ptr[s] > 0 && lens_ptr[s] <= max_blocks * kLanes,
                "paged_decode_attention: seq_lens[", s, "] is empty or exceeds its block table");
    for (int64_t b = 0; b < (lens_ptr[s] + kLanes - 1) / kLanes; ++b) {
      const int32_t block = tables_ptr[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: block id ", block, " out of range");
    }
  }
  auto out = at::empty_like(q);
  const Shape shape{num_heads / kv_heads, head_size, static_cast<float>(scale)};

  switch (q.scalar_type()) {
    case at::kFloat: attend_all<float>(q, key_cache, value_cache, tables, lens, shape, out); break;
    case at::kBFloat16: attend_all<c10::BFloat16>(q, key_cache, value_cache, tables, lens, shape, out); break;
    case at::kHalf: attend_all<c10::Half>(q, key_cache, value_cache, tables, lens, shape, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: dtype ", q.scalar_type(), " is not float32, bfloat16 or float16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
