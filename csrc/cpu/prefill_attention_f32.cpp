// Causal attention of a float32 model's prefill chunks on a CPU with AVX2 (and no AVX-512), fused:
// what prefill_attention.cpp does with bf16 tiles where the CPU has AVX-512 BF16, here with float32
// FMAs over a float32 or bf16 cache, or the int8 cache's records (codes times their token's scale).
//
// Without it the cpu backend gathers each group's blocks, widens them to float32 and runs two GEMMs
// around causal_softmax_: the gathered K/V and the [rows, ctx_len] scores go through memory, and
// beyond glibc's 32 MiB mmap threshold each step's scores are fresh pages the kernel zeroes again
// (a 4-sequence, 1,550-token prefill step of the float32 model on the AVX2 EPYC: 26 % of the step
// in the GEMMs, the softmax and the copies).
//
// Here one unit of work is (sequence, KV head, up to kUnitTokens query tokens): the keys its last
// token sees are widened once into per-thread float32 buffers (K as the cache's transposed tiles
// [blocks][d][16], V in slices of 16 dimensions [d / 16][keys][16]), then every query head of the KV
// head takes its tokens kRows at a time:
//
//   scores  S [kRows, keys] = (q * scale) . K^T   per 16-key block, broadcast-FMAs over d
//   softmax per row over its own keys (the rest masked to exactly 0), in a buffer of kRows rows
//   values  O [kRows, d] = P . V / sum             16 output dims at a time, over the keys
//
// so nothing larger than a unit's widened K/V (~0.5 MiB at 1,024 keys) and kRows score rows is
// written. A row's result depends on nothing but its query, its keys and the fixed orders above:
// not on the batch, the chunking of the prompt or the thread count.
//
// Registered as torch.ops.kvserve_cpu.{has_prefill_attention_f32, paged_prefill_attention_f32}.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "avx2_lanes.h"
#include "prefill_tables.h"
#include "skinny_tiles.h"
#include "vec16.h"

namespace {

using namespace kvserve_cpu;

constexpr int64_t kBlock = 16;        // tokens per cache block
constexpr int64_t kMaxHeadSize = 256;
constexpr int64_t kUnitTokens = 36;   // query tokens of one unit: its K/V widening is 1/(3 x 36) of its products
constexpr int kRows = 6;              // query rows sharing each K and V load: 12 accumulators of the 16 registers

bool has_prefill_attention_f32() {
#if defined(KVSERVE_AVX2_LANES)
  return true;
#else
  return false;
#endif
}

#if defined(KVSERVE_AVX2_LANES)
// One sequence and KV head of the cache: its block table and the tiles' strides. T = int8_t: the
// int8 cache's records, each tile's codes followed by its 16 tokens' float32 scales.
template <typename T>
struct SequenceCache {
  const T* key_cache;    // [num_blocks, kv_heads, d, 16]
  const T* value_cache;  // [num_blocks, kv_heads, 16, d]
  int64_t block_stride, head_stride;  // the same for K and V (checked)
  const int32_t* table;
  int64_t head;
};

inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, widen_bf16(raw));
  }
}

// One block's K tile [d][16] as float32 in the same layout, and its V tile [16][d] as float32 in
// slices of 16 dimensions: dimensions [16c, 16c + 16) of its token t at v[c * slice_stride + 16 t].
template <typename T>
void widen_block(const T* k_tile, const T* v_tile, int64_t d, float* k, float* v, int64_t slice_stride) {
  widen(k_tile, k, kBlock * d);
  for (int64_t t = 0; t < kBlock; ++t) {
    for (int64_t c = 0; c < d / 16; ++c) widen(v_tile + t * d + c * 16, v + c * slice_stride + t * 16, 16);
  }
}

// 8 int8 codes as float32.
inline __m256 widen_codes8(const int8_t* codes) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
}

