// Paged attention for decode tokens on the CPU, reading K/V blocks where they lie.
//
// Layout of the CPU backend (executor/attention/cpu_backend.py), per layer, block-major:
//   K: [num_blocks, num_kv_heads, head_size, block_size]  (each tile transposed)
//   V: [num_blocks, num_kv_heads, block_size, head_size]
// with block_size == 16 == the lanes of one Vec16. Plain torch must gather a batch's
// blocks into a contiguous tensor before SDPA, which writes and re-reads the whole
// context once more per layer (at batch 32 x 1024 tokens as costly as the attention).
// Here each sequence streams its own blocks in place, all its KV heads per block:
//   scores: a K tile column is one key dimension for all 16 tokens of the block, so a
//           block's scores are broadcast-FMAs over head_size into one vector, no
//           horizontal sums;
//   softmax over the whole row (kept in L1/L2) with a vectorized exp;
//   output: each V row scaled by its probability into float32 accumulators.
// The query heads sharing a KV head (GQA) are served by the same pass over K/V, up to
// four at a time with their accumulators in registers.
//
// With the int8 KV cache (--kv-cache-dtype int8, write_kv.cpp) each (block, kv head) tile is a
// record: the tile's int8 codes, then the block's 16 per-token float32 scales. A token's whole
// head shares a scale, so it comes out of the sums: a block's 16 scores are multiplied by the K
// scales once, and each probability by its token's V scale before the value pass.
//
// Registered as torch.ops.kvserve_cpu.paged_decode_attention and paged_decode_attention_int8
// (TORCH_LIBRARY, no pybind).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "avx2_lanes.h"
#include "claims.h"
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

// On AVX2 a bf16 tile's 16 elements widen as the even ones, then the odd ones
// (load_lanes_even_odd: a shift and a mask where the ordered widening takes five operations, for
// three rows' six FMAs): a block's scores lie in that order, and so do a V chunk's accumulators.
// The probabilities are read, and the output written, by position, so every sum is the one
// the ordered lanes make, in the same order.
#if defined(KVSERVE_AVX2_LANES)
template <typename T>
constexpr bool kEvenOdd = std::is_same_v<T, c10::BFloat16>;

template <typename T>
inline Lanes16 load_tile_lanes(const T* p) {
  if constexpr (kEvenOdd<T>) {
    return load_lanes_even_odd(p);
  } else {
    return load_lanes(p);
  }
}
#else
template <typename T>
constexpr bool kEvenOdd = false;
#endif

// The lane that holds position i (0..15) of a block's scores or of a V chunk.
template <typename T>
constexpr int64_t lane_of(int64_t i) {
  return kEvenOdd<T> ? even_odd_lane(i) : i;
}

