// Intel AMX (matrix tiles) on Linux: whether this build has it and this process may use it.
#pragma once

// The AMX kernels: built where the CPU has AMX tiles with int8 multiplies.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVSERVE_AMX_INT8 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kvserve_cpu {

// Linux hands out AMX's 8 KiB of tile state only on request (once per process); without it the
// first tile instruction faults, so a refusal keeps the kernels that use no tiles.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// The 64-byte block _tile_loadconfig reads (palette 1).
struct AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// LDTILECFG with the whole 64 bytes as its operand. GCC's _tile_loadconfig names only the first 8
// ("m" (*(const void **)p)), so the compiler may drop or sink the stores of the rest: in the call a
// one-thread parallel_for inlines, the int8 and int4 kernels loaded a configuration of stack garbage
// and LDTILECFG faulted (SIGSEGV, an executor with quantized weights on one thread).
inline void load_tile_config(const AmxConfig& config) { asm volatile("ldtilecfg %0" ::"m"(config)); }

}  // namespace kvserve_cpu
#endif

namespace kvserve_cpu {

// Whether this build has the kernels on AMX bf16 and int8 tiles (built where the CPU has both) and
// this process may use the tiles: what has_amx, has_prompt_linear and has_prefill_attention answer.
inline bool amx_bf16_usable() {
#if defined(KVSERVE_AMX_INT8) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace kvserve_cpu
