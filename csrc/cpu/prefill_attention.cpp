// Causal attention of a prefill chunk on AMX bf16 tiles, fused: scores, softmax and values in one
// pass per block of 16 query rows, nothing of size [rows, ctx_len] written to memory.
//
// The cpu backend's prefill path before this kernel (and still where there is no AMX) is two oneDNN
// GEMMs around causal_softmax_: the [rows, ctx_len] scores go through memory three times (written,
// softmaxed in place, read), 16 MiB a layer for an 896-token prompt against a 1024-token context,
// and that traffic, not the arithmetic, was 40% of the whole prefill (bmm 19%, softmax 23%).
// Here, for 16 query rows at a time (one A tile), the keys go by in chunks of 64:
//
//   scores  S [16, 64] = Q [16, D] . K^T      TDPBF16PS, 4 C tiles, D / 32 steps each
//   online softmax per row (float32): running max m and sum l, P = exp(S - m) rounded to bf16,
//           the accumulated output rescaled by exp(m_old - m_new)
//   values  O [16, D] += P [16, 64] . V [64, D]   TDPBF16PS, D / 16 C tiles, 2 steps each
//
// and only the chunks a block's rows may see are visited (row r sees keys
// [0, min(first_query_pos + r % query_len + 1, seq_len))). Per (sequence, KV head) K and V are first
// laid out once as the B tiles want them (pairs of bf16 side by side), keys past seq_len as zeros:
//
//   K: [key blocks of 16][D / 32][16 pairs of dims][16 keys][2]
//   V: [key blocks of 32][D / 16][16 pairs of keys][16 dims][2]
//
// Scores and sums are float32, probabilities bf16 (as the GEMM path stores them), the output is
// normalized once at the end.
//
// Registered as torch.ops.kvserve_cpu.{has_prefill_attention, prefill_attention}.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "vec16.h"

namespace {

using namespace kvserve_cpu;

constexpr int64_t kMaxHeadSize = 256;

#if defined(KVSERVE_AMX_INT8) && defined(__AMX_BF16__)
#define KVSERVE_PREFILL_ATTENTION 1

constexpr int64_t kRows = 16;       // query rows per block: one A tile
constexpr int64_t kChunk = 64;      // keys per chunk: four C tiles of scores
constexpr int64_t kPairTile = 512;  // bf16 values of one B tile: 16 rows of 16 pairs

// Every tile 16 rows of 64 bytes. Tiles 0-3: C (scores, then output columns); 4: A (Q, then P);
// 5-7: B (K, then V). Loaded per thread and call: other AMX kernels share the threads.
void load_tile_config() {
  AmxConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// GCC's tile intrinsics take the tile's number as a literal and are asm without a memory clobber:
// hence the switches, and the compiler barriers where vector code reads a tile's store or writes
// what a tile load reads.
inline void barrier() { asm volatile("" ::: "memory"); }

inline void zero_tile(int c) {
  switch (c) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}

// C tile c += A (tile 4) . the B tile at b; each C tile takes its own B tile so that the loads of
// consecutive multiplies do not wait for one another.
inline void multiply_into(int c, const uint16_t* b) {
  switch (c) {
    case 0: _tile_loadd(5, b, 64); _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_loadd(6, b, 64); _tile_dpbf16ps(1, 4, 6); break;
    case 2: _tile_loadd(7, b, 64); _tile_dpbf16ps(2, 4, 7); break;
    default: _tile_loadd(5, b, 64); _tile_dpbf16ps(3, 4, 5); break;
  }
}

inline void store_tile(int c, float* dst, int64_t stride_bytes) {
  switch (c) {
    case 0: _tile_stored(0, dst, stride_bytes); break;
    case 1: _tile_stored(1, dst, stride_bytes); break;
    case 2: _tile_stored(2, dst, stride_bytes); break;
    default: _tile_stored(3, dst, stride_bytes); break;
  }
}

// One (sequence, KV head)'s keys and values [ctx, d] (bf16 bits, rows d apart) in the B-tile layouts
// above, `padded` keys (a multiple of kChunk), zeros from `keys` on.
void pack_keys(const uint16_t* k, int64_t keys, int64_t padded, int64_t d, uint32_t* out) {
  const int64_t slices = d / 32;
  auto* rows = reinterpret_cast<const uint32_t*>(k);  // a key's pairs of dims
  for (int64_t kb = 0; kb < padded / 16; ++kb) {
    for (int64_t ds = 0; ds < slices; ++ds) {
      uint32_t* tile = out + (kb * slices + ds) * (kPairTile / 2);
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t key = kb * 16 + n;
        for (int64_t p = 0; p < 16; ++p) tile[p * 16 + n] = key < keys ? rows[key * (d / 2) + ds * 16 + p] : 0u;
      }
    }
  }
}

void pack_values(const uint16_t* v, int64_t keys, int64_t padded, int64_t d, uint16_t* out) {
  const int64_t blocks = d / 16;
  for (int64_t kp = 0; kp < padded / 32; ++kp) {
    for (int64_t db = 0; db < blocks; ++db) {
      uint16_t* tile = out + (kp * blocks + db) * kPairTile;
      for (int64_t p = 0; p < 16; ++p) {
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t key = kp * 32 + 2 * p + e;
          const uint16_t* row = v + key * d + db * 16;
          for (int64_t n = 0; n < 16; ++n) tile[(p * 16 + n) * 2 + e] = key < keys ? row[n] : uint16_t{0};
        }
      }
    }
  }
}

