// Causal attention of a prefill chunk, fused: scores, softmax and values in one pass per block of
// 16 query rows, reading K and V from the paged cache where they lie; nothing of size [rows, ctx_len]
// and no gathered copy of the context goes through memory. The two products run on AMX bf16 tiles
// where the CPU has them, else as AVX-512 VDPBF16PS over the same layouts (a Zen 4).
//
// The cpu backend's prefill path without this kernel (a CPU without AVX-512 BF16) gathers the
// blocks into contiguous K/V (the int8 cache widened to bf16 on the way, several passes in torch)
// and runs two oneDNN GEMMs around causal_softmax_: the [rows, ctx_len] scores go through memory
// three times (written, softmaxed in place, read), 16 MiB a layer for an 896-token chunk after 128
// cached tokens, and that traffic, not the arithmetic, was 40% of the whole prefill on the AMX Xeon
// (bmm 19%, softmax 23%), ~24% on the Zen 4. Here, for 16 query rows at a time (one A tile), the
// keys go by in chunks of 64:
//
//   scores  S [16, 64] = Q [16, D] . K^T      TDPBF16PS, 4 C tiles, D / 32 steps each
//   online softmax per row (float32): running max m and sum l, P = exp(S - m) rounded to bf16,
//           the accumulated output rescaled by exp(m_old - m_new)
//   values  O [16, D] += P [16, 64] . V [64, D]   TDPBF16PS, D / 16 C tiles, 2 steps each
//
// and only the chunks a block's rows may see are visited (row r sees keys
// [0, min(first_query_pos + r % query_len + 1, seq_len))). Per (sequence, KV head) K and V are first
// laid out once as the B tiles want them (pairs of bf16 side by side):
//
//   K: [key blocks of 16][D / 32][16 pairs of dims][16 keys][2]
//   V: [key blocks of 32][D / 16][16 pairs of keys][16 dims][2]
//
// a row of a B tile being one 512-bit vector of 16 pairs, as VDPBF16PS takes it too. Scores and
// sums are float32, probabilities bf16 (as the GEMM path stores them), the output is normalized
// once at the end.
//
// Registered as torch.ops.kvserve_cpu.{has_prefill_attention, paged_prefill_attention}.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "claims.h"
#include "prefill_tables.h"
#include "vec16.h"

namespace {

using namespace kvserve_cpu;

constexpr int64_t kMaxHeadSize = 256;
constexpr int64_t kBlock = 16;  // tokens per cache block

// The packing, the softmax and the accumulation are AVX-512 (with BF16's conversions); the two
// products of each chunk run on AMX tiles where the process may use them, else as VDPBF16PS.
#if defined(__AVX512BF16__)
#define KVSERVE_PREFILL_ATTENTION 1
#endif
#if defined(KVSERVE_PREFILL_ATTENTION) && defined(KVSERVE_AMX_INT8) && defined(__AMX_BF16__)
#define KVSERVE_PREFILL_ATTENTION_AMX 1
#endif

#if defined(KVSERVE_PREFILL_ATTENTION)
constexpr int64_t kRows = 16;       // query rows per block: one A tile
constexpr int64_t kChunk = 64;      // keys per chunk: four C tiles of scores
constexpr int64_t kPairTile = 512;  // bf16 values of one B tile: 16 rows of 16 pairs

// GCC's tile intrinsics are asm without a memory clobber: compiler barriers where vector code
// reads a tile's store or writes what a tile load reads.
inline void barrier() { asm volatile("" ::: "memory"); }
#endif

#if defined(KVSERVE_PREFILL_ATTENTION_AMX)

// Every tile 16 rows of 64 bytes. Tiles 0-3: C (scores, then output columns); 4: A (Q, then P);
// 5-7: B (K, then V). Loaded per thread and call: other AMX kernels share the threads.
void load_tile_config() {
  AmxConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  kvserve_cpu::load_tile_config(config);
}

// GCC's tile intrinsics take the tile's number as a literal: hence the switches.
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
#endif

#if defined(KVSERVE_PREFILL_ATTENTION)

// ---- K and V from the paged cache, as B tiles ---------------------------------------------------
//
// The caches are the cpu backend's (paged_decode_attention.cpp, write_kv.cpp): per (block, KV head)
// a K tile [d, 16] (a row: one dimension of the block's 16 keys) and a V tile [16, d], bf16; or, for
// the int8 cache, records of the tile's codes and then the block's 16 per-token float32 scales,
// widened here as the torch path did (code * scale in float32, rounded to bf16, ties to even).

// a0 b0 a1 b1 ... a15 b15 from [a0..a15 | b0..b15]: two rows of 16 as one B tile row of pairs.
inline __m512i interleave_halves(__m512i rows) {
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), rows);
}

