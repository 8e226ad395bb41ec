"""Whether the prompt kernel runs at the rate this machine's AMX tile unit gives one thread.

    python -m bench.amx_tile_rate [--rows 512] [--rounds 20]

The probe is the prompt kernel's inner loop alone (csrc/cpu/prompt_linear.cpp: two row tiles of x
and two column tiles of weights, four ``TDPBF16PS`` per 32 inputs) over the same 32 rows and two
weight tiles every pass (72 KiB at 576 inputs: L2, the newest lines in L1), so nothing but the tile
unit and the core's caches bound it; it is compiled here with the system's ``g++`` into
``~/.cache/kvserve/amx_tile_rate/`` and called through ctypes. ``prompt_linear_bf16`` runs the
model's prompt-step projections (q/k/v, o, gate_up, down) at ``--rows`` rows on one thread, the probe
taking turns with it, and each prints its best TFLOP/s: the kernel's share of the probe's rate is what
a better kernel could still win on this machine. On a 2-vCPU VM whose core is shared with another
guest the rate moves from run to run by 2x (docs/executor.md); the ratio within one run is the number
to read. Prints ``lscpu``'s model line and AMX flags with the figures.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import torch

from bench.matmul_bench import model_shapes
from bench.peers.common import lscpu_text
from bench.timing import timed_interleaved
from executor.attention.csrc_loader import csrc_build_script
from executor.model import ModelConfig
from kvserve.paths import default_model_dir

PROBE_SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>

namespace {
struct Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
}  // namespace

// Linux's permission for the tile state, then `blocks` passes of 32 rows x 32 columns over
// `depth` inputs (a multiple of 32) of ones: every sum is `depth`. sums: 4 x 256 floats.
extern "C" int tile_probe(const uint16_t* x, const uint16_t* w, int64_t depth, int64_t blocks, float* sums) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -1;
  Config config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  asm volatile("ldtilecfg %0" ::"m"(config));
  for (int64_t block = 0; block < blocks; ++block) {
    asm volatile("" ::: "memory");
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < depth; k += 32) {
      _tile_loadd(4, x + k, depth * 2);
      _tile_loadd(5, x + 16 * depth + k, depth * 2);
      _tile_loadd(6, w + k * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, w + depth * 16 + k * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sums, 64); _tile_stored(1, sums + 256, 64);
    _tile_stored(2, sums + 512, 64); _tile_stored(3, sums + 768, 64);
    asm volatile("" ::: "memory");
  }
  _tile_release();
  return 0;
}
"""

PROBE_DEPTH = 576  # the model's hidden size: x's 32 rows and the two weight tiles are 72 KiB (L2)


def build_probe(cache: Path) -> ctypes.CDLL:
    """The probe as a shared library, compiled once per source text."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise SystemExit("amx_tile_rate: needs g++ to build the probe")
    digest = hashlib.sha256(PROBE_SOURCE.encode()).hexdigest()[:16]
    library = cache / f"tile_probe-{digest}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        source = cache / f"tile_probe-{digest}.cpp"
        source.write_text(PROBE_SOURCE)
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-mamx-tile", "-mamx-bf16", str(source),
                        "-o", str(library)], check=True)
    probe = ctypes.CDLL(str(library))
    probe.tile_probe.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    probe.tile_probe.restype = ctypes.c_int
    return probe


class TileProbe:
    """Calls the probe over ones; ``flops_per_call`` multiply-adds x 2 each call."""

    def __init__(self, library: ctypes.CDLL, depth: int, blocks: int):
        self.library, self.depth, self.blocks = library, depth, blocks
        self.x = torch.ones(32, depth, dtype=torch.bfloat16)
        self.w = torch.ones(2, depth, 16, dtype=torch.bfloat16)
        self.sums = torch.zeros(4, 256)
        self.flops_per_call = 2 * 32 * 32 * depth * blocks

    def __call__(self) -> None:
        status = self.library.tile_probe(self.x.data_ptr(), self.w.data_ptr(), self.depth, self.blocks,
                                         self.sums.data_ptr())
        if status != 0:
            raise SystemExit("amx_tile_rate: Linux refused this process the AMX tile state")

    def sums_correct(self) -> bool:
        return bool(torch.all(self.sums == self.depth))


def prompt_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of a layer's projections as a prompt step runs them: qkv, o, gate_up, down."""
    return model_shapes(config)[:4]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--rows", type=int, default=512, help="prompt tokens in the step")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvserve" / "amx_tile_rate")
    args = parser.parse_args(argv)

    ops = csrc_build_script().load_cpu()
    if not torch.ops.kvserve_cpu.has_prompt_linear():
        print("amx_tile_rate: this CPU or build has no AMX bf16 tiles; nothing to measure")
        return 0
    torch.set_num_threads(1)
    config = ModelConfig.from_dir(args.model or default_model_dir())
    generator = torch.Generator().manual_seed(0)
    x = {k: torch.randn(args.rows, k, generator=generator).bfloat16() for _, k in prompt_shapes(config)}
    weights = [(n, k, ops.pack_skinny_weight((torch.randn(n, k, generator=generator) * 0.05).bfloat16()))
               for n, k in prompt_shapes(config)]
    kernel_flops = sum(2 * args.rows * n * k for n, k, _ in weights)

    def kernel() -> None:
        for n, k, packed in weights:
            torch.ops.kvserve_cpu.prompt_linear_bf16(x[k], packed, None, n)

    # About as many multiply-adds a call as the kernel's layer, so that both are timed alike.
    probe = TileProbe(build_probe(args.cache), PROBE_DEPTH,
                      blocks=max(1, kernel_flops // (2 * 32 * 32 * PROBE_DEPTH)))
    best = timed_interleaved({"probe": probe, "kernel": kernel}, rounds=args.rounds)
    if not probe.sums_correct():
        raise SystemExit("amx_tile_rate: the probe's sums are wrong; its rate measures nothing")
    probe_rate = probe.flops_per_call / best["probe"] / 1e9
    kernel_rate = kernel_flops / best["kernel"] / 1e9
    lscpu = lscpu_text()
    model = next((line for line in lscpu.splitlines() if line.startswith("Model name")), "")
    flags = " ".join(flag for flag in ("amx_bf16", "amx_tile", "amx_int8") if flag in lscpu)
    print(f"{model.strip()}  ({flags})")
    print(f"tile probe (cached operands, 1 thread):      {probe_rate:6.3f} TFLOP/s")
    print(f"prompt_linear_bf16, one layer, {args.rows} rows:  {kernel_rate:6.3f} TFLOP/s")
    print(f"kernel / probe: {kernel_rate / probe_rate:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