// e^x lane by lane where `keep` is set, 0 elsewhere (x may be -inf or anything there): x = n ln2 + r
// with n = round(x / ln2), |r| <= ln2 / 2, the Cephes expf polynomial for e^r (relative error
// ~1e-7) and VSCALEFPS for the 2^n, which goes to 0 below float's range by itself.
inline __m512 masked_exp(__mmask16 keep, __m512 x) {
  const __m512 n = _mm512_maskz_roundscale_ps(0xFFFF, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

inline Vec16 as_vec16(__m512 v) {
  Vec16 out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
}

// Lanes of a 16-key vector that a row seeing `limit` keys past the vector's first sees.
inline __mmask16 keys_seen(int64_t limit) {
  return limit >= 16 ? __mmask16{0xFFFF} : limit <= 0 ? __mmask16{0} : static_cast<__mmask16>((1u << limit) - 1);
}

// Where a block's rows stand between chunks: running max (of the raw scores) and the lanes of the
// running sum of exp((score - max) * scale), and each row's rescale of the last chunk.
struct RowState {
  float max[kRows];
  alignas(64) float sum[kRows][kLanes];
  alignas(64) float rescale[kRows];
};

// The chunk's scores [16, 64] (float32, raw dot products) → its probabilities [16, 64] bf16 against
// each row's running max; updates the state. limit[r]: keys of this chunk row r sees (may be <= 0:
// then its max stays, its rescale is 1 and its probabilities 0).
void softmax_chunk(const float* scores, const int64_t* limit, float scale, RowState& state, c10::BFloat16* probs) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float old_max[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const float* row = scores + r * kChunk;
    __m512 top = minus_inf;
    for (int j = 0; j < 4; ++j) {
      top = _mm512_maskz_max_ps(0xFFFF, top, _mm512_mask_loadu_ps(minus_inf, keys_seen(limit[r] - 16 * j), row + 16 * j));
    }
    old_max[r] = state.max[r];
    state.max[r] = std::max(state.max[r], reduce_max_any_order(as_vec16(top)));
  }
  const __m512 old_v = _mm512_loadu_ps(old_max), new_v = _mm512_loadu_ps(state.max);
  const __mmask16 had_max = _mm512_cmp_ps_mask(old_v, minus_inf, _CMP_NEQ_OQ);
  _mm512_store_ps(state.rescale, masked_exp(had_max, _mm512_mul_ps(_mm512_sub_ps(old_v, new_v), _mm512_set1_ps(scale))));
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < kRows; ++r) {
    const float* row = scores + r * kChunk;
    const __m512 shift = _mm512_set1_ps(state.max[r] * scale);
    __m512 total = _mm512_mul_ps(_mm512_load_ps(state.sum[r]), _mm512_set1_ps(state.rescale[r]));
    for (int j = 0; j < 4; ++j) {
      const __mmask16 seen = keys_seen(limit[r] - 16 * j);
      const __m512 e = masked_exp(seen, _mm512_fmsub_ps(_mm512_loadu_ps(row + 16 * j), factor, shift));
      total = _mm512_add_ps(total, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + r * kChunk + 16 * j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    _mm512_store_ps(state.sum[r], total);
  }
}

struct BlockShape {
  int64_t d, query_len, first_query_pos, seq_len;
  float scale;
};

// One block of up to 16 query rows of one (sequence, KV head): q rows q_stride apart (16 readable;
// rows past `rows` see key 0 only and are not written), first_row its first row's index among the
// rows, out its `rows` rows (d apart); scratch holds 2 * 16 * d floats.
void attend_block(const uint16_t* q, int64_t q_stride, int64_t first_row, int64_t rows, const uint32_t* packed_k,
                  const uint16_t* packed_v, const BlockShape& shape, float* scratch, c10::BFloat16* out) {
  const int64_t d = shape.d, slices = d / 32, dblocks = d / 16;
  int64_t limit[kRows], chunk_limit[kRows], block_limit = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    limit[r] = r < rows ? std::min(shape.first_query_pos + (first_row + r) % shape.query_len + 1, shape.seq_len) : 1;
    block_limit = std::max(block_limit, limit[r]);
  }
  alignas(64) float scores[kRows * kChunk];
  alignas(64) c10::BFloat16 probs[kRows * kChunk];
  float* acc = scratch;              // [16, d]: the rows' outputs so far, unnormalized
  float* partial = acc + kRows * d;  // [16, d]: this chunk's P . V
  std::fill(acc, acc + kRows * d, 0.f);
  RowState state;
  std::fill(state.max, state.max + kRows, -std::numeric_limits<float>::infinity());
  std::fill(&state.sum[0][0], &state.sum[0][0] + kRows * kLanes, 0.f);

  for (int64_t c0 = 0; c0 < block_limit; c0 += kChunk) {
    const int blocks = static_cast<int>(std::min<int64_t>(4, (block_limit - c0 + 15) / 16));
    barrier();
    for (int c = 0; c < blocks; ++c) zero_tile(c);
    for (int64_t ds = 0; ds < slices; ++ds) {
      _tile_loadd(4, q + ds * 32, q_stride * 2);
      for (int c = 0; c < blocks; ++c) {
        multiply_into(c, reinterpret_cast<const uint16_t*>(packed_k + ((c0 / 16 + c) * slices + ds) * (kPairTile / 2)));
      }
    }
    for (int c = 0; c < blocks; ++c) store_tile(c, scores + 16 * c, kChunk * 4);
    barrier();
    for (int64_t r = 0; r < kRows; ++r) chunk_limit[r] = std::min<int64_t>(limit[r] - c0, 16 * blocks);
    softmax_chunk(scores, chunk_limit, shape.scale, state, probs);
    barrier();
    const int halves = blocks > 2 ? 2 : 1;
    for (int64_t db0 = 0; db0 < dblocks; db0 += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, dblocks - db0));
      for (int c = 0; c < n; ++c) zero_tile(c);
      for (int h = 0; h < halves; ++h) {
        _tile_loadd(4, probs + 32 * h, kChunk * 2);
        for (int c = 0; c < n; ++c) multiply_into(c, packed_v + ((c0 / 32 + h) * dblocks + db0 + c) * kPairTile);
      }
      for (int c = 0; c < n; ++c) store_tile(c, partial + (db0 + c) * 16, d * 4);
    }
    barrier();
    for (int64_t r = 0; r < kRows; ++r) {
      const Vec16 rescale = splat(state.rescale[r]);
      for (int64_t i = 0; i < d; i += kLanes) {
        store16(acc + r * d + i, load16(acc + r * d + i) * rescale + load16(partial + r * d + i));
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const Vec16 inv = splat(1.f / reduce_sum(load16(state.sum[r])));
    for (int64_t i = 0; i < d; i += kLanes) store16(out + r * d + i, load16(acc + r * d + i) * inv);
  }
}
#endif

bool has_prefill_attention() {
#if defined(KVSERVE_PREFILL_ATTENTION)
  return amx_permitted();
#else
  return false;
#endif
}

// q: [num_seqs, kv_heads, rows, d] bf16, rows = group * query_len (the query heads of a KV head,
//   query_len rows each: row r is query token r % query_len); keys, values: [num_seqs, kv_heads,
//   ctx_len, d] bf16; first_query_pos, seq_lens: [num_seqs] int32 (as causal_softmax_ takes them).
// Row r of sequence s attends to keys [0, min(first_query_pos[s] + r % query_len + 1, seq_lens[s])).
// Returns [num_seqs, kv_heads, rows, d] bf16.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& first_query_pos, const at::Tensor& seq_lens, int64_t query_len,
                             double scale) {
  TORCH_CHECK(has_prefill_attention(), "prefill_attention: needs AMX bf16 tiles, which this CPU or build lacks");
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
              "prefill_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                  values.scalar_type() == at::kBFloat16,
              "prefill_attention: q, keys and values must be bfloat16");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && keys.sizes() == values.sizes() && q.size(0) == keys.size(0) &&
                  q.size(1) == keys.size(1) && q.size(3) == keys.size(3),
              "prefill_attention: q [seqs, kv_heads, rows, d], keys and values [seqs, kv_heads, ctx_len, d]");
  const int64_t num_seqs = q.size(0), rows = q.size(2), d = q.size(3), ctx_len = keys.size(2);
  TORCH_CHECK(d % 32 == 0 && d <= kMaxHeadSize, "prefill_attention: head_size must be a multiple of 32 up to ",
              kMaxHeadSize, ", got ", d);
  TORCH_CHECK(query_len > 0 && rows % query_len == 0, "prefill_attention: rows (", rows,
              ") must be a multiple of query_len (", query_len, ")");
  TORCH_CHECK(first_query_pos.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  first_query_pos.numel() == num_seqs && seq_lens.numel() == num_seqs,
              "prefill_attention: first_query_pos and seq_lens must be int32, one per sequence");
  const auto first = first_query_pos.contiguous();
  const auto lens = seq_lens.contiguous();
  const int32_t* first_ptr = first.data_ptr<int32_t>();
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens_ptr[s] > 0 && lens_ptr[s] <= ctx_len && first_ptr[s] >= 0 && first_ptr[s] < lens_ptr[s],
                "prefill_attention: sequence ", s, " has seq_len ", lens_ptr[s], " and first query at ", first_ptr[s],
                " for ", ctx_len, " keys");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
