"""The decode step's matmuls alone: the skinny kernels (executor/skinny.py) against the ones they
stand in for, at the model's shapes, on this machine.

    python -m bench.matmul_bench [--model DIR] [--rows 1,2,4,8,16,32] [--threads 1]
    python -m bench.matmul_bench --prompt [--rows 40,200,551]
    python -m bench.matmul_bench --float32 [--rows 1,4,32,64]
    python -m bench.matmul_bench --layer-ops [--rows 1,8,32,560]

For each number of rows (tokens of a step), every projection of every layer and the LM head
once, with random weights of the model's shapes: bf16 through oneDNN's packed matmul and through
``skinny_linear``; int8 and int4 (executor/quantization.py's formats) through torch's weight-only
kernels and through the skinny ones. The kernels run in turn, round after round, and the best of
``--rounds`` is kept. GB/s is the bytes of weights read per second (bf16: 2 a weight).

``--prompt``: a prompt step's matmuls where the CPU has AMX bf16 tiles — every layer's four
projections and the MLP's activation (``silu_and_mul``), no LM head: bf16 through oneDNN, and
int8 / int4 through the prompt kernels with the activation as a separate op and taken from the
gate_up projection's sums (``prompt_silu_and_mul_*``). G multiply-adds/s of the projections.

``--layer-ops``: a step's elementwise ops between the matmuls — per layer two ``add_rms_norm``,
``rotary_embedding_`` on q and k, ``silu_and_mul`` — compiled (csrc/cpu/layer_ops.cpp) and in
torch (``TorchLayerOps``, the reference), each op's own time summed over the layers, in the dtype
the executor's ``--dtype auto`` picks on this CPU (bf16 where it runs natively, else float32).
"""
from __future__ import annotations

import argparse
from functools import partial

import torch

from bench.timing import timed_interleaved
from executor.attention.csrc_loader import csrc_build_script
from executor.devices import dtype_name, resolve_dtype
from executor.layer_ops import CpuLayerOps, TorchLayerOps
from executor.model import ModelConfig, pack_weight, packed_linear
from executor.quantization import Int4Linear, Int8Linear, quantize_int4, quantize_int8
from executor.skinny import SkinnyF32Matmul, SkinnyInt4Matmul, SkinnyInt8Matmul, SkinnyMatmul
from kvserve.paths import default_model_dir


def model_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of each matmul of one decode step: the layers' four projections, then the LM head."""
    c = config
    layer = [(c.q_size + 2 * c.kv_size, c.hidden_size), (c.hidden_size, c.q_size),
             (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    return layer * c.num_layers + [(c.vocab_size, c.hidden_size)]


def build_kernels(shapes: list[tuple[int, int]], ops) -> dict[str, list]:
    """Per kernel, one callable x → y per matmul. The LM head is as the model has it: int8 in the
    quantized columns of the skinny kernels (executor/quantization.py: quantize_lm_head), bf16
    through oneDNN in torch's."""
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16) for n, k in shapes]
    projections, lm_head = weights[:-1], weights[-1]
    onednn_head = pack_weight(lm_head)
    int8_head = SkinnyInt8Matmul(ops, *quantize_int8(lm_head, torch.bfloat16), torch.bfloat16)
    kernels = {
        "oneDNN bf16": [lambda x, p=pack_weight(w): packed_linear(x, p, None) for w in weights],
        "skinny bf16": [lambda x, s=SkinnyMatmul(ops, w): s(x, None) for w in weights],
        "torch int8": [], "skinny int8": [], "torch int4": [], "skinny int4": [],
    }
    for w in projections:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        linear.weight.data.copy_(w)
        codes8, scales8 = quantize_int8(w, torch.bfloat16)
        kernels["torch int8"].append(Int8Linear(linear))
        kernels["skinny int8"].append(lambda x, s=SkinnyInt8Matmul(ops, codes8, scales8, torch.bfloat16): s(x, None))
        kernels["torch int4"].append(Int4Linear(linear))
        kernels["skinny int4"].append(lambda x, s=SkinnyInt4Matmul(ops, *quantize_int4(w, torch.bfloat16), torch.bfloat16): s(x, None))
    for name in ("torch int8", "torch int4"):
        kernels[name].append(lambda x: packed_linear(x, onednn_head, None))
    for name in ("skinny int8", "skinny int4"):
        kernels[name].append(lambda x: int8_head(x, None))
    return kernels


