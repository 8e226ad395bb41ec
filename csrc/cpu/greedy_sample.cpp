// Greedy pick and its logprob for each row of the logits, in one pass per row.
//
// The torch version, argmax plus log_softmax (or logsumexp) over [rows, vocab], reads the
// logits three to four times and writes a [rows, vocab] result; at batch 32 x 49152 it
// was 4% of a decode step. Here each row is read twice (max, then sum of exp) and nothing
// [rows, vocab] is written.
//
// Registered as torch.ops.kvserve_cpu.greedy_sample.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

#include "avx2_lanes.h"
#include "vec16.h"

namespace {

using namespace kvserve_cpu;

// The first index of the row's maximum (what torch.argmax returns) and log p of it; T is float
// or bf16 (taken as its exact float value: the same pick and logprob as on the widened row).
#if defined(KVSERVE_AVX2_LANES)
// The generic form below, over Vec16, took its select-based maximum lane by lane through the stack
// on AVX2 (as softmax_numerators' did, vec16.h): 32 x 49152 logits in 2.0 ms on two cores. The
// same values in the same order: lane i of 16 takes elements i, i + 16, ...; the lanes' sums are
// added 0 to 15, then the tail's.
template <typename T>
std::pair<int64_t, float> greedy_row(const T* row, int64_t vocab) {
  const int64_t vector_end = vocab - vocab % kLanes;
  Lanes16 vmax = {_mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                  _mm256_set1_ps(-std::numeric_limits<float>::infinity())};
  for (int64_t i = 0; i < vector_end; i += kLanes) {
    const Lanes16 x = load_lanes(row + i);
    vmax = {_mm256_max_ps(vmax.lo, x.lo), _mm256_max_ps(vmax.hi, x.hi)};
  }
  float best = max_of_lanes8(_mm256_max_ps(vmax.lo, vmax.hi));
  for (int64_t i = vector_end; i < vocab; ++i) best = std::max(best, static_cast<float>(row[i]));
  const __m256 m = _mm256_set1_ps(best);
  int64_t index = vocab;
  for (int64_t i = 0; i < vector_end && index == vocab; i += kLanes) {
    const Lanes16 x = load_lanes(row + i);
    const uint32_t hits = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x.lo, m, _CMP_EQ_OQ))) |
                          static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(x.hi, m, _CMP_EQ_OQ))) << 8;
    if (hits != 0) index = i + __builtin_ctz(hits);
  }
  for (int64_t i = vector_end; i < vocab && index == vocab; ++i) {
    if (static_cast<float>(row[i]) == best) index = i;
  }
  Lanes16 vsum = zero_lanes();
  for (int64_t i = 0; i < vector_end; i += kLanes) {
    const Lanes16 x = load_lanes(row + i);
    vsum = add_lanes(vsum, {exp_nonpositive8(_mm256_sub_ps(x.lo, m)), exp_nonpositive8(_mm256_sub_ps(x.hi, m))});
  }
  float sum = sum_in_lane_order(vsum);
  for (int64_t i = vector_end; i < vocab; ++i) sum += std::exp(static_cast<float>(row[i]) - best);
  return {index, -std::log(sum)};
}
#else
// The first i < vector_end (a multiple of kLanes) with row[i] == value, else vector_end. Scanned
// element by element, the search took 0.4-1.1 ms of a 32 x 49152 pick on two AMX Xeon cores (the
// maximum at the front / in the middle / at the end), the pick itself 0.4.
template <typename T>
int64_t first_equal(const T* row, int64_t vector_end, float value) {
  for (int64_t i = 0; i < vector_end; i += kLanes) {
    const Vec16 x = load16(row + i);
#if defined(__AVX512F__)
    __m512 lanes;
    std::memcpy(&lanes, &x, sizeof(lanes));
    const uint32_t hits = _mm512_cmp_ps_mask(lanes, _mm512_set1_ps(value), _CMP_EQ_OQ);
    if (hits != 0) return i + __builtin_ctz(hits);
#else
    if (reduce_max_any_order(x == value ? splat(1.f) : splat(0.f)) != 0.f) {
      for (int64_t j = 0; j < kLanes; ++j) {
        if (x[j] == value) return i + j;
      }
    }
#endif
  }
  return vector_end;
}

template <typename T>
std::pair<int64_t, float> greedy_row(const T* row, int64_t vocab) {
  const int64_t vector_end = vocab - vocab % kLanes;
  Vec16 vmax = splat(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < vector_end; i += kLanes) {
    const Vec16 x = load16(row + i);
    vmax = vmax > x ? vmax : x;
  }
  float best = reduce_max(vmax);
  for (int64_t i = vector_end; i < vocab; ++i) best = std::max(best, static_cast<float>(row[i]));
  int64_t index = first_equal(row, vector_end, best);
  while (index < vocab && static_cast<float>(row[index]) != best) ++index;
  Vec16 vsum{};
  for (int64_t i = 0; i < vector_end; i += kLanes) vsum += exp_nonpositive(load16(row + i) - best);
  float sum = reduce_sum(vsum);
  for (int64_t i = vector_end; i < vocab; ++i) sum += std::exp(static_cast<float>(row[i]) - best);
  return {index, -std::log(sum)};
}
#endif

// logits: [rows, vocab] float32 or bfloat16 → (token_ids [rows] int64, logprobs [rows] float32)
std::tuple<at::Tensor, at::Tensor> greedy_sample(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                  logits.device().is_cpu(),
              "greedy_sample: float32 or bfloat16 CPU logits [rows, vocab]");
  TORCH_CHECK(logits.size(1) > 0, "greedy_sample: empty vocabulary");
  const auto x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto token_ids = at::empty({rows}, x.options().dtype(at::kLong));
  auto logprobs = at::empty({rows}, x.options().dtype(at::kFloat));
  int64_t* ids = token_ids.data_ptr<int64_t>();
  float* lps = logprobs.data_ptr<float>();
  auto pick_rows = [&](const auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const auto [index, logprob] = greedy_row(data + r * vocab, vocab);
        ids[r] = index;
        lps[r] = logprob;
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    pick_rows(x.data_ptr<float>());
  } else {
    pick_rows(reinterpret_cast<const c10::BFloat16*>(x.data_ptr<at::BFloat16>()));
  }
  return {token_ids, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) { m.def("greedy_sample(Tensor logits) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) { m.impl("greedy_sample", &greedy_sample); }
