// y = x @ W^T (+ bias) for the prompt tokens of a step, W the quantized weights in
// skinny_quantized.cpp's layouts (pack_skinny_int8, pack_skinny_int4), on AMX bf16 tiles.
//
// A decode step takes skinny_linear_int8 / _int4, which round the activations to int8 per group of
// 32 inputs: each group's 16 x 16 integer tile must then be stored and scaled by its group's
// activation scales, which costs more than the tile multiply itself (docs/executor.md). A prompt
// has tens to hundreds of rows, and there this kernel expands the weights once per tile into bf16
// and multiplies them with the unrounded bf16 activations in TDPBF16PS, accumulating over the
// whole input in the tiles: one store per 16 x 16 outputs. No second copy of the weights is kept.
//
//   int8: the codes q in [-127, 127] are exact in bf16; the column's scale multiplies at the end.
//   int4: each weight (c - 8) * scale + zero, one FMA in float32, rounded to bf16 (ties to even).
//
// Per pair of column tiles (32 outputs): expand both tiles (2 x K x 16 bf16, at most 96 KiB here:
// it stays in L2), then for every 32 rows of x four accumulators — 2 row tiles x 2 column tiles —
// over all of K.
//
// prompt_linear_bf16: bf16 weights in pack_skinny_weight's layout, whose tiles are the B operand as
// they lie (nothing to expand). Each row's sums are the same as skinny_linear's on AMX (the same
// tile multiplies over K in the same order, from zero): executor/skinny.py gives a step's rows to
// skinny_linear up to a few dozen, to this kernel beyond.
//
// prompt_silu_and_mul_*: the MLP's gate_up projection with silu(gate) * up computed from the sums,
// pairing gate tile p with up tile p + tiles / 2, so that the projection's output is never stored;
// for int8 and int4 weights, and for bf16 ones in pack_skinny_weight's layout, whose tiles are the
// B operand as they lie (nothing to expand).
//
// Registered as torch.ops.kvserve_cpu.{has_prompt_linear, prompt_linear_int8, prompt_linear_int4,
// prompt_linear_bf16, prompt_silu_and_mul_bf16, prompt_silu_and_mul_int8, prompt_silu_and_mul_int4}.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "amx.h"
#include "claims.h"
#include "packed_layout.h"
#include "vec16.h"

namespace {

using namespace kvserve_cpu;

constexpr int64_t kDepth = 32;             // inputs per tile multiply: 16 pairs of bf16
constexpr int64_t kRowBlock = 32;          // rows of x per block: two row tiles
constexpr int64_t kExpandedTile = kDepth * kTile;  // bf16 values of one expanded B tile
constexpr int64_t kPassBytes = 768 * 1024;         // rows of x per pass over the weights, in bytes

#if defined(KVSERVE_AMX_INT8) && defined(__AMX_BF16__)
#define KVSERVE_PROMPT_LINEAR 1

// Tiles 0-3: accumulators, row tile r and column tile c in tile 2r + c; 4-5: the two row tiles'
// 16 rows x 32 inputs of x; 6-7: the two column tiles' 32 inputs x 16 columns, as 16 rows of
// pairs. Loaded per thread and call: other AMX kernels run on the same threads.
void load_tile_config() {
  AmxConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  kvserve_cpu::load_tile_config(config);
}

// The zero-masked form: GCC 12 warns that the unmasked one reads an uninitialized register.
inline __m512i shift_right(__m512i v, unsigned bits) { return _mm512_maskz_srli_epi32(0xFFFF, v, bits); }

// One quad of codes (inputs k..k+3 of the tile's 16 columns, u = q + 128) as two rows of a B
// tile: (k, k+1) and (k+2, k+3), each column's pair side by side, the lower input in the low half.
// The float with bits 0x4B000000 | u is 2^23 + u; less 2^23 + 128 it is q, exactly, and the upper
// half of its bits is q's bf16.
inline void expand_quad(const uint8_t* quad, uint16_t* rows) {
  const __m512i codes = _mm512_loadu_si512(quad);
  const __m512i byte = _mm512_set1_epi32(0xFF), magic = _mm512_set1_epi32(0x4B000000);
  const __m512i upper = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 offset = _mm512_set1_ps(8388736.f);
  auto as_float_bits = [&](__m512i shifted) {  // ternary logic 0xEA: (a & b) | c
    const __m512 biased = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(shifted, byte, magic, 0xEA));
    return _mm512_castps_si512(_mm512_sub_ps(biased, offset));
  };
  const __m512i f0 = as_float_bits(codes), f1 = as_float_bits(shift_right(codes, 8));
  const __m512i f2 = as_float_bits(shift_right(codes, 16)), f3 = as_float_bits(shift_right(codes, 24));
  // ternary logic 0xF8: a | (b & c)
  _mm512_storeu_si512(rows, _mm512_ternarylogic_epi32(shift_right(f0, 16), f1, upper, 0xF8));
  _mm512_storeu_si512(rows + 2 * kTile, _mm512_ternarylogic_epi32(shift_right(f2, 16), f3, upper, 0xF8));
}

