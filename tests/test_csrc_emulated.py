"""CPU: the real kernel sources (csrc/*.cu) executed through a thread-per-lane
emulation (csrc/emulation/cpu_emu.h) and compared with the pure-torch reference.

This is not a GPU test — timing, memory model and the real compilers are out of
scope — but it runs the kernels' own index arithmetic, online softmax, v2
partition reduce, GQA head slicing, tail masking and the cache kernels, on
machines without a GPU. Needs g++ with C++20 (<barrier>); skipped otherwise.
"""
from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from csrc_support import nan_paged_cache
from executor.attention.csrc_loader import csrc_build_script
from executor.attention import paged_reference as ref

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
UNITS = ["cache_kernels.cu", "attention_f32.cu", "attention_f16.cu", "attention_bf16.cu"]
pytestmark = pytest.mark.timeout(1800)  # the first test also builds the library (~1 min, more on a loaded box)
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # as tests/test_csrc_gpu.py


def emulation_flags(warp_size: int) -> list[str]:
    # Hidden, non-unique symbols: the 32- and 128-wide builds live in one
    # process and must not share the kernels' static "__shared__" arrays.
    return ["g++", "-std=c++20", "-O1", "-fPIC", "-fvisibility=hidden", "-fno-gnu-unique",
            "-Wno-unknown-pragmas", "-DKVSERVE_EMULATION", f"-DKV_WARP_SIZE={warp_size}", f"-I{CSRC}"]


def emulation_digest(warp_size: int) -> str:
    """What the library is built from: every file under csrc/, and the compile flags."""
    sources = b"".join(p.read_bytes() for p in sorted(CSRC.rglob("*")) if p.is_file())
    flags = " ".join(emulation_flags(warp_size)[:-1]).encode()  # not -I: where the checkout is
    return hashlib.sha256(sources + flags).hexdigest()[:16]


def cached_emulation(warp_size: int) -> ctypes.CDLL:
    """``build_emulation``'s library, built once per ``emulation_digest`` and kept beside the
    compiled kernels (``csrc/build.py``'s ``build_root``): later runs and checkouts load it."""
    digest = emulation_digest(warp_size)
    cache = csrc_build_script().build_root() / "emulation" / f"w{warp_size}-{digest}"
    if not cache.is_dir():
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
        build_emulation(staging, warp_size)
        try:
            staging.rename(cache)  # atomic: a concurrent run that got there first keeps its own
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return load_emulation(cache / f"libkvemu_w{warp_size}_{digest}.so")


def load_emulation(lib_path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(lib_path))
    for fn in (lib.emu_paged_attention, lib.emu_reshape_and_cache, lib.emu_copy_blocks):
        fn.restype = ctypes.c_char_p
    return lib


def build_emulation(out: Path, warp_size: int) -> ctypes.CDLL:
    """Compiles the kernel sources + emulation into a shared library (g++, -O1)."""
    sources = [CSRC / u for u in UNITS] + [CSRC / "emulation" / "emu_api.cpp"]
    digest = emulation_digest(warp_size)
    objs, procs = [], []
    for src in sources:
        obj = out / f"{src.name}.w{warp_size}.o"
        lang = ["-x", "c++"] if src.suffix == ".cu" else []
        cmd = [*emulation_flags(warp_size), *lang, "-c", str(src), "-o", str(obj)]
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        objs.append(str(obj))
    for cmd, proc in procs:
        text, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            if "barrier" in text and "No such file" in text:
                pytest.skip("g++ without C++20 <barrier>")
            raise AssertionError(f"$ {' '.join(cmd)}\n{text}")
    lib_path = out / f"libkvemu_w{warp_size}_{digest}.so"
    subprocess.run(["g++", "-shared", "-pthread", *objs, "-o", str(lib_path)], check=True, timeout=120)
    return load_emulation(lib_path)