// The same from two rows of 16 bf16 in memory.
inline __m512i interleave_rows(const uint16_t* a, const uint16_t* b) {
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                          8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m512i high = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  return _mm512_permutex2var_epi16(low, _mm512_load_si512(kInterleave), high);
}

inline __m512 widen_codes(const int8_t* codes) {
  return _mm512_maskz_cvtepi32_ps(0xFFFF, _mm512_maskz_cvtepi8_epi32(0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
}

// a and b rounded to bf16 (ties to even, as torch's conversion), interleaved.
inline __m512i interleave_bf16(__m512 a, __m512 b) { return interleave_halves((__m512i)_mm512_cvtne2ps_pbh(b, a)); }

// Where a layer's tiles lie: tile (block, head) starts block * block_stride + head * head_stride
// elements in.
struct TileCache {
  const void* base;
  int64_t block_stride, head_stride;
};

// bf16 tiles. key_rows: dims (d, d + 1) of a block's 16 keys, interleaved; value_rows: dims
// [d0, d0 + 16) of tokens (t, t + 1) of a block, interleaved.
struct Bf16Cache {
  TileCache k, v;
  int64_t d;
  const uint16_t* tile(const TileCache& c, int64_t block, int64_t head) const {
    return static_cast<const uint16_t*>(c.base) + block * c.block_stride + head * c.head_stride;
  }
  __m512i key_rows(int64_t block, int64_t head, int64_t dim) const {
    const uint16_t* t = tile(k, block, head) + dim * kBlock;
    return interleave_rows(t, t + kBlock);
  }
  __m512i value_rows(int64_t block, int64_t head, int64_t token, int64_t d0) const {
    const uint16_t* t = tile(v, block, head) + token * d + d0;
    return interleave_rows(t, t + d);
  }
};

// int8 records: codes, then 16 float32 scales (one per token of the block).
struct Int8Cache {
  TileCache k, v;
  int64_t d;
  const int8_t* tile(const TileCache& c, int64_t block, int64_t head) const {
    return static_cast<const int8_t*>(c.base) + block * c.block_stride + head * c.head_stride;
  }
  const float* scales(const int8_t* t) const { return reinterpret_cast<const float*>(t + kBlock * d); }
  __m512i key_rows(int64_t block, int64_t head, int64_t dim) const {
    const int8_t* t = tile(k, block, head);
    const __m512 scale = _mm512_loadu_ps(scales(t));
    return interleave_bf16(_mm512_mul_ps(widen_codes(t + dim * kBlock), scale),
                           _mm512_mul_ps(widen_codes(t + (dim + 1) * kBlock), scale));
  }
  __m512i value_rows(int64_t block, int64_t head, int64_t token, int64_t d0) const {
    const int8_t* t = tile(v, block, head);
    const float* scale = scales(t);
    return interleave_bf16(_mm512_mul_ps(widen_codes(t + token * d + d0), _mm512_set1_ps(scale[token])),
                           _mm512_mul_ps(widen_codes(t + (token + 1) * d + d0), _mm512_set1_ps(scale[token + 1])));
  }
};

// One (sequence, KV head)'s keys and values, from its blocks (`table`), into the B-tile layouts of
// the top of this file, `padded` keys (a multiple of kChunk); keys from `keys` on are zeros.
template <typename Cache>
void pack_sequence(const Cache& cache, const int32_t* table, int64_t head, int64_t keys, int64_t padded,
                   uint16_t* packed_k, uint16_t* packed_v) {
  const int64_t d = cache.d, slices = d / 32, dblocks = d / 16;
  // The scores of keys past `keys` are never read, so a block's stale slots may stay in K; blocks
  // past the last are not in the table.
  for (int64_t kb = 0; kb < padded / kBlock; ++kb) {
    const bool held = kb * kBlock < keys;
    for (int64_t dim = 0; dim < d; dim += 2) {  // row dim / 2 % 16 of slice dim / 32
      const __m512i row = held ? cache.key_rows(table[kb], head, dim) : _mm512_setzero_si512();
      _mm512_storeu_si512(packed_k + ((kb * slices + dim / 32) * 16 + dim % 32 / 2) * 32, row);
    }
  }
  // Stale values must go: their probability is 0, but 0 * inf is not.
  for (int64_t key = 0; key < padded; key += 2) {  // row key / 2 % 16 of key block key / 32
    const bool first = key < keys, second = key + 1 < keys;
    for (int64_t db = 0; db < dblocks; ++db) {
      __m512i row = _mm512_setzero_si512();
      if (first) row = cache.value_rows(table[key / kBlock], head, key % kBlock, db * 16);
      if (!second) row = _mm512_maskz_mov_epi16(0x55555555u, row);  // the odd key's words
      _mm512_storeu_si512(packed_v + ((key / 32 * dblocks + db) * 16 + key % 32 / 2) * 32, row);
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

#if defined(KVSERVE_PREFILL_ATTENTION_AMX)
// A chunk's two products on tiles (the C tiles stored to the vector code's arrays).
struct AmxProducts {
  static void prepare_thread() { load_tile_config(); }

  // scores [16, 16 blocks] = the block's Q . the chunk's first `blocks` key blocks (packed_k there).
  static void scores(const uint16_t* q, int64_t q_stride, int64_t, const uint32_t* packed_k, int blocks,
                     int64_t slices, float* out) {
    barrier();
    for (int c = 0; c < blocks; ++c) zero_tile(c);
    for (int64_t ds = 0; ds < slices; ++ds) {
      _tile_loadd(4, q + ds * 32, q_stride * 2);
      for (int c = 0; c < blocks; ++c) {
        multiply_into(c, reinterpret_cast<const uint16_t*>(packed_k + (c * slices + ds) * (kPairTile / 2)));
      }
    }
    for (int c = 0; c < blocks; ++c) store_tile(c, out + 16 * c, kChunk * 4);
    barrier();
  }

  // partial [16, d] = the chunk's probabilities [16, 32 halves] . its values (packed_v there).
  static void values(const c10::BFloat16* probs, int64_t, const uint16_t* packed_v, int halves, int64_t dblocks,
                     float* partial) {
    barrier();
    for (int64_t db0 = 0; db0 < dblocks; db0 += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, dblocks - db0));
      for (int c = 0; c < n; ++c) zero_tile(c);
      for (int h = 0; h < halves; ++h) {
        _tile_loadd(4, probs + 32 * h, kChunk * 2);
        for (int c = 0; c < n; ++c) multiply_into(c, packed_v + (h * dblocks + db0 + c) * kPairTile);
      }
      for (int c = 0; c < n; ++c) store_tile(c, partial + (db0 + c) * 16, dblocks * 16 * 4);
    }
    barrier();
  }
};
#endif

// The same products as VDPBF16PS over the same packed layouts (a CPU with AVX-512 BF16 but no AMX):
// four query rows at a time against up to four vectors of 16 keys (scores) or of 16 dimensions
// (values), one broadcast pair of bf16 per row and step. Rows from `rows` on are zeros.
struct VectorProducts {
  static void prepare_thread() {}

  static void scores(const uint16_t* q, int64_t q_stride, int64_t rows, const uint32_t* packed_k, int blocks,
                     int64_t slices, float* out) {
    switch (blocks) {
      case 1: score_rows<1>(q, q_stride, rows, packed_k, slices * 16, out); break;
      case 2: score_rows<2>(q, q_stride, rows, packed_k, slices * 16, out); break;
      case 3: score_rows<3>(q, q_stride, rows, packed_k, slices * 16, out); break;
      default: score_rows<4>(q, q_stride, rows, packed_k, slices * 16, out); break;
    }
  }

  static void values(const c10::BFloat16* probs, int64_t rows, const uint16_t* packed_v, int halves, int64_t dblocks,
                     float* partial) {
    const int64_t d = dblocks * 16;
    for (int64_t r0 = 0; r0 < kRows; r0 += 4) {
      if (r0 >= rows) {
        std::fill(partial + r0 * d, partial + (r0 + 4) * d, 0.f);
        continue;
      }
      for (int64_t db0 = 0; db0 < dblocks; db0 += 4) {
        const auto* row_probs = reinterpret_cast<const uint16_t*>(probs) + r0 * kChunk;
        switch (std::min<int64_t>(4, dblocks - db0)) {
          case 1: value_rows<1>(row_probs, packed_v, halves, dblocks, db0, partial + r0 * d); break;
          case 2: value_rows<2>(row_probs, packed_v, halves, dblocks, db0, partial + r0 * d); break;
          case 3: value_rows<3>(row_probs, packed_v, halves, dblocks, db0, partial + r0 * d); break;
          default: value_rows<4>(row_probs, packed_v, halves, dblocks, db0, partial + r0 * d); break;
        }
      }
    }
  }

 private:
  static __m512bh broadcast_pair(const uint16_t* p) {
    int32_t pair;
    std::memcpy(&pair, p, sizeof(pair));
    return (__m512bh)_mm512_set1_epi32(pair);
  }

  // Key block c's dims (2p, 2p + 1) of its 16 keys: the 16 pairs at packed_k + (c * pairs + p) * 16.
  template <int BLOCKS>
  static void score_rows(const uint16_t* q, int64_t q_stride, int64_t rows, const uint32_t* packed_k, int64_t pairs,
                         float* out) {
    for (int64_t r0 = 0; r0 < kRows; r0 += 4) {
      float* dst = out + r0 * kChunk;
      if (r0 >= rows) {
        std::fill(dst, dst + 4 * kChunk, 0.f);
        continue;
      }
      __m512 acc[4][BLOCKS];
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < BLOCKS; ++c) acc[r][c] = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; ++p) {
        __m512bh keys[BLOCKS];
        for (int c = 0; c < BLOCKS; ++c) keys[c] = (__m512bh)_mm512_loadu_si512(packed_k + (c * pairs + p) * 16);
        for (int r = 0; r < 4; ++r) {
          const __m512bh pair = broadcast_pair(q + (r0 + r) * q_stride + 2 * p);
          for (int c = 0; c < BLOCKS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, keys[c]);
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < BLOCKS; ++c) _mm512_storeu_ps(dst + r * kChunk + 16 * c, acc[r][c]);
    }
  }

  // Dims [16 (db0 + c), + 16) of keys (2j, 2j + 1) of the chunk (half j / 16, pair j % 16 in it):
  // the 16 pairs at packed_v + ((j / 16 * dblocks + db0 + c) * 16 + j % 16) * 32.
  template <int N>
  static void value_rows(const uint16_t* probs, const uint16_t* packed_v, int halves, int64_t dblocks, int64_t db0,
                         float* out) {
    __m512 acc[4][N];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < N; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < 16 * halves; ++j) {
      __m512bh values[N];
      for (int c = 0; c < N; ++c) {
        values[c] = (__m512bh)_mm512_loadu_si512(packed_v + ((j / 16 * dblocks + db0 + c) * 16 + j % 16) * 32);
      }
      for (int r = 0; r < 4; ++r) {
        const __m512bh pair = broadcast_pair(probs + r * kChunk + 2 * j);
        for (int c = 0; c < N; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, values[c]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < N; ++c) _mm512_storeu_ps(out + r * dblocks * 16 + (db0 + c) * 16, acc[r][c]);
  }
};

// One block of up to 16 query rows of one (sequence, KV head): q rows q_stride apart (16 readable;
// rows past `rows` see key 0 only and are not written), first_row its first row's index among the
// rows, out its `rows` rows (d apart); scratch holds 2 * 16 * d floats. Products: AmxProducts or
// VectorProducts, the chunk's two matrix products.
template <typename Products>
void attend_block(const uint16_t* q, int64_t q_stride, int64_t first_row, int64_t rows, const uint32_t* packed_k,
                  const uint16_t* packed_v, const BlockShape& shape, float* scratch, c10::BFloat16* const* out) {
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
    Products::scores(q, q_stride, rows, packed_k + c0 / 16 * slices * (kPairTile / 2), blocks, slices, scores);
    for (int64_t r = 0; r < kRows; ++r) chunk_limit[r] = std::min<int64_t>(limit[r] - c0, 16 * blocks);
    softmax_chunk(scores, chunk_limit, shape.scale, state, probs);
    Products::values(probs, rows, packed_v + c0 / 32 * dblocks * kPairTile, blocks > 2 ? 2 : 1, dblocks, partial);
    for (int64_t r = 0; r < kRows; ++r) {
      const Vec16 rescale = splat(state.rescale[r]);
      for (int64_t i = 0; i < d; i += kLanes) {
        store16(acc + r * d + i, load16(acc + r * d + i) * rescale + load16(partial + r * d + i));
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const Vec16 inv = splat(1.f / reduce_sum(load16(state.sum[r])));
    for (int64_t i = 0; i < d; i += kLanes) store16(out[r] + i, load16(acc + r * d + i) * inv);
  }
}
#endif

// Built where the compiler targets AVX-512 BF16 (every CPU with AMX bf16 has it too).
bool has_prefill_attention() {
#if defined(KVSERVE_PREFILL_ATTENTION)
  return true;
#else
  return false;
#endif
}

#if defined(KVSERVE_PREFILL_ATTENTION)
// Where a step's query rows lie. Sequence s's query_len = seq_len - first_query_pos tokens are rows
// start[s] .. of q [tokens, heads, d] (token_stride elements apart); its KV head h attends the rows
// (g, t) of its query heads h * group + g, t < query_len, 16 at a time: block b of the pair (s, h)
// holds its rows 16b .. 16b + 15 in that order (g major), so a short chunk's query heads share tiles.
struct QueryRows {
  const uint16_t* q;
  int64_t token_stride, heads, kv_heads, group, d;
  const int32_t *start, *first, *lens;

  int64_t query_len(int64_t s) const { return lens[s] - first[s]; }
  int64_t blocks(int64_t s) const { return (group * query_len(s) + kRows - 1) / kRows; }
  // Row r of pair (s, h): its query head and token.
  const uint16_t* row(int64_t s, int64_t h, int64_t r) const {
    const int64_t len = query_len(s);
    return q + (start[s] + r % len) * token_stride + (h * group + r / len) * d;
  }
  int64_t out_offset(int64_t s, int64_t h, int64_t r) const {
    const int64_t len = query_len(s);
    return ((start[s] + r % len) * heads + h * group + r / len) * d;
  }
  // The key chunks block b visits (its rows see at most that many): its work, which orders the claims.
  int64_t block_chunks(int64_t s, int64_t b) const {
    const int64_t len = query_len(s), r0 = b * kRows, r1 = std::min(r0 + kRows, group * len);
    const int64_t last_token = r0 / len == (r1 - 1) / len ? (r1 - 1) % len : len - 1;
    return (first[s] + last_token + 1 + kChunk - 1) / kChunk;
  }
};

// Packs every (sequence, KV head), then attends every block of 16 query rows: the threads claim the
// pairs, then the blocks, one at a time (claims.h), the blocks that visit the most key chunks first
// (a step's prompts differ by far in their keys: a 573-token prompt's last blocks beside 20-token
// ones), so that no thread is left with a long one at the end.
template <typename Products, typename Cache>
void attend_all(const Cache& cache, const QueryRows& rows, const int32_t* tables, int64_t max_blocks,
                int64_t num_seqs, float scale, c10::BFloat16* out) {
  const int64_t d = rows.d, pairs = num_seqs * rows.kv_heads;
  std::vector<int64_t> packed_at(pairs + 1, 0), blocks_at(pairs + 1, 0);
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t s = pair / rows.kv_heads, padded = (rows.lens[s] + kChunk - 1) / kChunk * kChunk;
    packed_at[pair + 1] = packed_at[pair] + 2 * padded * d;
    blocks_at[pair + 1] = blocks_at[pair] + rows.blocks(s);
  }
  std::vector<uint16_t> packed(static_cast<size_t>(packed_at[pairs]));
  parallel_claims(pairs, 1, [&](Claims& claims) {
    int64_t begin, end;
    while (claims(begin, end)) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t s = pair / rows.kv_heads, half = (packed_at[pair + 1] - packed_at[pair]) / 2;
        pack_sequence(cache, tables + s * max_blocks, pair % rows.kv_heads, rows.lens[s], half / d,
                      packed.data() + packed_at[pair], packed.data() + packed_at[pair] + half);
      }
    }
  });
  struct Block {
    int64_t chunks, pair, index;
  };
  std::vector<Block> order;
  order.reserve(static_cast<size_t>(blocks_at[pairs]));
  for (int64_t pair = 0; pair < pairs; ++pair) {
    for (int64_t b = 0; b < blocks_at[pair + 1] - blocks_at[pair]; ++b) {
      order.push_back({rows.block_chunks(pair / rows.kv_heads, b), pair, b});
    }
  }
  std::stable_sort(order.begin(), order.end(), [](const Block& x, const Block& y) { return x.chunks > y.chunks; });
  parallel_claims(static_cast<int64_t>(order.size()), 1, [&](Claims& claims) {
    Products::prepare_thread();
    alignas(64) uint16_t block_q[kRows * kMaxHeadSize];
    c10::BFloat16* block_out[kRows];
    std::vector<float> scratch(static_cast<size_t>(2 * kRows * d));
    int64_t begin, end;
    while (claims(begin, end)) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t pair = order[item].pair, s = pair / rows.kv_heads, h = pair % rows.kv_heads;
        const int64_t r0 = order[item].index * kRows;
        const int64_t block_rows = std::min(kRows, rows.group * rows.query_len(s) - r0);
        for (int64_t r = 0; r < block_rows; ++r) {
          std::memcpy(block_q + r * d, rows.row(s, h, r0 + r), d * 2);
          block_out[r] = out + rows.out_offset(s, h, r0 + r);
        }
        if (block_rows < kRows) std::fill(block_q + block_rows * d, block_q + kRows * d, uint16_t{0});
        const int64_t half = (packed_at[pair + 1] - packed_at[pair]) / 2;
        const BlockShape shape{d, rows.query_len(s), rows.first[s], rows.lens[s], scale};
        attend_block<Products>(block_q, d, r0, block_rows,
                               reinterpret_cast<const uint32_t*>(packed.data() + packed_at[pair]),
                               packed.data() + packed_at[pair] + half, shape, scratch.data(), block_out);
      }
    }
  });
}

