// The elementwise work between a decoder layer's matmuls, one pass each, on the CPU.
//
// In torch, RMSNorm is six kernels (float, pow, mean, add + rsqrt, mul, cast, weight mul),
// the residual add one more, RoPE six (slice, neg, cat, two muls, add) and SiLU·mul two;
// ~35 dispatches a layer, each a few microseconds of overhead on a one-token decode step
// (a fifth of a batch-1 step of a small model) and a full read and write of its tensor at
// batch. Each op here reads its inputs once and writes its outputs once.
//
// Rounding follows the torch ops they replace: RMSNorm in float32, rounded to the
// dtype before the weight multiply (as transformers does); RoPE's two products each
// rounded before their sum; SiLU rounded before the multiply by `up`.
//
// Registered as torch.ops.kvserve_cpu.{rms_norm, add_rms_norm, rotary_embedding_, silu_and_mul}.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "avx2_lanes.h"
#include "vec16.h"

namespace {

using namespace kvserve_cpu;

// Loads and stores of the first n (<= 16) lanes; the whole vector when n == 16.
template <typename T>
inline Vec16 load_n(const T* p, int64_t n) {
  if (n == kLanes) return load16(p);
  float tmp[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}

template <typename T>
inline void store_n(T* p, Vec16 v, int64_t n) {
  if (n == kLanes) return store16(p, v);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(v[i]);
}

// Rows of `width` elements handed to each thread: enough work to be worth a wake-up.
inline int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// out = weight * T(x * rsqrt(mean(x^2) + eps)) for one row of x (float).
template <typename T>
inline void normalize_row(const float* x, const T* weight, float eps, int64_t width, T* out) {
  Vec16 vsq{};
  for (int64_t i = 0; i < width; i += kLanes) {
    const Vec16 v = load_n(x + i, std::min(kLanes, width - i));
    vsq += v * v;
  }
  const float inv_rms = 1.f / std::sqrt(reduce_sum(vsq) / static_cast<float>(width) + eps);
  for (int64_t i = 0; i < width; i += kLanes) {
    const int64_t n = std::min(kLanes, width - i);
    store_n(out + i, load_n(weight + i, n) * round16(load_n(x + i, n) * inv_rms, out), n);
  }
}

#if defined(KVSERVE_AVX2_LANES)
// normalize_row for float32 rows whose width is a multiple of 16, 8 lanes a register: the Vec16 form
// moved each 16-lane value through the stack in 128-bit halves on AVX2 (1 us a 576-wide row on one
// thread of the AVX2 EPYC). The same operations in the same order, so the same bits: lane i of 16
// sums the squares of elements i, i + 16, ... (an FMA each, as GCC contracts the Vec16 form), the
// lanes are added 0 to 15.
inline bool normalize_row_lanes(const float* x, const float* weight, float eps, int64_t width, float* out) {
  if (width % kLanes != 0) return false;
  Lanes16 squares = zero_lanes();
  for (int64_t i = 0; i < width; i += kLanes) {
    const Lanes16 v = load_lanes(x + i);
    squares = {_mm256_fmadd_ps(v.lo, v.lo, squares.lo), _mm256_fmadd_ps(v.hi, v.hi, squares.hi)};
  }
  const float sum = sum_in_lane_order(squares);
  const __m256 inv_rms = _mm256_set1_ps(1.f / std::sqrt(sum / static_cast<float>(width) + eps));
  for (int64_t i = 0; i < width; i += 8) {
    const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(x + i), inv_rms);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), scaled));
  }
  return true;
}

// residual_out = x + residual, then its norm, for a float32 row (the same bits as the Vec16 form).
inline bool add_rms_norm_row_lanes(const float* x, const float* residual, const float* weight, float eps,
                                   int64_t width, float* normed, float* residual_out) {
  if (width % kLanes != 0) return false;
  for (int64_t i = 0; i < width; i += 8) {
    _mm256_storeu_ps(residual_out + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(residual + i)));
  }
  return normalize_row_lanes(residual_out, weight, eps, width, normed);
}
#endif

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x is [tokens, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), op,
              ": weight is [hidden] like x's rows");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": x and weight share a dtype");
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, float eps, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1), stride = x.stride(0);
  const T* x_ptr = x.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> row;  // sized where a row takes the generic form: the 8-lane form needs none
    for (int64_t r = begin; r < end; ++r) {
#if defined(KVSERVE_AVX2_LANES)
      if constexpr (std::is_same_v<T, float>) {
        if (normalize_row_lanes(x_ptr + r * stride, w_ptr, eps, width, o_ptr + r * width)) continue;
      }
#endif
      row.resize(width);
      for (int64_t i = 0; i < width; i += kLanes) {
        const int64_t n = std::min(kLanes, width - i);
        store_n(row.data() + i, load_n(x_ptr + r * stride + i, n), n);
      }
      normalize_row<T>(row.data(), w_ptr, eps, width, o_ptr + r * width);
    }
  });
}