// An int8 tile's codes → `groups` B tiles of kExpandedTile bf16 each.
void expand_int8_tile(const uint8_t* tile, int64_t groups, uint16_t* expanded) {
  for (int64_t quad = 0; quad < groups * (kDepth / 4); ++quad) {
    expand_quad(tile + quad * kQuadBytes, expanded + quad * 4 * kTile);
  }
}

// ---- int4: the group records of pack_skinny_int4 ----------------------------------------------
// Per tile and group of 32 inputs, 320 bytes: 4 blocks of 64 (block b: each column's 4 bytes, byte
// j with input 4b + j in its low nibble and 16 + 4b + j in its high one), then the 16 columns' bf16
// scales and zeros.

inline __m512 bf16_as_float(const uint8_t* p) {
  const __m512i words = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, words, 16));
}

// One group record → its B tile: (c - 8) * scale + zero in float32 (one FMA), rounded to bf16.
// (0x4B000000 | c) - (2^23 + 8) is c - 8 exactly, as in expand_quad.
void expand_int4_group(const uint8_t* record, uint16_t* rows) {
  const __m512 scale = bf16_as_float(record + kInt4CodeBytes), zero = bf16_as_float(record + kInt4CodeBytes + 32);
  const __m512i nibble = _mm512_set1_epi32(0xF), magic = _mm512_set1_epi32(0x4B000000);
  const __m512 offset = _mm512_set1_ps(8388616.f);
  // Word 2n of a row is column n's even input (lanes 0-15 of cvtne2ps's result), word 2n + 1 its
  // odd one (lanes 16-31).
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int block = 0; block < 4; ++block) {
    const __m512i codes = _mm512_loadu_si512(record + block * kQuadBytes);
    auto weight = [&](unsigned shift) {  // ternary logic 0xEA: (a & b) | c
      const __m512 biased = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(shift_right(codes, shift), nibble, magic, 0xEA));
      return _mm512_fmadd_ps(_mm512_sub_ps(biased, offset), scale, zero);
    };
    for (unsigned half = 0; half < 2; ++half) {      // low nibbles: inputs 4b.., high: 16 + 4b..
      for (unsigned pair = 0; pair < 2; ++pair) {    // bytes (0, 1) and (2, 3)
        const unsigned shift = 16 * pair + 4 * half;
        const __m512bh both = _mm512_cvtne2ps_pbh(weight(shift + 8), weight(shift));
        const int64_t row = 8 * half + 2 * block + pair;
        _mm512_storeu_si512(rows + row * 2 * kTile, _mm512_permutexvar_epi16(interleave, (__m512i)both));
      }
    }
  }
}

void expand_int4_tile(const uint8_t* tile, int64_t groups, uint16_t* expanded) {
  for (int64_t g = 0; g < groups; ++g) expand_int4_group(tile + g * kInt4RecordBytes, expanded + g * kExpandedTile);
}

// A pair of column tiles multiplied together: their indices, and whether the second is there.
struct TilePair {
  int64_t first, second;
  bool two;
};

// One block's products with a pair of column tiles, as multiply_row_block stores them: float32
// [2 r + c][16 rows][16 columns] for row tile r and column tile c; `rows` of them rows of x (0: none).
struct StoredBlock {
  const float (*sums)[kTile * kTile] = nullptr;
  TilePair tiles{};
  int64_t m0 = 0, rows = 0;

  const float* row(int c, int64_t m) const { return sums[2 * (m / kTile) + c] + (m % kTile) * kTile; }
};

