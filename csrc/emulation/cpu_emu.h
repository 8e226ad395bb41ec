// CPU emulation of the device features the kvserve kernels use — test-only.
//
// Compiled with g++ -DKVSERVE_EMULATION, the unmodified kernel sources run on
// the host: each CTA runs as blockDim.x std::threads (CTAs one after another,
// so `static` stands in for __shared__), __syncthreads is a std::barrier, and
// warp shuffles exchange through a per-warp buffer between two warp barriers.
// Slow, but it executes the real index arithmetic, online softmax, partition
// reduce and masking, so kernel logic is tested without a GPU.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#ifndef KV_WARP_SIZE
#define KV_WARP_SIZE 32  // -DKV_WARP_SIZE=128 emulates MUSA mp_22 and older
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(n)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 {
  unsigned x, y, z, w;
};
struct float4 {
  float x, y, z, w;
};

typedef void* kvStream_t;
typedef int kvError_t;
#define kvSuccess 0
inline kvError_t kvGetLastError() { return 0; }
inline const char* kvGetErrorString(kvError_t) { return "emulation error"; }

using std::fmaxf;
using std::min;

inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

namespace kvemu {

struct Cta {
  std::unique_ptr<std::barrier<>> block_barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  std::vector<float> shuffle;  // one slot per thread
  std::vector<unsigned char> dynamic_smem;
};
inline Cta& cta() {
  static Cta c;
  return c;
}

inline thread_local dim3 t_thread, t_block;
inline dim3 g_block_dim, g_grid_dim;

}  // namespace kvemu

#define threadIdx (::kvemu::t_thread)
#define blockIdx (::kvemu::t_block)
#define blockDim (::kvemu::g_block_dim)
#define gridDim (::kvemu::g_grid_dim)

inline void __syncthreads() { kvemu::cta().block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask, int width = KV_WARP_SIZE) {
  auto& c = kvemu::cta();
  const unsigned t = threadIdx.x;
  const unsigned warp = t / width, lane = t % width;
  c.shuffle[t] = v;
  c.warp_barriers[warp]->arrive_and_wait();
  const float r = c.shuffle[warp * width + (lane ^ static_cast<unsigned>(lane_mask))];
  c.warp_barriers[warp]->arrive_and_wait();  // nobody overwrites a slot before it is read
  return r;
}

// IEEE half <-> float, round to nearest even (what __float2half_rn does).
inline float kv_half_bits_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  int exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | static_cast<uint32_t>(exp + 112) << 23 | (mant << 13);
    }
  } else {
    bits = sign | static_cast<uint32_t>(exp + 112) << 23 | (mant << 13);
  }
  return __uint_as_float(bits);
}
inline uint16_t kv_float_to_half_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;          // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;         // rounds to inf
  if (a < 0x33000001u) return sign;                    // rounds to zero
  int exp = static_cast<int>(a >> 23) - 112;
  uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  int shift = 13;
  if (exp <= 0) {  // subnormal half
    shift += 1 - exp;
    exp = 0;
  }
  uint32_t r = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  // Normal: r carries the implicit bit, so a rounding carry correctly bumps the exponent.
  const uint32_t out = exp == 0 ? r : (static_cast<uint32_t>(exp) << 10) + (r - 0x400u);
  return static_cast<uint16_t>(sign | out);
}

#define KV_DEVICE inline
inline float kv_shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }

namespace kvemu {

// Runs body() as grid x block threads, one CTA at a time.
inline void launch(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  g_grid_dim = grid;
  g_block_dim = block;
  const unsigned n = block.x;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Cta& c = cta();
        c.block_barrier = std::make_unique<std::barrier<>>(n);
        c.warp_barriers.clear();
        constexpr unsigned W = KV_WARP_SIZE;
        for (unsigned w = 0; w < (n + W - 1) / W; ++w)
          c.warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(W, n - W * w)));
        c.shuffle.assign(n, 0.f);
        c.dynamic_smem.assign(smem + 16, 0);
        std::vector<std::thread> threads;
        threads.reserve(n);
        for (unsigned t = 0; t < n; ++t)
          threads.emplace_back([&, t] {
            t_thread = dim3(t);
            t_block = dim3(x, y, z);
            body();
            // A thread that returns early must not leave others waiting: drop out
            // of every barrier it would have joined.
            c.block_barrier->arrive_and_drop();
            c.warp_barriers[t / KV_WARP_SIZE]->arrive_and_drop();
          });
        for (auto& th : threads) th.join();
      }
}

}  // namespace kvemu

#define KV_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ((void)(stream), ::kvemu::launch(dim3(grid), dim3(block), (smem), [&] { kernel(__VA_ARGS__); }))
#define KV_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(::kvemu::cta().dynamic_smem.data())
