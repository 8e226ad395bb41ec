"""One prepared GPU run for the csrc kernels (issue 7). On a CUDA machine:

    python bench/gpu_kernels.py                 # build, GPU tests, benchmark, table
    python bench/gpu_kernels.py --skip-tests    # build + benchmark only

(a) builds the extension (JIT, cached; TORCH_CUDA_ARCH_LIST defaults to the
    local GPU), (b) runs tests/test_csrc_gpu.py, (c) benchmarks decode
    attention: kernel time vs bytes of KV read → GB/s, against the device's
    measured copy bandwidth (a large tensor copy, read + write bytes) and against
    torch's scaled_dot_product_attention on the same K/V stored contiguously,
    (d) prints a markdown table, also written to $OUT/gpu_kernels.md when $OUT
    is set, and (e) checks that the executor generates the same greedy tokens
    with the native kernels as with the torch backend (tiny random Llama, mixed
    prefill + batched decode, fp32 and bf16). Sized to finish in well under 8
    minutes on an H200.
Target: >= 80% of copy bandwidth at batch >= 32, context >= 4096, and not
slower than contiguous SDPA.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from executor.attention.native import NativeAttentionBackend, load_ops  # noqa: E402


@dataclass
class Config:
    dtype: torch.dtype
    batch: int
    context: int
    num_heads: int
    kv_heads: int
    head_size: int = 128
    block_size: int = 16

    @property
    def label(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (f"{dt} B={self.batch} L={self.context} H={self.num_heads}/{self.kv_heads} "
                f"D={self.head_size} bs={self.block_size}")


CONFIGS = [
    Config(torch.float16, 32, 4096, 32, 8),  # Llama-3-8B-like GQA
    Config(torch.bfloat16, 32, 4096, 64, 8),  # Qwen3-32B-like (the seed's model)
    Config(torch.float16, 64, 8192, 32, 8),
    Config(torch.float16, 32, 4096, 32, 32),  # MHA
    Config(torch.float16, 32, 4096, 32, 8, block_size=32),
    Config(torch.float16, 32, 4096, 32, 8, block_size=8),
    Config(torch.bfloat16, 64, 4096, 9, 3, head_size=64),  # SmolLM2-135M-like
    Config(torch.float16, 4, 32768, 32, 8),  # few long sequences: where v2 matters
]


def time_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median wall time of fn on the device, in ms (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def copy_bandwidth_gbs() -> float:
    """Device copy bandwidth: a 2 GiB tensor copy counts 2 GiB read + 2 GiB written."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=20)
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def bench_config(backend: NativeAttentionBackend, cfg: Config, copy_gbs: float) -> dict:
    torch.manual_seed(0)
    B, L, bs = cfg.batch, cfg.context, cfg.block_size
    nb = -(-L // bs)
    num_blocks = B * nb + 1
    kc, vc = backend.allocate_kv_cache(num_blocks, bs, cfg.kv_heads, cfg.head_size, cfg.dtype, torch.device("cuda"))
    kc.normal_()
    vc.normal_()
    # Scattered blocks, as a busy server would hand them out.
    block_tables = (torch.randperm(num_blocks - 1, device="cuda")[: B * nb] + 1).view(B, nb).int()
    seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(B, cfg.num_heads, cfg.head_size, device="cuda").to(cfg.dtype)
    scale = cfg.head_size**-0.5
    kv_bytes = 2 * B * L * cfg.kv_heads * cfg.head_size * kc.element_size()

    def run(ps):
        return lambda: backend.decode(q, (kc, vc), block_tables, seq_lens, L, scale, partition_size=ps)

    t_auto = time_ms(run(None))
    t_v1 = time_ms(run(0))
    t_v2 = time_ms(run(backend.PARTITION_SIZE))
    auto_v2 = backend.use_v2(B, cfg.num_heads, cfg.kv_heads, L)

    # The same K/V stored contiguously [B, kv_heads, L, D] for SDPA.
    x = kc.shape[-1]
    kg = kc[block_tables.long()]  # [B, nb, kvH, D/x, bs, x]
    k_contig = kg.permute(0, 2, 1, 4, 3, 5).reshape(B, cfg.kv_heads, nb * bs, cfg.head_size)[:, :, :L].contiguous()
    vg = vc[block_tables.long()]  # [B, nb, kvH, D, bs]
    v_contig = vg.permute(0, 2, 1, 4, 3).reshape(B, cfg.kv_heads, nb * bs, cfg.head_size)[:, :, :L].contiguous()
    del kg, vg
    assert x * kc.shape[-3] == cfg.head_size
    q4 = q.unsqueeze(2)  # [B, H, 1, D]
    gqa = cfg.num_heads != cfg.kv_heads

    def sdpa():
        return F.scaled_dot_product_attention(q4, k_contig, v_contig, scale=scale, enable_gqa=gqa)

    # Sanity: the kernel and SDPA agree on these inputs.
    ours = run(None)()
    theirs = sdpa().squeeze(2)
    err = (ours.float() - theirs.float()).abs().max().item()
    t_sdpa = time_ms(sdpa)
    del k_contig, v_contig, kc, vc
    torch.cuda.empty_cache()
    gbs = kv_bytes / (t_auto * 1e-3) / 1e9
    return {
        "config": cfg.label,
        "kv_mib": kv_bytes / 2**20,
        "auto": "v2" if auto_v2 else "v1",
        "t_auto_us": t_auto * 1e3,
        "t_v1_us": t_v1 * 1e3,
        "t_v2_us": t_v2 * 1e3,
        "gbs": gbs,
        "pct_copy": 100 * gbs / copy_gbs,
        "t_sdpa_us": t_sdpa * 1e3,
        "vs_sdpa": t_sdpa / t_auto,
        "max_abs_err_vs_sdpa": err,
        "target": B >= 32 and L >= 4096,
    }


def make_tiny_model(model_dir: Path, seed: int = 0) -> Path:
    """A small random Llama checkpoint (GQA 8/2, head_dim 64) in the loader's format, so the
    end-to-end check needs no download: greedy tokens only have to agree between backends."""
    import json

    from safetensors.torch import save_file

    from executor.loader import _destinations
    from executor.model import ModelConfig, Transformer

    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32",
    }  # fmt: skip
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(raw))
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dict(raw))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (param, lo, hi) in _destinations(model).items():
        shape = (hi - lo, *param.shape[1:])
        tensors[name] = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=g) * 0.05
    save_file(tensors, str(model_dir / "model.safetensors"))
    return model_dir