// The products of 32 rows of x (`x_stride` bf16 apart, all present) with one or two expanded
// column tiles over `groups` depths, stored into `sums`; meanwhile `finish(pending, r0, r1)` takes
// the previous block's rows a few at a time, so that its vector work (scales, rounding, the MLP's
// SiLU) runs while the tiles multiply instead of between blocks.
// GCC's tile intrinsics are asm without a memory clobber, hence the compiler barriers.
template <typename Finish>
void multiply_row_block(const uint16_t* x, int64_t x_stride, const uint16_t* b0, const uint16_t* b1, bool two,
                        int64_t groups, float (*sums)[kTile * kTile], const StoredBlock& pending,
                        const Finish& finish) {
  const int64_t x_bytes = x_stride * 2;
  const int64_t rows_per_depth = (pending.rows + groups - 1) / groups;
  int64_t finished = 0;
  asm volatile("" ::: "memory");
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(4, x + g * kDepth, x_bytes);
    _tile_loadd(5, x + 16 * x_stride + g * kDepth, x_bytes);
    _tile_loadd(6, b0 + g * kExpandedTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
      _tile_loadd(7, b1 + g * kExpandedTile, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (finished < pending.rows) {
      const int64_t next = std::min(pending.rows, finished + rows_per_depth);
      finish(pending, finished, next);
      finished = next;
    }
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(2, sums[2], 64);
  if (two) {
    _tile_stored(1, sums[1], 64);
    _tile_stored(3, sums[3], 64);
  }
  asm volatile("" ::: "memory");
}
#endif

bool has_prompt_linear() { return amx_bf16_usable(); }

#if defined(KVSERVE_PROMPT_LINEAR)
// What both ops share: per pair of column tiles (`pair_tiles(p)`, p < pairs), takes their B tiles
// (`b_tiles(t, buffer)`: tile t's weights as K / 32 B tiles, expanded into `buffer` or where they
// lie), multiplies every row block of x against them and hands each block's rows to
// `finish(block, r0, r1)`.
template <typename PairTiles, typename BTiles, typename Finish>
void multiply_tile_pairs(const at::Tensor& x, int64_t pairs, const PairTiles& pair_tiles, const BTiles& b_tiles,
                         const Finish& finish) {
  const int64_t rows = x.size(0), k = x.size(1);
  if (rows == 0) return;
  // The tile loads read 16 full rows at a time: the last block of 32 rows, if x ends inside it, is
  // read from a copy padded with zero rows (copying all of x to pad it cost ~8% of a prefill).
  const at::Tensor xs = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t whole_rows = rows / kRowBlock * kRowBlock;
  at::Tensor tail;
  if (whole_rows != rows) {
    tail = at::zeros({kRowBlock, k}, x.options());
    tail.narrow(0, 0, rows - whole_rows).copy_(xs.narrow(0, whole_rows, rows - whole_rows));
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  const int64_t x_stride = xs.stride(0), groups = k / kDepth;
  // Row m0's block of 32 rows, and the stride between its rows.
  auto row_block = [&](int64_t m0) -> std::pair<const uint16_t*, int64_t> {
    if (m0 < whole_rows) return {xp + m0 * x_stride, x_stride};
    return {reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>()), k};
  };
  // Every pair of column tiles reads all the rows of x: in passes of rows that stay in L2 beside the
  // expanded tiles (each pass expands them again): 2048 rows in one pass took ~40% longer a row.
  // The threads claim (pass, pair) one at a time, passes in order (claims.h).
  const int64_t pass_rows = std::max(kRowBlock, kPassBytes / (2 * k) / kRowBlock * kRowBlock);
  const int64_t passes = (rows + pass_rows - 1) / pass_rows;
  parallel_claims(passes * pairs, 1, [&](Claims& claims) {
    load_tile_config();
    std::vector<uint16_t> expanded(2 * groups * kExpandedTile);
    alignas(64) float sums[2][4][kTile * kTile];  // the block multiplying and the one finishing
    StoredBlock pending;
    int64_t begin, end;
    while (claims(begin, end)) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t pass0 = item / pairs * pass_rows, pass_end = std::min(rows, pass0 + pass_rows);
        const TilePair tiles = pair_tiles(item % pairs);
        const uint16_t* b0 = b_tiles(tiles.first, expanded.data());
        const uint16_t* b1 = tiles.two ? b_tiles(tiles.second, expanded.data() + groups * kExpandedTile) : nullptr;
        for (int64_t m0 = pass0; m0 < pass_end; m0 += kRowBlock) {
          const auto [block, block_stride] = row_block(m0);
          float(*stored)[kTile * kTile] = sums[pending.sums == sums[0]];
          multiply_row_block(block, block_stride, b0, b1, tiles.two, groups, stored, pending, finish);
          pending = StoredBlock{stored, tiles, m0, std::min(kRowBlock, rows - m0)};
        }
      }
    }
    finish(pending, 0, pending.rows);
  });
}