// An int8 block's records (the tile's codes, then its 16 tokens' scales) as code * scale in float32,
// one rounding: the values the gathered path's codes.float() * scales gives. Layouts as above.
void widen_block(const int8_t* k_codes, const int8_t* v_codes, int64_t d, float* k, float* v, int64_t slice_stride) {
  const int64_t tile = kBlock * d;
  float k_scales[kBlock], v_scales[kBlock];
  std::memcpy(k_scales, k_codes + tile, sizeof(k_scales));
  std::memcpy(v_scales, v_codes + tile, sizeof(v_scales));
  const __m256 k_scale_lo = _mm256_loadu_ps(k_scales), k_scale_hi = _mm256_loadu_ps(k_scales + 8);
  for (int64_t i = 0; i < d; ++i) {  // row i: dimension i of the block's 16 keys
    _mm256_storeu_ps(k + i * kBlock, _mm256_mul_ps(widen_codes8(k_codes + i * kBlock), k_scale_lo));
    _mm256_storeu_ps(k + i * kBlock + 8, _mm256_mul_ps(widen_codes8(k_codes + i * kBlock + 8), k_scale_hi));
  }
  for (int64_t t = 0; t < kBlock; ++t) {
    const __m256 scale = _mm256_set1_ps(v_scales[t]);
    for (int64_t x = 0; x < d; x += 8) {
      _mm256_storeu_ps(v + x / 16 * slice_stride + t * 16 + x % 16,
                       _mm256_mul_ps(widen_codes8(v_codes + t * d + x), scale));
    }
  }
}

// K and V of keys [0, blocks * 16) of one sequence and head, as float32: k [blocks][d][16], v [d / 16][blocks * 16][16].
// V in slices of 16 dimensions: the values pass over a slice reads whole cache lines, one after the other.
template <typename T>
void widen_keys(const SequenceCache<T>& c, int64_t blocks, int64_t d, float* k, float* v) {
  const int64_t tile = kBlock * d, slice_stride = blocks * kBlock * 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t offset = c.table[b] * c.block_stride + c.head * c.head_stride;
    widen_block(c.key_cache + offset, c.value_cache + offset, d, k + b * tile, v + b * kBlock * 16, slice_stride);
  }
}

// s[r][t] = q[r] . K[:, t] for t < blocks * 16; q already scaled. Two halves of 8 keys per row.
template <int R>
void tile_scores(const float* q, const float* k, int64_t blocks, int64_t d, float* s, int64_t s_stride) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* tile = k + b * kBlock * d;
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; ++i) {
      __m256 k_lo = _mm256_loadu_ps(tile + i * kBlock), k_hi = _mm256_loadu_ps(tile + i * kBlock + 8);
      in_register(k_lo);  // one load for all R rows (4 rows, one thread: 30-31 GMAC/s, 20-22 with a load each)
      in_register(k_hi);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_broadcast_ss(q + r * d + i);
        lo[r] = _mm256_fmadd_ps(qv, k_lo, lo[r]);
        hi[r] = _mm256_fmadd_ps(qv, k_hi, hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s + r * s_stride + b * kBlock, lo[r]);
      _mm256_storeu_ps(s + r * s_stride + b * kBlock + 8, hi[r]);
    }
  }
}

// Row s[0, padded) in place: exp(s - max) over its first `keys` entries, exactly 0 past them (the
// masked keys, and the stale slots of a last block). Returns 1 / the sum. The exponentials are
// summed as they are stored, 8 lanes in order of t; the zeros past `keys` add nothing.
float softmax_row(float* s, int64_t keys, int64_t padded) {
  const int64_t whole = keys / 8 * 8;  // the vectors inside the row's keys; the next one straddles them
  const __m256 in_keys = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(keys - whole)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m = minus_inf;
  for (int64_t t = 0; t < whole; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  if (whole < keys) m = _mm256_max_ps(m, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(s + whole), in_keys));
  const __m256 row_max = _mm256_set1_ps(max_of_lanes8(m));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < whole; t += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + t), row_max));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  int64_t zero_from = whole;
  if (whole < keys) {
    // The stale slots' scores may be anything, NaN included: the mask, not the exponential, zeroes them.
    const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + whole), row_max)), in_keys);
    _mm256_storeu_ps(s + whole, e);
    sum = _mm256_add_ps(sum, e);
    zero_from += 8;
  }
  std::fill(s + zero_from, s + padded, 0.f);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  return 1.f / _mm_cvtss_f32(s4);
}