def greedy_tokens(model_dir: Path, device: str, backend: str, dtype: str, prompts: list[list[int]], steps: int,
                  block_size: int = 16) -> list[list[int]]:
    """Batched greedy generation through ModelRunner: one mixed prefill step (prompts of
    different lengths), then batched decode steps. Returns the generated ids per prompt."""
    from executor.runner import ModelRunner, RunnerOptions, SequenceInput

    runner = ModelRunner(RunnerOptions(model_dir=model_dir, device=device, dtype=dtype, attention_backend=backend,
                                       block_size=block_size, num_blocks=512, max_model_len=2048))
    per_seq = -(-(max(map(len, prompts)) + steps) // block_size)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))[::-1] for i in range(len(prompts))]  # scattered
    seqs = [SequenceInput(i, list(p), 0, tables[i], sample=True) for i, p in enumerate(prompts)]
    lens = [len(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        step = runner.execute(seqs)
        seqs = []
        for i, tok in enumerate(step.sampled_token_ids):
            out[i].append(tok)
            seqs.append(SequenceInput(i, [tok], lens[i], tables[i], sample=True))
            lens[i] += 1
    return out


def e2e_check(device: str = "cuda", steps: int = 48) -> str:
    """Same greedy tokens with the native kernels as with the torch backend (tiny random model)."""
    import tempfile

    prompts = [list(range(3, 3 + n)) for n in (5, 40, 130, 1)]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny-llama")
        for dtype in ("float32", "bfloat16"):
            ref_tokens = greedy_tokens(model_dir, device, "torch", dtype, prompts, steps)
            ours = greedy_tokens(model_dir, device, "auto" if device != "cpu" else "torch", dtype, prompts, steps)
            first_diff = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ref_tokens, ours)]
            same = sum(d is None for d in first_diff)
            lines.append(f"{dtype}: {same}/{len(prompts)} sequences identical over {steps} greedy tokens"
                         + ("" if same == len(prompts) else f" (first divergence per sequence: {first_diff})"))
    return "; ".join(lines)


def table(rows: list[dict], copy_gbs: float) -> str:
    head = ("| config | KV MiB | pick | kernel µs | v1 µs | v2 µs | GB/s | % of copy BW | SDPA µs | SDPA/kernel | max err |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [
        f"| {r['config']}{'' if r['target'] else ' (not a target row)'} | {r['kv_mib']:.0f} | {r['auto']} | "
        f"{r['t_auto_us']:.1f} | {r['t_v1_us']:.1f} | {r['t_v2_us']:.1f} | {r['gbs']:.0f} | {r['pct_copy']:.0f}% | "
        f"{r['t_sdpa_us']:.1f} | {r['vs_sdpa']:.2f}x | {r['max_abs_err_vs_sdpa']:.1e} |"
        for r in rows
    ]
    ok = [r for r in rows if r["target"]]
    verdict = (f"\nTarget rows (batch >= 32, context >= 4096): "
               f"{sum(r['pct_copy'] >= 80 for r in ok)}/{len(ok)} at >= 80% of copy bandwidth, "
               f"{sum(r['vs_sdpa'] >= 1.0 for r in ok)}/{len(ok)} not slower than contiguous SDPA.\n")
    return f"Copy bandwidth (2 GiB tensor copy, read+write): {copy_gbs:.0f} GB/s\n\n" + head + "\n".join(lines) + "\n" + verdict


def main() -> int:
    parser = argparse.ArgumentParser(description="csrc kernels: build, GPU tests, decode benchmark")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--test-timeout", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    if "TORCH_CUDA_ARCH_LIST" not in os.environ:
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{props.major}.{props.minor}"
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    report = [f"# csrc kernels on {props.name} (torch {torch.__version__}, CUDA {torch.version.cuda})\n"]

    t0 = time.time()
    load_ops("cuda")
    report.append(f"(a) build: {time.time() - t0:.0f} s (cached after the first run)\n")
    print(report[-1], flush=True)

    if not args.skip_tests:
        t0 = time.time()
        # --noconftest: the kernel tests need none of tests/conftest.py's service
        # fixtures, whose gRPC health/reflection imports a bare GPU image may lack.
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "tests/test_csrc_gpu.py"]
        try:
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.test_timeout)
            out = (res.stdout + res.stderr).strip().splitlines()
            summary = out[-1] if out else "(no output)"
            if res.returncode != 0:
                print("\n".join(out[-80:]), flush=True)
        except subprocess.TimeoutExpired:
            summary = f"timed out after {args.test_timeout} s"
        report.append(f"(b) tests/test_csrc_gpu.py: {summary} ({time.time() - t0:.0f} s)\n")
        print(report[-1], flush=True)

    t0 = time.time()
    try:
        import structlog  # noqa: F401  (the executor's logging; not on every GPU image)

        e2e = e2e_check("cuda")
    except ModuleNotFoundError as exc:
        e2e = f"skipped: {exc} (carry its wheel, see csrc/README.md)"
    except Exception as exc:  # report, keep benchmarking
        e2e = f"failed: {type(exc).__name__}: {exc}"
    report.append(f"(e) executor end to end, native vs torch backend: {e2e} ({time.time() - t0:.0f} s)\n")
    print(report[-1], flush=True)

    backend = NativeAttentionBackend(torch.device("cuda"))
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for cfg in CONFIGS:
        rows.append(bench_config(backend, cfg, copy_gbs))
        print(f"  {cfg.label}: {rows[-1]['t_auto_us']:.1f} us, {rows[-1]['gbs']:.0f} GB/s", flush=True)
    report.append("(c, d) decode attention\n\n" + table(rows, copy_gbs))
    text = "\n".join(report)
    print("\n" + text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_kernels.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
