"""The CPU kernels (csrc/cpu/) build wherever a compiler is, and compute the same on any x86-64.

Every kernel test skips where the kernels cannot be built, so a compile error on this machine
would otherwise pass CI with the kernels untested: here it fails. And the kernels have portable
paths for CPUs without AVX-512 (vector-extension code for the attention loads, the bf16 matmul
without AVX512-BF16, the int8 one without VNNI, the int4 one): a build for
``-march=x86-64-v3`` (AVX2, FMA; no AVX-512) runs in a child process on the same inputs and
must give the native build's results.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from executor.attention.csrc_loader import csrc_build_script
from executor.quantization import quantize_int4, quantize_int8

ROOT = Path(__file__).resolve().parents[1]
PORTABLE_MARCH = "x86-64-v3"
X86_64_V3_FLAGS = {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
# The instruction sets the kernels take a path of their own for (csrc/cpu tests __AVX512F__,
# __AVX512BF16__, __AVX512VNNI__ and the __AMX_*__ macros): a CPU with none of them builds natively
# exactly the x86-64-v3 paths.
OWN_PATH_FLAGS = {"avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"}

CHILD = """
import sys, torch
from executor.attention.csrc_loader import csrc_build_script
from tests.test_csrc_cpu_portable import run_all
ops = csrc_build_script().load_cpu(march=sys.argv[1])
inputs = torch.load(sys.argv[2])
torch.save(run_all(ops, inputs), sys.argv[3])
"""


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def make_inputs() -> dict:
    g = torch.Generator().manual_seed(7)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    weight = randn(96, 576, scale=0.05)
    x = randn(11, 576)
    kv_heads, heads, head, blocks = 3, 9, 64, 80
    return {
        "x": x,
        "bias": randn(96),
        "bf16": weight,
        "int8": quantize_int8(weight, torch.bfloat16),
        "int4": quantize_int4(weight, torch.bfloat16),
        "query": randn(4, heads, head),
        "keys": randn(blocks, kv_heads, head, 16),
        "values": randn(blocks, kv_heads, 16, head),
        "tables": torch.randperm(blocks - 1, generator=g)[:4 * 19].add(1).view(4, 19).to(torch.int32),
        "lens": torch.tensor([300, 1, 17, 129], dtype=torch.int32),
        # gate and up halves from ±0.1 to beyond exp's clamp at -87
        "gate_up": torch.cat([randn(4, 3072, scale=0.1), randn(4, 3072, scale=4.0), randn(3, 3072, scale=60.0)]),
        "residual": randn(11, 576, scale=3.0),
        "norm_weight": randn(576),
    }


def run_all(ops, inputs: dict) -> dict:
    x, bias = inputs["x"], inputs["bias"]
    return {
        "bf16": ops.skinny_linear(x, ops.pack_skinny_weight(inputs["bf16"]), bias, 96),
        "int8": ops.skinny_linear_int8(x, ops.pack_skinny_int8(*inputs["int8"]), bias, 96),
        "int4": ops.skinny_linear_int4(x, ops.pack_skinny_int4(*inputs["int4"]), bias, 96),
        "attention": ops.paged_decode_attention(inputs["query"], inputs["keys"], inputs["values"], inputs["tables"],
                                                inputs["lens"], 0.125),
        "silu_and_mul": ops.silu_and_mul(inputs["gate_up"]),
        "silu_and_mul_f32": ops.silu_and_mul(inputs["gate_up"].float()),  # every bit of exp's result shows
        "add_rms_norm": ops.add_rms_norm(x, inputs["residual"], inputs["norm_weight"], 1e-5),
    }


@pytest.fixture(scope="module")
def native_ops():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the kernels cannot be built here, the torch paths run instead")
    return csrc_build_script().load_cpu()  # a compile error fails here, loudly


def test_the_kernels_build_wherever_a_compiler_is(native_ops):
    assert hasattr(native_ops, "skinny_linear_int8") and hasattr(native_ops, "paged_decode_attention")


@pytest.mark.timeout(1200)  # the portable build: ~1-2 min on 2 cores, once (cached afterwards)
def test_a_build_without_avx512_gives_the_same_results(native_ops, tmp_path):
    flags = cpu_flags()
    if not X86_64_V3_FLAGS <= flags:
        pytest.skip(f"this CPU cannot run {PORTABLE_MARCH} code")
    if not OWN_PATH_FLAGS & flags:
        pytest.skip(f"this CPU has none of {sorted(OWN_PATH_FLAGS)}: its native build is the {PORTABLE_MARCH} "
                    "paths, which every kernel test here checks against torch")
    inputs = make_inputs()
    torch.save(inputs, tmp_path / "inputs.pt")
    done = subprocess.run([sys.executable, "-c", CHILD, PORTABLE_MARCH, str(tmp_path / "inputs.pt"),
                           str(tmp_path / "outputs.pt")], cwd=ROOT, capture_output=True, text=True, timeout=1100)
    assert done.returncode == 0, done.stderr[-4000:]
    portable, native = torch.load(tmp_path / "outputs.pt"), run_all(native_ops, inputs)
    # Integer sums (int8) and the same float operations (attention) agree to the last bits; the
    # bf16 and int4 matmuls pair their multiply-adds differently without VDPBF16PS: bf16 rounding.
    torch.testing.assert_close(portable["attention"], native["attention"], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(portable["int8"], native["int8"], atol=2e-3, rtol=2 ** -7)
    for kind in ("bf16", "int4"):
        torch.testing.assert_close(portable[kind], native[kind], atol=2e-3, rtol=2 ** -7)
    # The elementwise ops are the same operations on every path (AVX-512 intrinsics, AVX2 halves,
    # vector extensions): the same bits.
    assert torch.equal(portable["silu_and_mul"], native["silu_and_mul"])
    assert torch.equal(portable["silu_and_mul_f32"], native["silu_and_mul_f32"])
    assert all(torch.equal(a, b) for a, b in zip(portable["add_rms_norm"], native["add_rms_norm"]))