@pytest.fixture(scope="module")
def emu_libs(tmp_path_factory):
    """{32: lib, 128: lib}: NVIDIA / MUSA mp_31 warps, and MUSA mp_22 128-wide warps."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    with ThreadPoolExecutor(max_workers=2) as pool:
        libs = dict(zip((32, 128), pool.map(cached_emulation, (32, 128))))
    return libs


@pytest.fixture(scope="module")
def emu(emu_libs):
    return emu_libs[32]


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def emu_paged_attention(lib, q, kc, vc, bt, seq_lens, scale, partition_size):
    num_seqs, num_heads, head_size = q.shape
    max_parts = max(1, -(-max(seq_lens) // partition_size)) if partition_size else 1
    out = torch.empty(q.shape, dtype=q.dtype)
    exp_sums = torch.empty(num_seqs, num_heads, max_parts)
    max_logits = torch.empty(num_seqs, num_heads, max_parts)
    tmp_out = torch.empty(num_seqs, num_heads, max_parts, head_size)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    err = lib.emu_paged_attention(
        DTYPE_CODE[q.dtype], ptr(out), ptr(q), ptr(kc), ptr(vc), ptr(bt), ptr(sl),
        ptr(exp_sums), ptr(max_logits), ptr(tmp_out),
        num_seqs, num_heads, kc.shape[1], head_size, kc.shape[3], bt.shape[1],
        ctypes.c_int64(q.stride(0)), ctypes.c_int64(kc.stride(0)), ctypes.c_int64(kc.stride(1)),
        ctypes.c_float(scale), partition_size, max_parts,
    )  # fmt: skip
    assert err is None, err
    return out


def nan_cache(lens, kv_heads, head_size, block_size, dtype, seed):
    return nan_paged_cache(lens, kv_heads, head_size, block_size, dtype, seed, device="cpu")


CASES = [
    # dtype, head_size, block_size, group (query heads per kv head)
    (torch.float16, 128, 16, 4),
    (torch.bfloat16, 64, 8, 1),  # two value blocks in flight per CTA (BC = 2)
    (torch.float32, 80, 32, 3),  # head size that does not divide the CTA, fp32 x = 4
    (torch.float16, 96, 32, 12),  # GQA group split over two CTAs (8 + 4 heads)
    (torch.bfloat16, 256, 16, 2),
    (torch.float32, 64, 8, 8),
]


@pytest.mark.parametrize("dtype,head_size,block_size,group", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_emulated_paged_attention_v1_v2(emu, dtype, head_size, block_size, group):
    lens = [1, block_size + 1, 129, 300]
    kv_heads = 2
    kc, vc, bt = nan_cache(lens, kv_heads, head_size, block_size, dtype, seed=head_size + block_size + group)
    qkv = torch.randn(len(lens), kv_heads * group + 2 * kv_heads, head_size).to(dtype)
    q = qkv[:, : kv_heads * group]  # strided, like a view into a fused qkv projection
    scale = head_size**-0.5
    want = ref.paged_decode_attention(q, kc, vc, bt, lens, scale)
    for partition_size in (0, 128):  # v1; v2 with up to 3 partitions
        got = emu_paged_attention(emu, q, kc, vc, bt, lens, scale, partition_size)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype], msg=lambda m: f"partition {partition_size}: {m}")


def test_emulated_empty_sequence_gives_zeros(emu):
    kc, vc, bt = nan_cache([5, 3], 1, 64, 8, torch.float32, seed=1)
    q = torch.randn(2, 1, 64)
    for partition_size in (0, 128):
        got = emu_paged_attention(emu, q, kc, vc, bt, [5, 0], 0.125, partition_size)
        assert torch.equal(got[1], torch.zeros(1, 64))
        torch.testing.assert_close(got[:1], ref.paged_decode_attention(q[:1], kc, vc, bt[:1], [5], 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_emulated_reshape_and_cache_and_copy_blocks_exact(emu, dtype):
    kv_heads, head_size, block_size, num_blocks, n = 2, 64, 16, 12, 40
    kc, vc = ref.new_kv_cache(num_blocks, block_size, kv_heads, head_size, dtype, "cpu")
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.randperm(num_blocks * block_size)[:n]
    slots[::5] = -1
    qkv = torch.randn(n, 3 * kv_heads, head_size).to(dtype)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    err = emu.emu_reshape_and_cache(
        ptr(key), ptr(value), ptr(kc), ptr(vc), ptr(slots), n, kv_heads, head_size, block_size,
        ctypes.c_int64(key.stride(0)), ctypes.c_int64(value.stride(0)), key.element_size(),
    )  # fmt: skip
    assert err is None, err
    ref.reshape_and_cache(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)

    layers = [(kc, vc), tuple(t.clone().normal_() for t in (kc, vc))]
    want = [(k.clone(), v.clone()) for k, v in layers]
    mapping = torch.tensor([[1, 2], [5, 9], [5, 11]], dtype=torch.int64)
    ptrs = torch.tensor([k.data_ptr() for k, _ in layers] + [v.data_ptr() for _, v in layers], dtype=torch.int64)
    bytes_per_block = kc.stride(0) * kc.element_size()
    err = emu.emu_copy_blocks(ptr(ptrs), ctypes.c_void_p(ptrs.data_ptr() + 8 * len(layers)), ptr(mapping), len(layers), 3, ctypes.c_int64(bytes_per_block))
    assert err is None, err
    ref.copy_blocks(want, mapping[:, 0], mapping[:, 1])
    for (k, v), (k2, v2) in zip(layers, want):
        assert torch.equal(k, k2) and torch.equal(v, v2)


@pytest.mark.parametrize("dtype,head_size,block_size,group", [CASES[0], CASES[1], CASES[3]], ids=lambda v: str(v).replace("torch.", ""))
def test_emulated_128_wide_warps(emu_libs, dtype, head_size, block_size, group):
    """MUSA mp_22 and older run 128-wide warps: the whole CTA is one warp."""
    test_emulated_paged_attention_v1_v2(emu_libs[128], dtype, head_size, block_size, group)