#if defined(KVSERVE_PREFILL_ATTENTION)
  const int64_t heads = q.size(1);
  const auto qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  const int64_t padded = (ctx_len + kChunk - 1) / kChunk * kChunk, pairs = num_seqs * heads;
  std::vector<uint16_t> packed(static_cast<size_t>(2 * pairs * padded * d));
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  auto packed_k = [&](int64_t pair) { return reinterpret_cast<uint32_t*>(packed.data() + 2 * pair * padded * d); };
  auto packed_v = [&](int64_t pair) { return packed.data() + (2 * pair + 1) * padded * d; };
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t keys_seen = lens_ptr[pair / heads];
      pack_keys(kp + pair * ctx_len * d, keys_seen, padded, d, packed_k(pair));
      pack_values(vp + pair * ctx_len * d, keys_seen, padded, d, packed_v(pair));
    }
  });
  const int64_t blocks_per_pair = (rows + kRows - 1) / kRows;
  at::parallel_for(0, pairs * blocks_per_pair, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    alignas(64) uint16_t padded_q[kRows * kMaxHeadSize];
    std::vector<float> scratch(static_cast<size_t>(2 * kRows * d));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item / blocks_per_pair, r0 = (item % blocks_per_pair) * kRows, s = pair / heads;
      const int64_t block_rows = std::min(kRows, rows - r0);
      const uint16_t* block_q = qp + (pair * rows + r0) * d;
      if (block_rows < kRows) {  // the tile load reads 16 rows: the rest zeros
        std::fill(padded_q, padded_q + kRows * d, uint16_t{0});
        for (int64_t r = 0; r < block_rows; ++r) std::memcpy(padded_q + r * d, block_q + r * d, d * 2);
        block_q = padded_q;
      }
      const BlockShape shape{d, query_len, first_ptr[s], lens_ptr[s], static_cast<float>(scale)};
      attend_block(block_q, d, r0, block_rows, packed_k(pair), packed_v(pair), shape, scratch.data(),
                   op + (pair * rows + r0) * d);
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("has_prefill_attention", &has_prefill_attention);
  m.def("prefill_attention(Tensor q, Tensor keys, Tensor values, Tensor first_query_pos, Tensor seq_lens, "
        "int query_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