// residual_out = T(x + residual); normed = rms_norm(residual_out): the sum every layer
// makes twice, and the norm that always follows it.
template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, float eps,
                       at::Tensor& normed, at::Tensor& residual_out) {
  const int64_t rows = x.size(0), width = x.size(1), x_stride = x.stride(0), r_stride = residual.stride(0);
  const T* x_ptr = x.data_ptr<T>();
  const T* r_ptr = residual.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  T* n_ptr = normed.data_ptr<T>();
  T* s_ptr = residual_out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> row;  // as in rms_norm_impl
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x_ptr + r * x_stride;
      const T* rr = r_ptr + r * r_stride;
      T* sr = s_ptr + r * width;
#if defined(KVSERVE_AVX2_LANES)
      if constexpr (std::is_same_v<T, float>) {
        if (add_rms_norm_row_lanes(xr, rr, w_ptr, eps, width, n_ptr + r * width, sr)) continue;
      }
#endif
      row.resize(width);
      for (int64_t i = 0; i < width; i += kLanes) {
        const int64_t n = std::min(kLanes, width - i);
        const Vec16 sum = round16(load_n(xr + i, n) + load_n(rr + i, n), sr);
        if (n == kLanes) {
          store_rounded16(sr + i, sum);
        } else {
          store_n(sr + i, sum, n);
        }
        store_n(row.data() + i, sum, n);
      }
      normalize_row<T>(row.data(), w_ptr, eps, width, n_ptr + r * width);
    }
  });
}

// x: [tokens, hidden] → [tokens, hidden]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args("rms_norm", x, weight);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_impl<scalar_t>(x, weight, static_cast<float>(eps), out);
  });
  return out;
}

// x, residual: [tokens, hidden] → (rms_norm(x + residual) [tokens, hidden], x + residual [tokens, hidden])
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm_args("add_rms_norm", x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual is x's shape and dtype, with contiguous rows");
  auto normed = at::empty({x.size(0), x.size(1)}, x.options());
  auto residual_out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch_float_types(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    add_rms_norm_impl<scalar_t>(x, residual, weight, static_cast<float>(eps), normed, residual_out);
  });
  return {normed, residual_out};
}

// RoPE in place on every head of x, each token at its own angle (the rotate-half form:
// the first half of a head pairs with the second).
template <typename T>
void rotary_impl(at::Tensor& x, const at::Tensor& cos_sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), head_size = x.size(2), half = head_size / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  T* x_ptr = x.data_ptr<T>();
  const T* cs_ptr = cos_sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(heads * head_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* cos = cs_ptr + t * 2 * head_size;
      const T* sin = cos + head_size;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x_ptr + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; i += kLanes) {
          const int64_t n = std::min(kLanes, half - i);
          const Vec16 a = load_n(v + i, n), b = load_n(v + i + half, n);
          const Vec16 first = round16(a * load_n(cos + i, n), v) - round16(b * load_n(sin + i, n), v);
          const Vec16 second = round16(b * load_n(cos + i + half, n), v) + round16(a * load_n(sin + i + half, n), v);
          store_n(v + i, first, n);
          store_n(v + i + half, second, n);
        }
      }
    }
  });
}

// x: [tokens, heads, head_size], rows contiguous (a view of q and k heads is fine);
// cos_sin: [tokens, 2, head_size], each token's cos and sin (halves duplicated)
void rotary_embedding_(at::Tensor& x, const at::Tensor& cos_sin) {
  TORCH_CHECK(x.device().is_cpu() && cos_sin.device().is_cpu(), "rotary_embedding_: CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_embedding_: x is [tokens, heads, head_size] with contiguous heads and an even head_size");
  TORCH_CHECK(cos_sin.dim() == 3 && cos_sin.size(0) == x.size(0) && cos_sin.size(1) == 2 &&
                  cos_sin.size(2) == x.size(2) && cos_sin.is_contiguous(),
              "rotary_embedding_: cos_sin is a contiguous [tokens, 2, head_size]");
  TORCH_CHECK(cos_sin.scalar_type() == x.scalar_type(), "rotary_embedding_: x and cos_sin share a dtype");
  dispatch_float_types(x.scalar_type(), "rotary_embedding_", [&](auto tag) {
    using scalar_t = decltype(tag);
    rotary_impl<scalar_t>(x, cos_sin);
  });
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// silu(gate) * up over the first `whole` (a multiple of 8) elements of a float32 row, 8 lanes at a
// time: the 16-lane form went through the stack there (~6 ns an element on the AVX2 EPYC). Returns
// how many it did.
inline int64_t silu_and_mul_float_lanes(const float* gate, const float* up, float* o, int64_t width) {
  const int64_t whole = width / 8 * 8;
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign));  // e^-|g|
    const __m256 numerator = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
    const __m256 silu = _mm256_mul_ps(g, _mm256_div_ps(numerator, _mm256_add_ps(one, e)));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  return whole;
}
#endif

template <typename T>
void silu_and_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1), stride = gate_up.stride(0);
  const T* in = gate_up.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * stride;
      const T* up = gate + width;
      T* o = o_ptr + r * width;
      int64_t done = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) done = silu_and_mul_float_lanes(gate, up, o, width);
#endif
      for (int64_t i = done; i < width; i += kLanes) {
        const int64_t n = std::min(kLanes, width - i);
        store_n(o + i, round16(silu(load_n(gate + i, n)), o) * load_n(up + i, n), n);
      }
    }
  });
}

// gate_up: [tokens, 2 * intermediate] (gate, then up) → silu(gate) * up [tokens, intermediate]
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_and_mul: CPU tensors only");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up is [tokens, 2 * intermediate] with contiguous rows");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_float_types(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_impl<scalar_t>(gate_up, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos_sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_embedding_", &rotary_embedding_);
  m.impl("silu_and_mul", &silu_and_mul);
}
