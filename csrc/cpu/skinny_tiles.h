// What the few-row matmul kernels share (skinny_linear.cpp: bf16; skinny_quantized.cpp: int8 and
// int4; skinny_linear_f32.cpp: bf16 weights, float32 activations): the loop over blocks of weight
// tiles and chunks of rows (run_tiles), and where its kernels prefetch the weights (Prefetcher).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "packed_layout.h"
#include "vec16.h"

namespace kvserve_cpu {

constexpr int kMaxChunkRows = 8;  // rows of x sharing each weight load

// Where a kernel's software prefetches go: the kernel calls it with each weight line it reads, and it
// asks for a line to come.
//
// The weights are one sequential stream, but the hardware prefetcher stops at every 4 KiB page and
// ramps up again. With the rows in one chunk, each line read asks for the line kPrefetchLines
// further on (one core streamed a decode step's bf16 weights at ~10 GB/s without, ~14 with;
// docs/executor.md). With more rows, the chunks take turns over a block of tiles: the first would
// read it from memory, bound by it, and the others from cache, compute-bound while memory idles.
// There each chunk asks instead for its share of the next block's lines (its rows' share), spread
// evenly over its reads, so that the stream runs through every chunk: on the Zen 4 box a decode
// step's bf16 matmuls at 12-40 rows take 11-19 % less time, the int8 ones at 16-40 rows 7-14 %
// (docs/executor.md).
constexpr int64_t kPrefetchLines = 64;

class Prefetcher {
 public:
  // Rows in one chunk: kPrefetchLines ahead of each line read.
  static Prefetcher ahead(const void* block) {
    const char* start = static_cast<const char*>(block);
    return Prefetcher(start, start + kPrefetchLines * 64, kOneToOne);
  }
  // Rows [m0, m0 + chunk) of `rows` over the block of `bytes` at `block`: the same share of the
  // next block's lines, in step with the chunk's reads.
  static Prefetcher next_block_share(const void* block, int64_t bytes, int64_t m0, int64_t chunk, int64_t rows) {
    const char* start = static_cast<const char*>(block);
    return Prefetcher(start, start + bytes + bytes / 64 * m0 / rows * 64, (chunk << 16) / rows);
  }

  // The line that reading `read` asks for.
  const char* target_of(const void* read) const {
    const int64_t line = (static_cast<const char*>(read) - block_) >> 6;
    return target_ + (((line * scale_) >> 16) << 6);
  }

  void operator()(const void* read) const { __builtin_prefetch(target_of(read), 0, 3); }

  // What reading `count` consecutive lines from `read` asks for. Under ahead() their targets are
  // consecutive too, and follow from the first one: each line's own, computed, was 10-19 % of a
  // 16-32 row AMX matmul whose weights are in cache (the AMX Xeon).
  void lines(const void* read, int count) const {
    const char* first = target_of(read);
    for (int line = 0; line < count; ++line) {
      __builtin_prefetch(scale_ == kOneToOne ? first + line * 64
                                             : target_of(static_cast<const char*>(read) + line * 64), 0, 3);
    }
  }

 private:
  static constexpr int64_t kOneToOne = 1 << 16;  // scale_: line i asks for target line i

  Prefetcher(const char* block, const char* target, int64_t scale) : block_(block), target_(target), scale_(scale) {}