// scores[r][0..16) = q[r] . K[:, t] for one block; K tile [head_size, kLanes]; the sum's order
// depends on nothing but d.
#if defined(KVSERVE_AVX2_LANES)
// One accumulator (two registers) a row, summing d in turn. With AVX-512's four chains a row,
// or even two, three rows' accumulators, a K column, a broadcast and the bf16 mask outgrow AVX2's
// 16 registers: GCC kept them on the stack, a load and a store around every FMA, and the kernel
// took 1.4x as long (bf16 cache, 32 sequences x 351 tokens, one thread).
template <typename T, int R>
inline void block_scores(const float* q, const T* keys, int64_t head_size, float* scores, int64_t row,
                         const T* ahead) {
  constexpr int64_t kColumnsPerLine = std::max<int64_t>(1, 64 / (kLanes * sizeof(T)));
  Lanes16 s[R];
  for (int r = 0; r < R; ++r) s[r] = zero_lanes();
  for (int64_t d = 0; d < head_size; d += kColumnsPerLine) {
    prefetch_lines<64>(ahead + d * kLanes);
    for (int64_t j = 0; j < kColumnsPerLine; ++j) {
      const Lanes16 k = load_tile_lanes(keys + (d + j) * kLanes);
      for (int r = 0; r < R; ++r) s[r] = fma_lanes(q[r * head_size + d + j], k, s[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_lanes(scores + r * row, s[r]);
}
#else
// Each row sums into kChains accumulators (key dimensions d mod kChains) so that the FMAs of a
// row do not wait on one another (a 4-cycle latency each); kChains x kMaxRows accumulators plus a
// K column fit the 32 AVX-512 registers.
constexpr int64_t kChains = 4;

template <typename T, int R>
inline void block_scores(const float* q, const T* keys, int64_t head_size, float* scores, int64_t row,
                         const T* ahead) {
  Vec16 s[R][kChains] = {};
  for (int64_t d = 0; d < head_size; d += kChains) {
    prefetch_lines<kChains * kLanes * sizeof(T)>(ahead + d * kLanes);
    for (int64_t j = 0; j < kChains; ++j) {
      const Vec16 k = load16(keys + (d + j) * kLanes);
      for (int r = 0; r < R; ++r) s[r][j] += q[r * head_size + d + j] * k;
    }
  }
  static_assert(kChains == 4, "the pairwise sum below adds four chains");
  for (int r = 0; r < R; ++r) store16(scores + r * row, (s[r][0] + s[r][1]) + (s[r][2] + s[r][3]));
}
#endif

// acc[r][c0, c0 + 16 C) += sum over the block's first n tokens of p[r][t] * V[t][c0, c0 + 16 C);
// V tile [kLanes, head_size]. R x C independent accumulators stay in registers across the tokens.
#if defined(KVSERVE_AVX2_LANES)
template <typename T, int R, int C>
inline void block_values_columns(const float* p, const T* values, int64_t n, int64_t head_size, int64_t row,
                                 int64_t c0, float* acc, const T* ahead) {
  Lanes16 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = load_lanes(acc + r * head_size + c0 + c * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    prefetch_lines<C * kLanes * sizeof(T)>(ahead + t * head_size + c0);
    Lanes16 v[C];
    for (int c = 0; c < C; ++c) v[c] = load_tile_lanes(values + t * head_size + c0 + c * kLanes);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) a[r][c] = fma_lanes(p[r * row + lane_of<T>(t)], v[c], a[r][c]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store_lanes(acc + r * head_size + c0 + c * kLanes, a[r][c]);
}

constexpr int64_t kValueColumns = 1;  // R <= 4 rows: 8 accumulators and a V chunk in 16 registers
#else
template <typename T, int R, int C>
inline void block_values_columns(const float* p, const T* values, int64_t n, int64_t head_size, int64_t row,
                                 int64_t c0, float* acc, const T* ahead) {
  Vec16 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = load16(acc + r * head_size + c0 + c * kLanes);
  for (int64_t t = 0; t < n; ++t) {
    prefetch_lines<C * kLanes * sizeof(T)>(ahead + t * head_size + c0);
    Vec16 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(values + t * head_size + c0 + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const float pt = p[r * row + t];
      for (int c = 0; c < C; ++c) a[r][c] += pt * v[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(acc + r * head_size + c0 + c * kLanes, a[r][c]);
}

// Columns go four vectors (64) at a time: with R <= 4 rows that is at most 16 accumulators.
constexpr int64_t kValueColumns = 4;
#endif

template <typename T, int R>
inline void block_values(const float* p, const T* values, int64_t n, int64_t head_size, int64_t row, float* acc,
                         const T* ahead) {
  int64_t c0 = 0;
  for (; c0 + kValueColumns * kLanes <= head_size; c0 += kValueColumns * kLanes) {
    block_values_columns<T, R, kValueColumns>(p, values, n, head_size, row, c0, acc, ahead);
  }
  switch ((head_size - c0) / kLanes) {
    case 1: block_values_columns<T, R, 1>(p, values, n, head_size, row, c0, acc, ahead); break;
    case 2: block_values_columns<T, R, 2>(p, values, n, head_size, row, c0, acc, ahead); break;
    case 3: block_values_columns<T, R, 3>(p, values, n, head_size, row, c0, acc, ahead); break;
    default: break;
  }
}

// Softmax of each of `rows` score rows in place: [rows, row], the first seq_len positions of each
// valid; C, the cache's element type, says where a block's positions lie (lane_of).
template <typename C>
inline void softmax_rows(float* scores, int64_t rows, int64_t row, int64_t seq_len) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * row;
    // Slots past seq_len hold whatever the block held before: out of the softmax.
    for (int64_t t = seq_len; t < row; ++t) {
      s[t / kLanes * kLanes + lane_of<C>(t % kLanes)] = -std::numeric_limits<float>::infinity();
    }
    const Vec16 inv = splat(softmax_numerators<kEvenOdd<C>>(s, row));
    for (int64_t i = 0; i < row; i += kLanes) store16(s + i, load16(s + i) * inv);
  }
}

// Calls f(std::integral_constant<int, R>) for R = rows (1..kMaxRows): the row count as a
// template argument, so that a chunk's accumulators are registers.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, kMaxRows>{}); break;
  }
}

// Where one layer's tiles lie: the tile of (block, kv head) starts `block * block_stride +
// head * head_stride` elements in; a tile is kLanes * head_size contiguous elements.
struct Tiles {
  int64_t block_stride;
  int64_t head_stride;
};

// C, the cache's element type: int8_t for the int8 cache, whose tiles are followed by their scales.
template <typename C>
constexpr bool kQuantized = std::is_same_v<C, int8_t>;

// Elements of C after a tile of `tile` elements up to the end of its record.
template <typename C>
constexpr int64_t kScaleElements = kQuantized<C> ? kLanes * static_cast<int64_t>(sizeof(float)) : 0;

template <typename C>
inline Vec16 tile_scales(const C* tile, int64_t tile_elements) {
  float scales[kLanes];
  std::memcpy(scales, tile + tile_elements, sizeof(scales));
  return load16(scales);
}

// rows [r0, r0 + n) of `scores`, lanes [b * 16, b * 16 + 16), times `factor` lane by lane.
inline void scale_block(float* scores, int64_t row, int64_t r0, int64_t n, int64_t b, Vec16 factor) {
  for (int64_t r = r0; r < r0 + n; ++r) {
    float* s = scores + r * row + b * kLanes;
    store16(s, load16(s) * factor);
  }
}

// One sequence's kv heads [h0, h1) (each with `group` query rows) against its seq_len keys:
// two passes over its blocks (K for the scores, then V) with the softmax between them over
// whole rows, which stay in L1/L2 and vectorize. The heads of a block are visited together
// because the cache keeps them side by side: one block's K (or V) tiles are one contiguous
// stretch of memory, which scattered blocks read at several times the speed of separate
// 2 KiB tiles. Every query row's arithmetic, and its order, is the same however heads are
// grouped into runs (and so however the batch is split between threads).
template <typename T, typename C>
void attend_run(const T* query,        // [kv heads of the run, group, head_size]
                const C* key_cache, const Tiles& keys, const C* value_cache, const Tiles& values,
                const int32_t* table,  // this sequence's block table
                int64_t seq_len, int64_t h0, int64_t h1, const Shape& shape,
                T* out,                // [kv heads of the run, group, head_size]
                std::vector<float>& scratch) {
  const int64_t group = shape.group, head_size = shape.head_size, tile = kLanes * head_size;
  const int64_t record = tile + kScaleElements<C>;
  const int64_t rows = (h1 - h0) * group;
  const int64_t num_seq_blocks = (seq_len + kLanes - 1) / kLanes;
  const int64_t row = num_seq_blocks * kLanes;  // a scores row, padded to whole blocks
  scratch.resize(static_cast<size_t>(2 * rows * head_size + rows * row));
  float* q = scratch.data();               // [rows, head_size], pre-scaled
  float* acc = q + rows * head_size;       // [rows, head_size]
  float* scores = acc + rows * head_size;  // [rows, row]
  for (int64_t i = 0; i < rows * head_size; ++i) q[i] = static_cast<float>(query[i]) * shape.scale;
  // The tile to prefetch while reading head h of block b in the K pass (then the V pass): head h
  // of the block kPrefetchDistance ahead; past the last K block, the first V blocks; past the last
  // V block, the tile itself (already in cache: a prefetch that costs nothing).
  auto key_tile_of = [&](int64_t b, int64_t h) {
    return key_cache + static_cast<int64_t>(table[b]) * keys.block_stride + h * keys.head_stride;
  };
  auto value_tile_of = [&](int64_t b, int64_t h) {
    return value_cache + static_cast<int64_t>(table[b]) * values.block_stride + h * values.head_stride;
  };
  auto ahead_of_key = [&](int64_t b, int64_t h) {
    const int64_t next = b + kPrefetchDistance;
    return next < num_seq_blocks ? key_tile_of(next, h) : value_tile_of(std::min(next - num_seq_blocks, b), h);
  };
  auto ahead_of_value = [&](int64_t b, int64_t h) {
    const int64_t next = b + kPrefetchDistance;
    return next < num_seq_blocks ? value_tile_of(next, h) : value_tile_of(b, h);
  };
  // The first blocks have nothing before them to prefetch them in step.
  for (int64_t b = 0; b < std::min(kPrefetchDistance, num_seq_blocks); ++b) {
    for (int64_t h = h0; h < h1; ++h) prefetch_tile(key_tile_of(b, h), record);
  }

  for (int64_t b = 0; b < num_seq_blocks; ++b) {
    for (int64_t h = h0; h < h1; ++h) {
      const C* key_tile = key_tile_of(b, h);
      const C* ahead = ahead_of_key(b, h);
      if constexpr (kQuantized<C>) prefetch_lines<64>(ahead + tile);
      for (int64_t g = 0; g < group; g += kMaxRows) {
        const int64_t r0 = (h - h0) * group + g;
        with_rows(std::min<int64_t>(kMaxRows, group - g), [&](auto r) {
          block_scores<C, decltype(r)::value>(q + r0 * head_size, key_tile, head_size, scores + r0 * row + b * kLanes,
                                              row, ahead);
        });
      }
      if constexpr (kQuantized<C>) scale_block(scores, row, (h - h0) * group, group, b, tile_scales(key_tile, tile));
    }
  }
  softmax_rows<C>(scores, rows, row, seq_len);
  std::fill(acc, acc + rows * head_size, 0.f);
  for (int64_t b = 0; b < num_seq_blocks; ++b) {
    const int64_t n = std::min(kLanes, seq_len - b * kLanes);
    for (int64_t h = h0; h < h1; ++h) {
      const C* value_tile = value_tile_of(b, h);
      const C* ahead = ahead_of_value(b, h);
      if constexpr (kQuantized<C>) prefetch_lines<64>(ahead + tile);
      // Each probability takes its token's V scale (the scores are not read again).
      if constexpr (kQuantized<C>) scale_block(scores, row, (h - h0) * group, group, b, tile_scales(value_tile, tile));
      for (int64_t g = 0; g < group; g += kMaxRows) {
        const int64_t r0 = (h - h0) * group + g;
        with_rows(std::min<int64_t>(kMaxRows, group - g), [&](auto r) {
          block_values<C, decltype(r)::value>(scores + r0 * row + b * kLanes, value_tile, n, head_size, row,
                                              acc + r0 * head_size, ahead);
        });
      }
    }
  }
  for (int64_t i = 0; i < rows * head_size; ++i) out[i] = static_cast<T>(acc[i / kLanes * kLanes + lane_of<C>(i % kLanes)]);
}

template <typename T, typename C = T>
void attend_all(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& tables, const at::Tensor& lens, const Shape& shape, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_size = q.size(2);
  const int64_t kv_heads = value_cache.size(1), max_blocks = tables.size(1);
  const Tiles keys{key_cache.stride(0), key_cache.stride(1)};
  const Tiles values{value_cache.stride(0), value_cache.stride(1)};
  const T* q_ptr = q.data_ptr<T>();
  const C* k_ptr = key_cache.data_ptr<C>();
  const C* v_ptr = value_cache.data_ptr<C>();
  const int32_t* tables_ptr = tables.data_ptr<int32_t>();
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  T* o_ptr = out.data_ptr<T>();
  if (num_seqs >= 2 * at::get_num_threads()) {
    // Whole sequences, longest first, each claimed by whichever thread is free: a fixed half of a
    // batch's sequences is not half of its K/V (32 decode rows of 100-1,000 tokens over 30 layers'
    // caches, 414 MB a step: 0.955x the time of the fixed split, faster in 9 of 10 blocks of steps
    // taking turns, on the AMX Xeon), nor is a thread's half done as fast as the other's where the
    // gateway or another guest takes its core. A sequence's bits do not depend on its thread.
    std::vector<int64_t> order(num_seqs);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lens_ptr[a] > lens_ptr[b]; });
    parallel_claims(num_seqs, 1, [&](Claims& claims) {
      std::vector<float> scratch;
      int64_t begin, end;
      while (claims(begin, end)) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t s = order[i], offset = s * num_heads * head_size;
          attend_run<T, C>(q_ptr + offset, k_ptr, keys, v_ptr, values, tables_ptr + s * max_blocks, lens_ptr[s], 0,
                           kv_heads, shape, o_ptr + offset, scratch);
        }
      }
    });
    return;
  }
  // Fewer sequences: work items are (sequence, kv head), so that one sequence's heads can take
  // every thread; a thread's contiguous range of them is cut into runs of one sequence's heads.
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end;) {
      const int64_t s = item / kv_heads, h0 = item % kv_heads;
      const int64_t h1 = std::min(kv_heads, h0 + (end - item));
      const int64_t offset = (s * num_heads + h0 * shape.group) * head_size;
      attend_run<T, C>(q_ptr + offset, k_ptr, keys, v_ptr, values, tables_ptr + s * max_blocks, lens_ptr[s], h0, h1,
                    shape, o_ptr + offset, scratch);
      item += h1 - h0;
    }
  });
}