def build_float32_kernels(shapes: list[tuple[int, int]], ops) -> dict[str, list]:
    """As ``build_kernels`` for a float32 model of a bf16 checkpoint: the weights are bf16 values;
    the quantized columns take float32 activations (the LM head int8 in both, as the model has it)."""
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16).float() for n, k in shapes]
    int8_head = SkinnyInt8Matmul(ops, *quantize_int8(weights[-1], torch.float32), torch.float32)
    int8 = [SkinnyInt8Matmul(ops, *quantize_int8(w, torch.float32), torch.float32) for w in weights[:-1]]
    int4 = [SkinnyInt4Matmul(ops, *quantize_int4(w, torch.bfloat16), torch.float32) for w in weights[:-1]]
    return {"torch float32": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights],
            "skinny f32": [lambda x, s=SkinnyF32Matmul(ops, w): s(x, None) for w in weights],
            "skinny int8 f32": [lambda x, s=s: s(x, None) for s in int8 + [int8_head]],
            "skinny int4 f32": [lambda x, s=s: s(x, None) for s in int4 + [int8_head]]}


def build_prompt_kernels(config: ModelConfig, ops) -> dict[str, object]:
    """Per kernel, one callable x576, x1536 → None running every layer's projections and activation
    as a prompt step does (x576: inputs of hidden_size features, x1536: of intermediate_size)."""
    generator = torch.Generator().manual_seed(0)
    c = config
    shapes = model_shapes(c)[:4]
    layers = [[(torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16) for n, k in shapes]
              for _ in range(c.num_layers)]

    def quantized(kind: str):
        """(SiLU separate, SiLU from the sums) over one set of ``kind`` weights."""
        matmuls = [[SkinnyInt8Matmul(ops, *quantize_int8(w, torch.bfloat16), torch.bfloat16) if kind == "int8" else
                    SkinnyInt4Matmul(ops, *quantize_int4(w, torch.bfloat16), torch.bfloat16) for w in layer]
                   for layer in layers]

        def run(hidden: torch.Tensor, intermediate: torch.Tensor, fused: bool) -> None:
            for qkv, o, gate_up, down in matmuls:
                qkv(hidden, None, prompt=True)
                o(hidden, None, prompt=True)
                if fused:
                    gate_up.silu_and_mul(hidden, None)
                else:
                    ops.silu_and_mul(gate_up(hidden, None, prompt=True))
                down(intermediate, None, prompt=True)
        return (lambda hidden, intermediate: run(hidden, intermediate, False),
                lambda hidden, intermediate: run(hidden, intermediate, True))

    packed = [[pack_weight(w) for w in layer] for layer in layers]

    def onednn(hidden: torch.Tensor, intermediate: torch.Tensor) -> None:
        for qkv, o, gate_up, down in packed:
            packed_linear(hidden, qkv, None)
            packed_linear(hidden, o, None)
            ops.silu_and_mul(packed_linear(hidden, gate_up, None))
            packed_linear(intermediate, down, None)

    kernels = {"oneDNN bf16, separate SiLU": onednn}
    for kind in ("int8", "int4"):
        kernels[f"{kind}, separate SiLU"], kernels[f"{kind}, SiLU from the sums"] = quantized(kind)
    return kernels


def run_prompt(config: ModelConfig, ops, rows_list: list[int], rounds: int) -> None:
    if not ops.has_prompt_linear():
        print("this CPU has no AMX bf16 tiles: prompt steps keep the decode kernels, nothing to compare")
        return
    kernels = build_prompt_kernels(config, ops)
    macs_per_row = sum(n * k for n, k in model_shapes(config)[:4]) * config.num_layers
    print(f"a prompt step's projections and MLP activation, {config.num_layers} layers, best of {rounds}")
    print("| rows | " + " | ".join(kernels) + " |")
    print("|---:|" + "---:|" * len(kernels))
    for rows in rows_list:
        hidden = torch.randn(rows, config.hidden_size).to(torch.bfloat16)
        intermediate = torch.randn(rows, config.intermediate_size).to(torch.bfloat16)
        best = timed_interleaved({name: partial(fn, hidden, intermediate) for name, fn in kernels.items()},
                                 rounds, warmup=1)
        cells = [f"{best[n]:.1f} ms ({macs_per_row * rows / best[n] / 1e6:.0f} G/s)" for n in kernels]
        print(f"| {rows} | " + " | ".join(cells) + " |")