// out[r] = sum over t < keys of p[r][t] * V[t] * inv[r]; p is 0 past each row's own keys. V in
// slices of 16 dimensions, slice_stride apart.
template <int R>
void tile_values(const float* p, int64_t p_stride, const float* v, int64_t slice_stride, int64_t keys, int64_t d,
                 const float* inv, float* out, int64_t out_stride) {
  for (int64_t c = 0; c < d; c += 16) {
    const float* slice = v + c / 16 * slice_stride;
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t t = 0; t < keys; ++t) {
      __m256 v_lo = _mm256_loadu_ps(slice + t * 16), v_hi = _mm256_loadu_ps(slice + t * 16 + 8);
      in_register(v_lo);
      in_register(v_hi);
      for (int r = 0; r < R; ++r) {
        const __m256 pv = _mm256_broadcast_ss(p + r * p_stride + t);
        lo[r] = _mm256_fmadd_ps(pv, v_lo, lo[r]);
        hi[r] = _mm256_fmadd_ps(pv, v_hi, hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(inv[r]);
      _mm256_storeu_ps(out + r * out_stride + c, _mm256_mul_ps(lo[r], scale));
      _mm256_storeu_ps(out + r * out_stride + c + 8, _mm256_mul_ps(hi[r], scale));
    }
  }
}

// Query tokens [i, i + R) of one query head: rows q_rows (d apart) into out_rows; token i + j sees
// keys [0, min(first + i + j + 1, seq_len)). V's slices are v_slice_stride apart.
template <int R>
void attend_tokens(const float* q_rows, float* out_rows, int64_t i, int64_t first, int64_t seq_len, int64_t d,
                   float scale, const float* k, const float* v, int64_t v_slice_stride, std::vector<float>& scratch) {
  const int64_t last_keys = std::min(first + i + R, seq_len);
  const int64_t blocks = (last_keys + kBlock - 1) / kBlock, padded = blocks * kBlock;
  scratch.resize(R * d + R * padded);
  float* q = scratch.data();
  float* s = q + R * d;
  for (int64_t x = 0; x < R * d; ++x) q[x] = q_rows[x] * scale;
  tile_scores<R>(q, k, blocks, d, s, padded);
  float inv[R];
  for (int r = 0; r < R; ++r) inv[r] = softmax_row(s + r * padded, std::min(first + i + r + 1, seq_len), padded);
  tile_values<R>(s, padded, v, v_slice_stride, last_keys, d, inv, out_rows, d);
}

constexpr auto kAttendTokens = per_row_count<kRows>([](auto rows) { return &attend_tokens<rows>; });

struct Buffers {
  std::vector<float> k, v, scratch;
};

template <typename T>
void attend_all(const at::Tensor& q, const T* key_cache, const T* value_cache, int64_t block_stride,
                int64_t head_stride, const int32_t* tables, int64_t max_blocks, const int32_t* first,
                const int32_t* lens, int64_t query_len, float scale, at::Tensor& out) {
  const int64_t num_seqs = q.size(0), heads = q.size(1), rows = q.size(2), d = q.size(3);
  const int64_t group = rows / query_len, units_per_head = (query_len + kUnitTokens - 1) / kUnitTokens;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // A unit's cost grows with its tokens' keys, so a thread's contiguous share of units in order
  // would take a head's costly last units while another takes the cheap first ones (one 2,048-token
  // prompt's 3 KV heads on 2 threads: 1.75 against 1.25 heads' work). Each thread instead takes the
  // next unit as it finishes one, the last query tokens of every sequence and head first.
  const int64_t units = num_seqs * heads * units_per_head;
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local Buffers buffers;
    for (int64_t n = next_unit.fetch_add(1); n < units; n = next_unit.fetch_add(1)) {
      const int64_t s = n % (num_seqs * heads) / heads, h = n % heads;
      const int64_t i0 = (units_per_head - 1 - n / (num_seqs * heads)) * kUnitTokens;
      // Rows past the sequence's last token pad a shorter chunk to the group's query_len: zero.
      const int64_t i1 = std::min({i0 + kUnitTokens, query_len, static_cast<int64_t>(lens[s] - first[s])});
      const int64_t base = (s * heads + h) * rows * d;
      const int64_t zero_from = std::max(i0, i1), zero_to = std::min(i0 + kUnitTokens, query_len);
      for (int64_t g = 0; g < group && zero_to > zero_from; ++g) {
        float* head_rows = op + base + g * query_len * d;
        std::fill(head_rows + zero_from * d, head_rows + zero_to * d, 0.f);
      }
      if (i1 <= i0) continue;
      const int64_t keys = std::min<int64_t>(first[s] + i1, lens[s]), blocks = (keys + kBlock - 1) / kBlock;
      buffers.k.resize(blocks * kBlock * d);
      buffers.v.resize(blocks * kBlock * d);
      const SequenceCache<T> cache{key_cache, value_cache, block_stride, head_stride, tables + s * max_blocks, h};
      widen_keys(cache, blocks, d, buffers.k.data(), buffers.v.data());
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = i0; i < i1; i += kRows) {
          const int64_t n = std::min<int64_t>(kRows, i1 - i), row = base + (g * query_len + i) * d;
          kAttendTokens[n - 1](qp + row, op + row, i, first[s], lens[s], d, scale, buffers.k.data(),
                               buffers.v.data(), blocks * kBlock * 16, buffers.scratch);
        }
      }
    }
  });
}
#endif