// y = x @ W^T (+ bias): column tiles in pairs (2p, 2p + 1); `column_scale(t)`: what tile t's 16
// sums are multiplied by, or nullptr.
template <typename BTiles, typename ColumnScale>
at::Tensor prompt_linear(const at::Tensor& x, int64_t tiles, const at::Tensor& bias_f32, int64_t out_features,
                         const BTiles& b_tiles, const ColumnScale& column_scale) {
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  const float* b = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  auto* y = out.data_ptr<at::BFloat16>();
  auto store_columns = [&](const StoredBlock& block, int64_t r0, int64_t r1) {
    const int64_t pair_col0 = block.tiles.first * kTile;
    if (block.tiles.two && pair_col0 + 2 * kTile <= out_features) {
      // Both tiles whole: a row's 32 outputs in one store. A 32-byte store per tile and row, each
      // from its own conversion, made the kernel 1.05-1.12x as long (docs/executor.md).
      const float *scale0 = column_scale(block.tiles.first), *scale1 = column_scale(block.tiles.second);
      for (int64_t m = r0; m < r1; ++m) {
        Vec16 v0 = load16(block.row(0, m)), v1 = load16(block.row(1, m));
        if (scale0) v0 = v0 * load16(scale0), v1 = v1 * load16(scale1);
        if (b) v0 = v0 + load16(b + pair_col0), v1 = v1 + load16(b + pair_col0 + kTile);
        store_rounded_pair(y + (block.m0 + m) * out_features + pair_col0, round_bf16(v0), round_bf16(v1));
      }
      return;
    }
    for (int c = 0; c < 1 + block.tiles.two; ++c) {
      const int64_t t = c ? block.tiles.second : block.tiles.first, col0 = t * kTile;
      const int64_t cols = std::min(kTile, out_features - col0);
      const float* scale = column_scale(t);
      for (int64_t m = r0; m < r1; ++m) {
        const float* sum = block.row(c, m);
        at::BFloat16* dst = y + (block.m0 + m) * out_features + col0;
        if (cols == kTile) {
          const Vec16 v = scale ? load16(sum) * load16(scale) : load16(sum);
          store16(dst, b ? v + load16(b + col0) : v);
        } else {
          for (int64_t j = 0; j < cols; ++j) {
            dst[j] = static_cast<at::BFloat16>(sum[j] * (scale ? scale[j] : 1.f) + (b ? b[col0 + j] : 0.f));
          }
        }
      }
    }
  };
  multiply_tile_pairs(
      x, (tiles + 1) / 2, [&](int64_t p) { return TilePair{2 * p, 2 * p + 1, 2 * p + 1 < tiles}; }, b_tiles,
      store_columns);
  return out;
}

