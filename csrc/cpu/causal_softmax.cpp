// The softmax of a prefill chunk's attention scores under its causal mask, in place, on the CPU.
//
// The cpu backend's prefill attention (executor/attention/cpu_backend.py) is two oneDNN GEMMs with
// a softmax between them. In torch that softmax is an additive mask materialized per step, an add
// and a bf16 softmax: three passes over [rows, ctx_len] scores, at a 512-token chunk ~3 ms a layer
// against ~1.2 ms for both GEMMs. Here one pass per row reads the scores it needs: the mask is two
// numbers per sequence (where its first query sits, how many keys it has), so row i of a sequence
// attends to keys [0, min(first + i + 1, seq_len)) and the rest of the row becomes 0.
//
// Registered as torch.ops.kvserve_cpu.causal_softmax_.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec16.h"

namespace {

using namespace kvserve_cpu;

// row[0..keys) softmaxed in float32, row[keys..ctx_len) zeroed; `buffer` holds the row in float32,
// padded to whole vectors with -inf (whose exp, ~1e-38, is below any sum's last bit).
template <typename T>
void softmax_row(T* row, int64_t keys, int64_t ctx_len, std::vector<float>& buffer) {
  const int64_t padded = (keys + kLanes - 1) / kLanes * kLanes;
  buffer.resize(static_cast<size_t>(padded));
  float* x = buffer.data();
  const int64_t whole = keys / kLanes * kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) store16(x + i, load16(row + i));
  for (int64_t i = whole; i < keys; ++i) x[i] = static_cast<float>(row[i]);
  std::fill(x + keys, x + padded, -std::numeric_limits<float>::infinity());
  const Vec16 inv = splat(softmax_numerators(x, padded));
  for (int64_t i = 0; i < whole; i += kLanes) store16(row + i, load16(x + i) * inv);
  for (int64_t i = whole; i < keys; ++i) row[i] = static_cast<T>(x[i] * inv[0]);
  std::fill(row + keys, row + ctx_len, static_cast<T>(0.f));
}

// scores: [num_seqs, kv_heads, rows, ctx_len], rows = group * query_len (query heads of a KV head,
//   each query_len rows: row r is query token r % query_len); first_query_pos, seq_lens: [num_seqs]
//   int32, the position of each sequence's first query token and its keys in all.
// Row r of sequence s attends to keys [0, min(first_query_pos[s] + r % query_len + 1, seq_lens[s])).
at::Tensor& causal_softmax_(at::Tensor& scores, const at::Tensor& first_query_pos, const at::Tensor& seq_lens,
                            int64_t query_len) {
  TORCH_CHECK(scores.device().is_cpu() && scores.dim() == 4 && scores.is_contiguous(),
              "causal_softmax_: scores must be a contiguous CPU tensor [seqs, kv_heads, rows, ctx_len]");
  const int64_t num_seqs = scores.size(0), heads = scores.size(1), rows = scores.size(2), ctx_len = scores.size(3);
  TORCH_CHECK(query_len > 0 && rows % query_len == 0, "causal_softmax_: rows (", rows,
              ") must be a multiple of query_len (", query_len, ")");
  TORCH_CHECK(first_query_pos.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  first_query_pos.numel() == num_seqs && seq_lens.numel() == num_seqs,
              "causal_softmax_: first_query_pos and seq_lens must be int32, one per sequence");
  const auto first = first_query_pos.contiguous();
  const auto lens = seq_lens.contiguous();
  const int32_t* first_ptr = first.data_ptr<int32_t>();
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens_ptr[s] > 0 && lens_ptr[s] <= ctx_len && first_ptr[s] >= 0 && first_ptr[s] < lens_ptr[s],
                "causal_softmax_: sequence ", s, " has seq_len ", lens_ptr[s], " and first query at ", first_ptr[s],
                " for ", ctx_len, " score columns");
  }
  dispatch_float_types(scores.scalar_type(), "causal_softmax_", [&](auto scalar) {
    using T = decltype(scalar);
    T* base = scores.data_ptr<T>();
    at::parallel_for(0, num_seqs * heads * rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> buffer;
      for (int64_t index = begin; index < end; ++index) {
        const int64_t s = index / (heads * rows), r = index % rows;
        const int64_t keys = std::min<int64_t>(first_ptr[s] + r % query_len + 1, lens_ptr[s]);
        softmax_row(base + index * ctx_len, keys, ctx_len, buffer);
      }
    });
  });
  return scores;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("causal_softmax_(Tensor(a!) scores, Tensor first_query_pos, Tensor seq_lens, int query_len) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("causal_softmax_", &causal_softmax_); }