// Every block a sequence attends to exists; block_tables [num_seqs, max_blocks], seq_lens [num_seqs].
void check_block_tables(const at::Tensor& tables, const at::Tensor& lens, int64_t num_seqs, int64_t num_blocks) {
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_tables and seq_lens are int32");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && lens.numel() == num_seqs,
              "paged_decode_attention: one block table row and one seq_len per sequence");
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
}

// Both ops' common part once the caches' shapes are checked: the block tables, then attend_all with
// the query's type T and the cache's element type (a float type, or int8_t for the int8 cache).
template <bool Int8Cache>
at::Tensor attend_checked(const char* op, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          double scale) {
  const int64_t num_heads = query.size(1), kv_heads = key_cache.size(1);
  TORCH_CHECK(num_heads % kv_heads == 0, op, ": num_heads not a multiple of num_kv_heads");
  const auto q = query.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  check_block_tables(tables, lens, q.size(0), key_cache.size(0));
  auto out = at::empty_like(q);
  const Shape shape{num_heads / kv_heads, q.size(2), static_cast<float>(scale)};
  dispatch_float_types(q.scalar_type(), op, [&](auto query_type) {
    using T = decltype(query_type);
    if constexpr (Int8Cache) {
      attend_all<T, int8_t>(q, key_cache, value_cache, tables, lens, shape, out);
    } else {
      dispatch_float_types(key_cache.scalar_type(), op, [&](auto cache_type) {
        attend_all<T, decltype(cache_type)>(q, key_cache, value_cache, tables, lens, shape, out);
      });
    }
  });
  return out;
}