// silu(gate) * up of y = x @ W^T (+ bias), W's first half of rows gate, its second up: the gate
// tile p paired with up tile p + tiles / 2. Each output rounds as silu_and_mul after
// prompt_linear would: gate and up to bf16, silu(gate) to bf16, their product to bf16; but y is
// never written (the separate ops wrote [rows, 2 x intermediate] and read it back).
template <typename BTiles, typename ColumnScale>
at::Tensor prompt_silu_and_mul(const at::Tensor& x, int64_t tiles, const at::Tensor& bias_f32, const BTiles& b_tiles,
                               const ColumnScale& column_scale) {
  const int64_t half = tiles / 2, intermediate = half * kTile;
  at::Tensor out = at::empty({x.size(0), intermediate}, x.options());
  const float* b = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  auto* y = out.data_ptr<at::BFloat16>();
  auto activate = [&](const StoredBlock& block, int64_t r0, int64_t r1) {
    const float *gate_scale = column_scale(block.tiles.first), *up_scale = column_scale(block.tiles.second);
    const int64_t col0 = block.tiles.first * kTile;
    for (int64_t m = r0; m < r1; ++m) {
      Vec16 gate = load16(block.row(0, m)), up = load16(block.row(1, m));
      if (gate_scale) gate = gate * load16(gate_scale), up = up * load16(up_scale);
      if (b) gate = gate + load16(b + col0), up = up + load16(b + intermediate + col0);
      store16(y + (block.m0 + m) * intermediate + col0, round_bf16(silu(round_bf16(gate))) * round_bf16(up));
    }
  };
  multiply_tile_pairs(
      x, half, [&](int64_t p) { return TilePair{p, p + half, true}; }, b_tiles, activate);
  return out;
}
#endif

void check_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(has_prompt_linear(), op, ": needs AMX bf16 tiles, which this CPU or build lacks");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, op, ": x must be [rows, in_features] bfloat16");
  TORCH_CHECK(x.size(1) % kDepth == 0, op, ": in_features must be a multiple of ", kDepth);
}

// The packed bf16 weight's tile count (pack_skinny_weight's layout), checked against x.
int64_t checked_bf16_tiles(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  check_x(op, x);
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kTile && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              op, ": packed must come from pack_skinny_weight");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1), op, ": x has ", x.size(1), " features, the weight ", packed.size(1) * 2);
  return packed.size(0);
}

// The packed int8 weight's tile count, checked against x; refuses where there are no tiles.
int64_t checked_int8_tiles(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  check_x(op, x);
  const int64_t k = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(), op,
              ": packed must come from pack_skinny_int8");
  TORCH_CHECK(packed.size(1) == k * kTile + kTile * 4, op, ": x has ", k, " features, the weight ",
              (packed.size(1) - kTile * 4) / kTile);
  return packed.size(0);
}

int64_t checked_int4_tiles(const char* op, const at::Tensor& x, const at::Tensor& packed) {
  check_x(op, x);
  const int64_t k = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kInt4RecordBytes && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte,
              op, ": packed must come from pack_skinny_int4");
  TORCH_CHECK(packed.size(1) * kDepth == k, op, ": x has ", k, " features, the weight ", packed.size(1) * kDepth);
  return packed.size(0);
}

// Refuses a gate_up weight whose gate and up halves do not each fill whole tiles.
void check_gate_up(const char* op, int64_t tiles, int64_t intermediate) {
  TORCH_CHECK(intermediate % kTile == 0 && tiles * kTile == 2 * intermediate, op, ": the packed weight has ",
              tiles * kTile, " outputs, not 2 x intermediate ", intermediate, " (a multiple of ", kTile, ")");
}

enum class Format { kBf16, kInt8, kInt4 };

// Checks x and the packed weight (in `format`'s layout) and returns `body(tiles, b_tiles,
// column_scale)` with that layout's B tiles and per-column scales (int8 only). pack_skinny_weight's
// bf16 layout, [tiles][K / 2][16][2], is already K / 32 B tiles per tile: they are read in place.
template <typename Body>
at::Tensor with_weight(const char* op, Format format, const at::Tensor& x, const at::Tensor& packed, const Body& body) {
  const int64_t tiles = format == Format::kBf16   ? checked_bf16_tiles(op, x, packed)
                        : format == Format::kInt8 ? checked_int8_tiles(op, x, packed)
                                                  : checked_int4_tiles(op, x, packed);
#if defined(KVSERVE_PROMPT_LINEAR)
  const auto* w = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const int64_t k = x.size(1), groups = k / kDepth;
  auto no_scale = [](int64_t) -> const float* { return nullptr; };
  if (format == Format::kBf16) {
    const auto* bf16 = reinterpret_cast<const uint16_t*>(w);
    return body(tiles, [=](int64_t t, uint16_t*) { return bf16 + t * k * kTile; }, no_scale);
  }
  if (format == Format::kInt8) {
    const int64_t tile_bytes = packed.size(1);
    return body(
        tiles,
        [=](int64_t t, uint16_t* expanded) {
          expand_int8_tile(w + t * tile_bytes, groups, expanded);
          return static_cast<const uint16_t*>(expanded);
        },
        [=](int64_t t) { return reinterpret_cast<const float*>(w + t * tile_bytes + k * kTile); });
  }
  const int64_t tile_bytes = packed.size(1) * kInt4RecordBytes;
  return body(
      tiles,
      [=](int64_t t, uint16_t* expanded) {
        expand_int4_tile(w + t * tile_bytes, groups, expanded);
        return static_cast<const uint16_t*>(expanded);
      },
      no_scale);
#else
  (void)tiles, (void)body;
  return {};  // check_x refused: no tiles in this build
#endif
}