  const char* block_;   // the block the kernel reads
  const char* target_;  // what line 0 of the block asks for
  int64_t scale_;       // line i asks for target line i * scale / 65536
};

// The 32 bits at p: a pair of bf16 inputs, or four int8 ones, to broadcast.
inline int32_t load_32_bits(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename Instance, size_t... I>
constexpr auto instances_for(Instance instance, std::index_sequence<I...>) {
  return std::array{instance(std::integral_constant<int, static_cast<int>(I) + 1>{})...};
}

// {kernel<1>, ..., kernel<N>}, with `instance(std::integral_constant<int, R>)` giving &kernel<R>:
// table[r - 1] handles a chunk of r rows.
template <int N, typename Instance>
constexpr auto per_row_count(Instance instance) {
  return instances_for(instance, std::make_index_sequence<N>{});
}

struct NoThreadSetup {
  void operator()() const {}
};

// How the chunks prefetch where x's rows take several: each its share of the next block, or each
// 4 KiB ahead as a lone chunk does (kAhead: the int4 kernels, 1-5 % slower at 16-48 rows with the
// shares on the Zen 4 box, and the AMX ones, not measured with them).
enum class PrefetchPolicy { kNextBlockShare, kAhead };

// How rows fall into chunks: ChunkRows each and the rest last (32 rows of 6: five of 6, one of 2), or
// as evenly as that many chunks allow (6, 6, 5, 5, 5, 5: kEven). A chunk keeps one FMA chain per
// accumulator, so one of few rows waits on its chains' latency: in the AVX2 float32 kernel a chunk
// of 2 rows took 0.7x the time of one of 6. The AMX paths rely on full tiles first (their tail takes
// the VNNI kernel).
enum class ChunkSplit { kFullFirst, kEven };

// How a panel of `rows` rows of x falls into chunks of at most ChunkRows.
template <int ChunkRows, ChunkSplit Split>
struct PanelChunks {
  int64_t rows, even_rows, larger_end;  // kEven: the chunks below row larger_end take one row more
  explicit PanelChunks(int64_t panel_rows) : rows(panel_rows) {
    const int64_t chunks = (rows + ChunkRows - 1) / ChunkRows;
    even_rows = rows / chunks;
    larger_end = rows % chunks * (even_rows + 1);
  }
  // The rows of the chunk that starts m rows into the panel.
  int64_t chunk_at(int64_t m) const {
    if constexpr (Split == ChunkSplit::kEven) return even_rows + (m < larger_end ? 1 : 0);
    return std::min<int64_t>(ChunkRows, rows - m);
  }
};
// run_tiles' panel_rows for `rows` rows of x of `row_bytes` each: all rows in one panel below
// `from_bytes` of x, else panels of at most `panel_bytes`, as even as they go, of at least `min_rows`.
inline int64_t rows_per_panel(int64_t rows, int64_t row_bytes, int64_t panel_bytes, int64_t from_bytes,
                              int64_t min_rows) {
  const int64_t bytes = rows * row_bytes;
  if (bytes < from_bytes) return rows;
  const int64_t panels = (bytes + panel_bytes - 1) / panel_bytes;
  return std::max(min_rows, (rows + panels - 1) / panels);
}
// Checks x and bias, and runs `tile_chunk(t, count, m0, chunk, acc, prefetch)` — acc[j][m][16] = the
// dot products of rows m0..m0+chunk (chunk <= ChunkRows) of x with the 16 weight rows of tile t + j,
// j < count (BlockTiles, fewer in the last block), `prefetch` told of each weight line read — over
// every block of tiles and chunk of rows, then adds the bias and stores in x's dtype (bfloat16, or
// float32: skinny_linear_f32, and the quantized kernels on a CPU without native bf16). `weights`:
// the packed tiles, `tile_bytes` apart (a multiple of 64); `thread_setup` runs on each thread before
// its first chunk. `panel_rows` > 0: a thread takes its blocks over rows [0, panel_rows) first, then
// the next panel of rows (each panel's rows split into chunks as above), so that a panel of x stays
// in cache while every tile passes over it; a chunk at a multiple of panel_rows is its tile's first
// in the panel.
template <int ChunkRows = kMaxChunkRows, int BlockTiles = 1, PrefetchPolicy Policy = PrefetchPolicy::kNextBlockShare,
          ChunkSplit Split = ChunkSplit::kFullFirst, typename TileChunk, typename ThreadSetup = NoThreadSetup>
at::Tensor run_tiles(const char* op, const at::Tensor& x, const void* weights, int64_t tiles, int64_t tile_bytes,
                     const c10::optional<at::Tensor>& bias, int64_t out_features, const TileChunk& tile_chunk,
                     const ThreadSetup& thread_setup = {}, int64_t panel_rows = 0) {
  const at::Tensor bias_f32 = checked_bias_f32(op, tiles, kTile, out_features, bias);
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const float* b = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  if (panel_rows <= 0) panel_rows = rows;
  const auto store_all = [&](auto* y) {
    using Out = std::remove_pointer_t<decltype(y)>;
    // acc's rows [0, chunk) of the tiles t0 .. t0 + count as rows m0.. of y, with the bias.
    const auto store_chunk = [&](const float* acc, int64_t t0, int64_t count, int64_t m0, int64_t chunk) {
      if constexpr (std::is_same_v<Out, at::BFloat16>) {
        if (count == 2 && (t0 + 2) * kTile <= out_features) {  // a row's 32 outputs in one store
          const int64_t col0 = t0 * kTile;
          const Vec16 bias0 = b ? load16(b + col0) : Vec16{}, bias1 = b ? load16(b + col0 + kTile) : Vec16{};
          for (int64_t m = 0; m < chunk; ++m) {
            store_rounded_pair(y + (m0 + m) * out_features + col0, round_bf16(load16(acc + m * kTile) + bias0),
                               round_bf16(load16(acc + (chunk + m) * kTile) + bias1));
          }
          return;
        }
      }
      for (int64_t j = 0; j < count; ++j) {
        const int64_t col0 = (t0 + j) * kTile, cols = std::min(kTile, out_features - col0);
        const Vec16 bias_v = b ? (cols == kTile ? load16(b + col0) : Vec16{}) : Vec16{};
        const float* tile_acc = acc + j * chunk * kTile;
        for (int64_t m = 0; m < chunk; ++m) {
          Out* dst = y + (m0 + m) * out_features + col0;
          if (cols == kTile) {
            store16(dst, load16(tile_acc + m * kTile) + bias_v);
          } else {
            for (int64_t i = 0; i < cols; ++i) dst[i] = static_cast<Out>(tile_acc[m * kTile + i] + (b ? b[col0 + i] : 0.f));
          }
        }
      }
    };
    // A thread's share: enough blocks to be worth the wake-up (~64 KiB of weights).
    const int64_t blocks = (tiles + BlockTiles - 1) / BlockTiles;
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(tile_bytes * BlockTiles, 1));
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      thread_setup();
      alignas(64) float acc[BlockTiles * ChunkRows * kTile];
      for (int64_t p0 = 0; p0 < rows; p0 += panel_rows) {
        const PanelChunks<ChunkRows, Split> panel(std::min(panel_rows, rows - p0));
        const bool share = Policy == PrefetchPolicy::kNextBlockShare && panel.rows > ChunkRows;
        for (int64_t block = begin; block < end; ++block) {
          const int64_t t0 = block * BlockTiles, count = std::min<int64_t>(BlockTiles, tiles - t0);
          const char* block_weights = static_cast<const char*>(weights) + t0 * tile_bytes;
          for (int64_t m = 0, chunk = 0; m < panel.rows; m += chunk) {
            chunk = panel.chunk_at(m);
            const Prefetcher prefetch =
                share ? Prefetcher::next_block_share(block_weights, count * tile_bytes, m, chunk, panel.rows)
                      : Prefetcher::ahead(block_weights);
            tile_chunk(t0, count, p0 + m, chunk, acc, prefetch);
            store_chunk(acc, t0, count, p0 + m, chunk);
          }
        }
      }
    });
  };
  if (out.scalar_type() == at::kFloat) {
    store_all(out.data_ptr<float>());
  } else {
    store_all(out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace kvserve_cpu