def run_layer_ops(config: ModelConfig, ops, rows_list: list[int], rounds: int) -> None:
    implementations = {"compiled": CpuLayerOps(ops), "torch": TorchLayerOps()}
    c, layers = config, config.num_layers
    dtype = resolve_dtype("auto", config, torch.device("cpu"))  # what the executor computes in on this CPU
    print(f"a step's elementwise ops in {dtype_name(dtype)}, {layers} layers, best of {rounds}: "
          "ms a step (ns an element)")
    names = ["add_rms_norm x2", "rotary q+k", "silu_and_mul"]
    print("| rows | " + " | ".join(f"{name} {impl}" for name in names for impl in implementations) + " |")
    print("|---:|" + "---:|" * (len(names) * len(implementations)))
    weight = torch.randn(c.hidden_size).to(dtype)
    for rows in rows_list:
        x, residual = (torch.randn(rows, c.hidden_size).to(dtype) for _ in range(2))
        qk = torch.randn(rows, c.num_heads + c.num_kv_heads, c.head_dim).to(dtype)
        cos_sin = torch.randn(rows, 2, c.head_dim).to(dtype)
        gate_up = torch.randn(rows, 2 * c.intermediate_size).to(dtype)
        elements = {"add_rms_norm x2": 2 * x.numel(), "rotary q+k": qk.numel(), "silu_and_mul": gate_up.numel() // 2}

        def repeat(fn, *args):
            def run():
                for _ in range(layers):
                    fn(*args)
            return run

        fns = {}
        for impl_name, impl in implementations.items():
            fns[f"add_rms_norm x2 {impl_name}"] = repeat(lambda i=impl: (i.add_rms_norm(x, residual, weight, 1e-5),
                                                                         i.add_rms_norm(x, residual, weight, 1e-5)))
            fns[f"rotary q+k {impl_name}"] = repeat(impl.rotary_embedding_, qk, cos_sin)
            fns[f"silu_and_mul {impl_name}"] = repeat(impl.silu_and_mul, gate_up)
        best = timed_interleaved(fns, rounds, warmup=1)
        cells = [f"{best[f'{n} {i}']:.2f} ({best[f'{n} {i}'] * 1e6 / (elements[n] * layers):.2f})"
                 for n in names for i in implementations]
        print(f"| {rows} | " + " | ".join(cells) + " |")


# Bytes read per weight by each column's kernels: (the projections, the LM head). The quantized
# columns' head is as build_kernels has it; int4 adds a bf16 scale and zero per group of 32.
WEIGHT_BYTES = {"oneDNN bf16": (2, 2), "skinny bf16": (2, 2), "torch int8": (1, 2), "skinny int8": (1, 1),
                "torch int4": (0.5 + 4 / 32, 2), "skinny int4": (0.5 + 4 / 32, 1), "torch float32": (4, 4),
                "skinny f32": (2, 2), "skinny int8 f32": (1, 1), "skinny int4 f32": (0.5 + 4 / 32, 1)}


def weight_bytes(shapes: list[tuple[int, int]], name: str) -> int:
    projection, head = WEIGHT_BYTES[name]
    return int(sum(n * k for n, k in shapes[:-1]) * projection + shapes[-1][0] * shapes[-1][1] * head)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--rows", default=None, help="comma-separated numbers of rows (tokens); default "
                        "1,2,4,8,16,32, with --prompt 40,200,551")
    parser.add_argument("--prompt", action="store_true", help="a prompt step's matmuls and MLP activation on the "
                        "AMX prompt kernels instead of a decode step's")
    parser.add_argument("--float32", action="store_true", help="a float32 model's decode step: torch's float32 "
                        "matmul against skinny_linear_f32 and the int8 / int4 kernels on float32 activations")
    parser.add_argument("--layer-ops", action="store_true", help="a step's elementwise ops (norms, RoPE, SiLU), "
                        "compiled and in torch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = csrc_build_script().load_cpu()
    config = ModelConfig.from_dir(args.model or default_model_dir())
    if args.prompt:
        with torch.inference_mode():
            run_prompt(config, ops, [int(r) for r in (args.rows or "40,200,551").split(",")], args.rounds)
        return 0
    if args.layer_ops:
        with torch.inference_mode():
            run_layer_ops(config, ops, [int(r) for r in (args.rows or "1,8,32,560").split(",")], args.rounds)
        return 0
    shapes = model_shapes(config)
    kernels = build_float32_kernels(shapes, ops) if args.float32 else build_kernels(shapes, ops)
    dtype = torch.float32 if args.float32 else torch.bfloat16
    print(f"{len(shapes)} matmuls a step ({config.architecture}, hidden {config.hidden_size}), "
          f"{args.threads} thread(s), best of {args.rounds}")
    print("| rows | " + " | ".join(kernels) + " |")
    print("|---:|" + "---:|" * len(kernels))
    with torch.inference_mode():
        for rows in (int(r) for r in (args.rows or "1,2,4,8,16,32").split(",")):
            inputs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in shapes}}
            def step(fns, inputs=inputs):
                for fn, (_, k) in zip(fns, shapes):
                    fn(inputs[k])

            best = timed_interleaved({name: partial(step, fns) for name, fns in kernels.items()}, args.rounds,
                                     warmup=1)
            cells = [f"{best[n]:.1f} ms ({weight_bytes(shapes, n) / best[n] / 1e6:.1f} GB/s)" for n in kernels]
            print(f"| {rows} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