// query: [num_seqs, num_heads, head_size], one decode token per sequence
// key_cache: [num_blocks, num_kv_heads, head_size, 16]; value_cache: [num_blocks, num_kv_heads, 16, head_size];
//   each (block, head) tile contiguous, blocks and heads at any stride
// block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (keys to attend, incl. the new one)
// returns [num_seqs, num_heads, head_size] in query's dtype. Query and caches are float32, bfloat16 or
// float16, each its own (a float32 model's bf16 cache is read as it lies, widened in registers).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "paged_decode_attention: query [seqs, heads, d], K [blocks, kv_heads, d, 16], V [blocks, kv_heads, 16, d]");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "paged_decode_attention: K and V share a dtype");
  const int64_t head_size = query.size(2);
  const int64_t num_blocks = value_cache.size(0), kv_heads = value_cache.size(1);
  TORCH_CHECK(value_cache.size(2) == kLanes && value_cache.size(3) == head_size && head_size % kLanes == 0,
              "paged_decode_attention: block_size must be 16 and head_size a multiple of 16");
  TORCH_CHECK(key_cache.size(0) == num_blocks && key_cache.size(1) == kv_heads && key_cache.size(2) == head_size &&
                  key_cache.size(3) == kLanes,
              "paged_decode_attention: K must be V's shape with the last two dims swapped");
  TORCH_CHECK(key_cache.stride(3) == 1 && key_cache.stride(2) == kLanes && value_cache.stride(3) == 1 &&
                  value_cache.stride(2) == head_size,
              "paged_decode_attention: each cache tile must be contiguous");
  return attend_checked<false>("paged_decode_attention", query, key_cache, value_cache, block_tables, seq_lens,
                               scale);
}

