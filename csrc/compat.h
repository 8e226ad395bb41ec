// One source, two toolchains: the few names that differ between CUDA (nvcc) and
// MUSA (mcc, torch_musa). Everything else in csrc/ is plain CUDA-compatible C++
// that both compilers accept, so the CUDA build exercises the same kernel code
// that runs on Moore Threads GPUs.
//
// Selection: mcc defines __MUSACC__ when compiling device code; the host-only
// binding (bindings.cpp) is compiled by the host compiler, so the build script
// also passes -DKVSERVE_USE_MUSA to every translation unit on MUSA.
#pragma once

#include <cstdint>

#if defined(KVSERVE_EMULATION)
// Test-only: a CPU emulation of the few device features the kernels use, so
// their logic runs on machines without a GPU (tests/test_csrc_emulated.py).
#define KVSERVE_MUSA 0
#include "emulation/cpu_emu.h"
#elif defined(__MUSACC__) || defined(KVSERVE_USE_MUSA)
#define KVSERVE_MUSA 1
#include <musa_runtime.h>
#include <musa_fp16.h>
typedef musaStream_t kvStream_t;
typedef musaError_t kvError_t;
#define kvSuccess musaSuccess
#define kvGetLastError musaGetLastError
#define kvGetErrorString musaGetErrorString
#else
#define KVSERVE_MUSA 0
#include <cuda_runtime.h>
#include <cuda_fp16.h>
typedef cudaStream_t kvStream_t;
typedef cudaError_t kvError_t;
#define kvSuccess cudaSuccess
#define kvGetLastError cudaGetLastError
#define kvGetErrorString cudaGetErrorString
#endif

// Warp width: 32 on NVIDIA and on MUSA mp_31 (S5000); 128 on MUSA up to
// mp_22 (S4000, S80/S3000). The kernels size every reduction from it (with
// 128-wide warps a 128-thread CTA is a single warp); tests/test_csrc_emulated.py
// runs the kernels at both widths.
#ifndef KV_WARP_SIZE
#if KVSERVE_MUSA && defined(__MUSA_ARCH__) && (__MUSA_ARCH__ <= 220)
#define KV_WARP_SIZE 128
#else
#define KV_WARP_SIZE 32
#endif
#endif

// Kernel launch and dynamic shared memory, spelled once so the emulation can
// substitute them (nvcc and mcc both accept the triple-chevron syntax).
#if !defined(KVSERVE_EMULATION)
#define KV_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define KV_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

#if defined(__CUDACC__) || defined(__MUSACC__)
#define KV_DEVICE __device__ __forceinline__

// Butterfly exchange across the whole warp. Both toolchains provide the *_sync
// form; MUSA keeps a 32-bit mask even for 128-wide warps, where the full mask
// means "every lane participates", as on CUDA.
KV_DEVICE float kv_shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }

// fp16 <-> fp32 on raw 16-bit storage. The kernels keep 16-bit elements as
// uint16_t so that fp16 and bf16 share one code path; only these two helpers
// touch the vendor half type (cuda_fp16.h / musa_fp16.h expose the same names).
KV_DEVICE float kv_half_bits_to_float(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}
KV_DEVICE uint16_t kv_float_to_half_bits(float f) {
  return __half_as_ushort(__float2half_rn(f));
}
#endif  // device compilers