// q: [num_seqs, kv_heads, rows, d] float32, rows = group * query_len (the query heads of a KV head,
//   query_len rows each: row r is query token r % query_len);
// key_cache, value_cache: the cpu backend's, float32 or bf16 (K [num_blocks, kv_heads, d, 16], V
//   [num_blocks, kv_heads, 16, d]) or int8 records ([num_blocks, kv_heads, 16 d codes + 16 float32
//   scales]); block_tables [num_seqs, max_blocks] int32; first_query_pos, seq_lens [num_seqs] int32.
// Row r of sequence s attends to keys [0, first_query_pos[s] + r % query_len + 1); rows whose token
// lies past seq_lens[s] (a shorter chunk's padding) are zero. Returns [num_seqs, kv_heads, rows, d].
at::Tensor paged_prefill_attention_f32(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                       const at::Tensor& block_tables, const at::Tensor& first_query_pos,
                                       const at::Tensor& seq_lens, int64_t query_len, double scale) {
  const char* op = "paged_prefill_attention_f32";
  TORCH_CHECK(has_prefill_attention_f32(), op, ": built for AVX2 without AVX-512, which this CPU or build is not");
  check_prefill_query(op, q, key_cache, value_cache, at::kFloat, "float32", 16, kMaxHeadSize, query_len);
  const int64_t num_seqs = q.size(0);
  const auto cache_type = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kChar),
              op, ": the caches must be float32 or bfloat16 tiles or int8 records");
  check_prefill_caches(op, q.size(1), q.size(3), key_cache, value_cache, kBlock);
  // attend_all addresses K and V tiles with one pair of strides.
  TORCH_CHECK(key_cache.stride(0) == value_cache.stride(0) && key_cache.stride(1) == value_cache.stride(1), op,
              ": K and V must share their block and head strides");
  const PrefillTables t = checked_prefill_tables(op, block_tables, first_query_pos, seq_lens, num_seqs,
                                                  key_cache.size(0), kBlock);
  at::Tensor out = at::empty(q.sizes(), q.options());
#if defined(KVSERVE_AVX2_LANES)
  const auto qc = q.contiguous();
  auto attend = [&](auto element) {
    using T = decltype(element);
    attend_all(qc, static_cast<const T*>(key_cache.data_ptr()), static_cast<const T*>(value_cache.data_ptr()),
               key_cache.stride(0), key_cache.stride(1), t.table_ptr(), t.max_blocks, t.first_ptr(), t.lens_ptr(),
               query_len, static_cast<float>(scale), out);
  };
  if (cache_type == at::kFloat) {
    attend(float{});
  } else if (cache_type == at::kBFloat16) {
    attend(c10::BFloat16{});
  } else {
    attend(int8_t{});
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("has_prefill_attention_f32", &has_prefill_attention_f32);
  m.def("paged_prefill_attention_f32(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor first_query_pos, Tensor seq_lens, int query_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("paged_prefill_attention_f32", &paged_prefill_attention_f32); }