// The same over the int8 cache: key_cache, value_cache [num_blocks, num_kv_heads, record] int8, a
// record being the K tile [head_size, 16] (V: [16, head_size]) of codes and then 16 float32 scales;
// query float32, bfloat16 or float16; returns query's shape and dtype.
at::Tensor paged_decode_attention_int8(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                                       const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              "paged_decode_attention_int8: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 3 && value_cache.dim() == 3,
              "paged_decode_attention_int8: query [seqs, heads, d], K and V [blocks, kv_heads, record]");
  TORCH_CHECK(key_cache.scalar_type() == at::kChar && value_cache.scalar_type() == at::kChar,
              "paged_decode_attention_int8: the caches are int8 records");
  const int64_t head_size = query.size(2);
  const int64_t record = kLanes * head_size + kScaleElements<int8_t>;
  TORCH_CHECK(head_size % kLanes == 0, "paged_decode_attention_int8: head_size must be a multiple of 16");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && key_cache.size(2) == record,
              "paged_decode_attention_int8: K and V records of 16 x head_size codes and 16 float32 scales");
  TORCH_CHECK(key_cache.stride(2) == 1 && value_cache.stride(2) == 1 && key_cache.stride(1) % 4 == 0 &&
                  key_cache.stride(0) % 4 == 0 && value_cache.stride(1) % 4 == 0 && value_cache.stride(0) % 4 == 0,
              "paged_decode_attention_int8: each record must be contiguous");
  return attend_checked<true>("paged_decode_attention_int8", query, key_cache, value_cache, block_tables, seq_lens,
                              scale);
}

}  // namespace

TORCH_LIBRARY(kvserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.def("paged_decode_attention_int8(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8);
}