at::Tensor linear_op(const char* op, Format format, const at::Tensor& x, const at::Tensor& packed,
                     const c10::optional<at::Tensor>& bias, int64_t out_features) {
  return with_weight(op, format, x, packed, [&](int64_t tiles, const auto& b_tiles, const auto& column_scale) {
    const at::Tensor bias_f32 = checked_bias_f32(op, tiles, kTile, out_features, bias);
#if defined(KVSERVE_PROMPT_LINEAR)
    return prompt_linear(x, tiles, bias_f32, out_features, b_tiles, column_scale);
#else
    return at::Tensor();
#endif
  });
}

at::Tensor silu_and_mul_op(const char* op, Format format, const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias, int64_t intermediate) {
  return with_weight(op, format, x, packed, [&](int64_t tiles, const auto& b_tiles, const auto& column_scale) {
    check_gate_up(op, tiles, intermediate);
    const at::Tensor bias_f32 = checked_bias_f32(op, tiles, kTile, 2 * intermediate, bias);
#if defined(KVSERVE_PROMPT_LINEAR)
    return prompt_silu_and_mul(x, tiles, bias_f32, b_tiles, column_scale);
#else
    return at::Tensor();
#endif
  });
}

at::Tensor prompt_linear_int8(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t out_features) {
  return linear_op("prompt_linear_int8", Format::kInt8, x, packed, bias, out_features);
}

at::Tensor prompt_linear_int4(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t out_features) {
  return linear_op("prompt_linear_int4", Format::kInt4, x, packed, bias, out_features);
}

at::Tensor prompt_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t out_features) {
  return linear_op("prompt_linear_bf16", Format::kBf16, x, packed, bias, out_features);
}

at::Tensor prompt_silu_and_mul_bf16(const at::Tensor& x, const at::Tensor& packed,
                                    const c10::optional<at::Tensor>& bias, int64_t intermediate) {
  return silu_and_mul_op("prompt_silu_and_mul_bf16", Format::kBf16, x, packed, bias, intermediate);
}

at::Tensor prompt_silu_and_mul_int8(const at::Tensor& x, const at::Tensor& packed,
                                    const c10::optional<at::Tensor>& bias, int64_t intermediate) {
  return silu_and_mul_op("prompt_silu_and_mul_int8", Format::kInt8, x, packed, bias, intermediate);
}

at::Tensor prompt_silu_and_mul_int4(const at::Tensor& x, const at::Tensor& packed,
                                    const c10::optional<at::Tensor>& bias, int64_t intermediate) {
  return silu_and_mul_op("prompt_silu_and_mul_int4", Format::kInt4, x, packed, bias, intermediate);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("has_prompt_linear", &has_prompt_linear);
  m.def("prompt_linear_int8(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("prompt_linear_int4(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("prompt_linear_bf16(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("prompt_silu_and_mul_bf16(Tensor x, Tensor packed, Tensor? bias, int intermediate) -> Tensor");
  m.def("prompt_silu_and_mul_int8(Tensor x, Tensor packed, Tensor? bias, int intermediate) -> Tensor");
  m.def("prompt_silu_and_mul_int4(Tensor x, Tensor packed, Tensor? bias, int intermediate) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("prompt_linear_int8", &prompt_linear_int8);
  m.impl("prompt_linear_int4", &prompt_linear_int4);
  m.impl("prompt_linear_bf16", &prompt_linear_bf16);
  m.impl("prompt_silu_and_mul_bf16", &prompt_silu_and_mul_bf16);
  m.impl("prompt_silu_and_mul_int8", &prompt_silu_and_mul_int8);
  m.impl("prompt_silu_and_mul_int4", &prompt_silu_and_mul_int4);
}