// On AMX tiles where this process may use them, else as VDPBF16PS.
template <typename Cache>
void attend_all_fastest(const Cache& cache, const QueryRows& rows, const int32_t* tables, int64_t max_blocks,
                        int64_t num_seqs, float scale, c10::BFloat16* out) {
#if defined(KVSERVE_PREFILL_ATTENTION_AMX)
  if (amx_bf16_usable()) {
    attend_all<AmxProducts>(cache, rows, tables, max_blocks, num_seqs, scale, out);
    return;
  }
#endif
  attend_all<VectorProducts>(cache, rows, tables, max_blocks, num_seqs, scale, out);
}
#endif

// q: [tokens, heads, d] bf16 (any stride between tokens: a view of the step's q/k/v projection);
// key_cache, value_cache: the cpu backend's, bf16 (K [num_blocks, kv_heads, d, 16], V [num_blocks,
//   kv_heads, 16, d]) or int8 records ([num_blocks, kv_heads, 16 d codes + 16 float32 scales]);
// block_tables [num_seqs, max_blocks], query_starts, first_query_pos, seq_lens [num_seqs], int32.
// Sequence s's query tokens are q's rows query_starts[s] .. + seq_lens[s] - first_query_pos[s], at
// positions first_query_pos[s] ..; token t of them attends to keys [0, first_query_pos[s] + t + 1).
// Writes those rows of out [tokens, heads, d] bf16 (contiguous); the other rows are left as they are.
// The sequences' rows must not overlap.
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_starts,
                             const at::Tensor& first_query_pos, const at::Tensor& seq_lens, double scale,
                             const at::Tensor& out) {
  const char* op = "paged_prefill_attention";
  TORCH_CHECK(has_prefill_attention(), op, ": needs AVX-512 BF16, which this CPU or build lacks");
  TORCH_CHECK(q.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
                  out.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3, op, ": q must be bfloat16 [tokens, heads, d]");
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(d % 32 == 0 && d > 0 && d <= kMaxHeadSize, op, ": head_size must be a multiple of 32 up to ",
              kMaxHeadSize, ", got ", d);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && q.stride(0) >= heads * d, op,
              ": q's heads must be contiguous within a token");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.sizes() == q.sizes() && out.is_contiguous(), op,
              ": out must be contiguous bfloat16 of q's shape");
  const int64_t kv_heads = key_cache.dim() >= 2 ? key_cache.size(1) : 0;
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, op, ": q's ", heads,
              " heads are not a whole number of query heads for each of the caches' ", kv_heads, " KV heads");
  const bool int8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() && (int8 || key_cache.scalar_type() == at::kBFloat16),
              op, ": the caches must be bfloat16 tiles or int8 records");
  check_prefill_caches(op, kv_heads, d, key_cache, value_cache, kBlock);
  const int64_t num_seqs = block_tables.dim() == 2 ? block_tables.size(0) : 0;
  const PrefillTables t = checked_prefill_tables(op, block_tables, first_query_pos, seq_lens, num_seqs,
                                                  key_cache.size(0), kBlock);
  TORCH_CHECK(query_starts.scalar_type() == at::kInt && query_starts.numel() == num_seqs, op,
              ": query_starts must be int32 [seqs]");
  const at::Tensor starts = query_starts.contiguous();
  const int32_t* start_ptr = starts.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = t.lens_ptr()[s] - t.first_ptr()[s];
    TORCH_CHECK(start_ptr[s] >= 0 && start_ptr[s] + query_len <= tokens, op, ": sequence ", s, "'s ", query_len,
                " query rows from row ", start_ptr[s], " are not all among q's ", tokens);
  }
#if defined(KVSERVE_PREFILL_ATTENTION)
  const QueryRows rows{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), q.stride(0), heads, kv_heads,
                       heads / kv_heads, d, start_ptr, t.first_ptr(), t.lens_ptr()};
  const TileCache k{key_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1)};
  const TileCache v{value_cache.data_ptr(), value_cache.stride(0), value_cache.stride(1)};
  auto* dst = out.data_ptr<at::BFloat16>();
  if (int8) {
    attend_all_fastest(Int8Cache{k, v, d}, rows, t.table_ptr(), t.max_blocks, num_seqs, static_cast<float>(scale), dst);
  } else {
    attend_all_fastest(Bf16Cache{k, v, d}, rows, t.table_ptr(), t.max_blocks, num_seqs, static_cast<float>(scale), dst);
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("has_prefill_attention", &has_prefill_attention);
  m.def("paged_prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_starts, Tensor first_query_pos, Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
