"""Few-row matmuls for decode steps on the CPU (``csrc/cpu/skinny_linear.cpp``, ``skinny_quantized.cpp``).

With up to a handful of tokens a step, a projection is bound by reading its weights, not by
arithmetic. oneDNN's packed bf16 matmul and torch's int4 kernel read them well below the rate one
core can stream memory; these layouts make each projection one sequential read (docs/executor.md
has the measurements). Beyond a few tokens (``bf16_skinny_max_rows``) the step is compute-bound and
the usual kernel (oneDNN's GEMM) runs instead, so both layouts are kept — except where the CPU has
AMX bf16 tiles: there the bf16 layout serves every step (``prompt_linear_bf16`` beyond a few rows)
and oneDNN's copy is dropped. The quantized layouts serve every
step: torch's CPU int8 and int4 matmuls, which they replace, are slower at any batch measured.
"""
from __future__ import annotations

import torch

from executor.attention.base import StepKind

# Up to this many rows (tokens of a step) the bf16 skinny kernel beats oneDNN's bf16 GEMM;
# measured on AVX512-BF16 (Zen 4, two threads, a decode step's matmuls, two runs): 10.2 vs 14.8 ms at
# 8 rows, 13.7 vs 19.5 at 16, 22.5 vs 29.1 at 32, 42.1-42.2 vs 49.3-52.0 at 64, 82.0-83.6 vs
# 87.5-91.2 at 128, 110.9 vs 108.7 at 160 (docs/executor.md).
SKINNY_MAX_ROWS = 128
# Where the CPU has AMX bf16 tiles both kernels on this layout run on them, with the same bits for a
# row: skinny_linear up to this many rows, prompt_linear_bf16 beyond. A step's 120 projections on an
# Emerald Rapids-class Xeon, two threads (docs/executor.md): 9.0 vs 11.7 ms at 16 rows, 10.0 vs 9.9
# at 32, 13.7 vs 14.8 at 48, 16.4 vs 14.6 at 64, 22.6 vs 19.0 at 96 (oneDNN: 11.7, 13.9, 13.8,
# 16.6, 20.3).
AMX_SKINNY_MAX_ROWS = 48
# skinny_linear_int8 and skinny_linear_int4 quantize activations per token and group of this
# many inputs (executor/quantization.py: quantize_activations_int8 does the same in torch).
INT8_ACTIVATION_GROUP = 32


def bf16_skinny_max_rows(cpu_ops) -> int:
    """Rows of a decode step up to which ``SkinnyMatmul`` beats oneDNN's bf16 GEMM on this CPU."""
    return AMX_SKINNY_MAX_ROWS if cpu_ops.has_amx() else SKINNY_MAX_ROWS


class GateUpActivation:
    """For the projection layers (executor/model.py's ``Linear``, executor/quantization.py's): the
    MLP's activation of their output, from the prompt kernel's sums where their packed matmul
    (``skinny``) fuses it. The layer has ``skinny`` (or None), ``in_features``, ``out_features``,
    ``bias`` and is called as ``layer(x, decode_step)``."""

    def silu_and_mul(self, x: torch.Tensor, ops, decode_step: bool = False) -> torch.Tensor:
        """silu(gate) * up of this layer's output (gate, then up), as ``ops.silu_and_mul(self(x))``."""
        # x: [..., in] → [..., out / 2]
        skinny = self.skinny
        if skinny is not None and skinny.fuses_silu_and_mul(prompt=not decode_step):
            rows = skinny.silu_and_mul(x.reshape(-1, self.in_features), self.bias)
            return rows.view(*x.shape[:-1], self.out_features // 2)
        return ops.silu_and_mul(self(x, decode_step))


class _PackedMatmul:
    """What every packed layout here shares: where the CPU has AMX bf16 tiles, the MLP's gate_up
    projection can take ``silu(gate) * up`` straight from the prompt kernel's sums on steps with
    prompt tokens (``prompt_silu_and_mul_*``, csrc/cpu/prompt_linear.cpp), its output never stored."""

    def __init__(self, cpu_ops, out_features: int, in_features: int, packed: torch.Tensor, prompt_silu_op):
        self.out_features, self.in_features = out_features, in_features
        self.packed = packed
        self.has_prompt_kernel = cpu_ops.has_prompt_linear()
        self._prompt_silu_op = prompt_silu_op

    def fuses_silu_and_mul(self, prompt: bool) -> bool:
        """Whether ``silu_and_mul`` takes this step: prompt steps where the prompt kernel runs, with
        inputs in whole 32-input steps and gate and up each whole tiles of 16 outputs."""
        return prompt and self.has_prompt_kernel and self.in_features % 32 == 0 and self.out_features % 32 == 0

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [rows, in] bf16 → silu(gate) * up [rows, out / 2] bf16, rounded as silu_and_mul of this
        # projection's bf16 output, which is never stored
        return self._prompt_silu_op(x, self.packed, bias, self.out_features // 2)


class SkinnyMatmul(_PackedMatmul):
    """A bf16 weight [out, in] in ``skinny_linear``'s layout (tiles of 16 output rows, input
    columns in pairs): x @ W^T for x of a few rows as one sequential read of the weight. The same
    layout is the AMX tiles' B operand, so ``silu_and_mul`` reads it in place."""

    def __init__(self, cpu_ops, weight: torch.Tensor, max_rows: int = SKINNY_MAX_ROWS):
        super().__init__(cpu_ops, weight.shape[0], weight.shape[1], cpu_ops.pack_skinny_weight(weight.detach()),
                         cpu_ops.prompt_silu_and_mul_bf16)
        self._ops = cpu_ops
        self.max_rows = max_rows  # beyond, oneDNN's GEMM is faster, or on AMX the prompt kernel (bf16_skinny_max_rows)
        # On AMX bf16 tiles every step takes this layout, prompts too: oneDNN's copy is not needed,
        # and a token's projections are the same bits in any step, whatever its size or kind.
        self.takes_every_step = self.has_prompt_kernel and self.in_features % 32 == 0

    def takes(self, x: torch.Tensor, decode_step: bool) -> bool:
        # decode_step: a StepKind, or a bool; a verify step's rows take it however many
        return self.takes_every_step or (
            bool(decode_step) and (x.shape[0] <= self.max_rows or decode_step == StepKind.VERIFY))

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 2 == 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [rows, in] bf16 → [rows, out] bf16
        if self.takes_every_step and x.shape[0] > self.max_rows:
            return self._ops.prompt_linear_bf16(x, self.packed, bias, self.out_features)
        return self._ops.skinny_linear(x, self.packed, bias, self.out_features)


class SkinnyF32Matmul:
    """A float32 weight whose values are all bf16 (a bf16 checkpoint loaded in float32, as on a CPU
    without native bf16) in ``skinny_linear``'s layout, for ``skinny_linear_f32``: float32
    activations times the weights widened in registers, exactly the float32 matmul's products at
    half its weight bytes. It takes every step, prompts too, and the float32 weight is released: on
    an AVX2-only EPYC (python -m bench.matmul_bench --float32, a 135M model's 121 matmuls) it is ahead
    of torch's float32 matmul (MKL) at every size measured, 1 to 2,048 rows, on 1 thread and 2 (the
    table in docs/executor.md). One kernel for every row also keeps a prompt's rounding independent
    of how it was cut into steps."""

    max_rows = None  # any step (FusedDecodeLayers reads it)

    def __init__(self, cpu_ops, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.packed = cpu_ops.pack_skinny_weight(weight.detach().to(torch.bfloat16))
        self._ops = cpu_ops

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Float32 on the CPU, in_features even, and every value exactly a bf16 (nothing is rounded)."""
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.shape[1] % 2:
            return False
        return bool(torch.equal(weight.detach().to(torch.bfloat16).to(torch.float32), weight.detach()))

    def takes(self, x: torch.Tensor, decode_step: bool) -> bool:
        return True  # every step (see the class docstring)

    def fuses_silu_and_mul(self, prompt: bool) -> bool:
        return False  # the fused prompt kernel takes bf16 activations

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [rows, in] float32 → [rows, out] float32
        return self._ops.skinny_linear_f32(x, self.packed, bias, self.out_features)


class _QuantizedSkinnyMatmul(_PackedMatmul):
    """What the int8 and int4 layouts share: decode steps take the skinny kernel, steps with prompt
    tokens the AMX bf16 one where the CPU has it (``csrc/cpu/prompt_linear.cpp``) and the model
    computes in bf16. ``activation_dtype``: the model's, bf16 or float32 (a CPU without native
    bf16, where every step takes the skinny kernel: AVX2's VPMADDUBSW in place of VNNI)."""

    def __init__(self, cpu_ops, codes: torch.Tensor, packed: torch.Tensor, decode_op, prompt_op, prompt_silu_op,
                 activation_dtype: torch.dtype):
        # codes: [out, in]
        super().__init__(cpu_ops, codes.shape[0], codes.shape[1], packed, prompt_silu_op)
        self.has_prompt_kernel = self.has_prompt_kernel and activation_dtype == torch.bfloat16
        self._decode_op, self._prompt_op = decode_op, prompt_op

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, prompt: bool = False) -> torch.Tensor:
        # x: [rows, in] bf16 or float32 → [rows, out] in x's dtype; prompt: the step has prompt tokens
        op = self._prompt_op if prompt and self.has_prompt_kernel else self._decode_op
        return op(x, self.packed, bias, self.out_features)


class SkinnyInt8Matmul(_QuantizedSkinnyMatmul):
    """Per-channel int8 weights (executor/quantization.py's codes and scales) in
    ``skinny_linear_int8``'s layout: per tile of 16 rows, each 4 inputs' 64 codes (+128, unsigned),
    then the scales. x is quantized per token and group of 32 inputs on the way in
    (``quantize_activations_int8``), so that the products are VNNI integer dot products.

    Steps with prompt tokens, where the CPU has AMX bf16 tiles, take ``prompt_linear_int8``
    instead (``csrc/cpu/prompt_linear.cpp``): the same codes expanded to bf16 per tile, times
    unrounded bf16 activations (2x faster at 256-512 rows, docs/executor.md). Prompt tokens take it
    however few there are, so that a prompt's rounding does not depend on how much of it was
    cached (as bf16's take oneDNN)."""

    def __init__(self, cpu_ops, codes: torch.Tensor, scales: torch.Tensor, activation_dtype: torch.dtype):
        # codes: [out, in] int8; scales: [out]
        super().__init__(cpu_ops, codes, cpu_ops.pack_skinny_int8(codes, scales), cpu_ops.skinny_linear_int8,
                         cpu_ops.prompt_linear_int8, cpu_ops.prompt_silu_and_mul_int8, activation_dtype)

    @staticmethod
    def fits(codes: torch.Tensor, scales: torch.Tensor) -> bool:
        return (scales.dtype in (torch.bfloat16, torch.float32) and scales.device.type == "cpu"
                and codes.shape[1] % INT8_ACTIVATION_GROUP == 0)


class SkinnyInt4Matmul(_QuantizedSkinnyMatmul):
    """Group-wise int4 weights (executor/quantization.py's codes, scales and zeros, groups of 32)
    in ``skinny_linear_int4``'s layout: per tile of 16 rows and group, the codes two a byte and the
    group's bf16 scales and zeros, one 320-byte record. x is quantized as for
    ``SkinnyInt8Matmul``, so that the products are VNNI integer dot products with the codes; steps
    with prompt tokens take ``prompt_linear_int4`` where it runs, as int8's (each weight
    ``(c - 8) * scale + zero`` rounded to bf16 per tile)."""

    def __init__(self, cpu_ops, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 activation_dtype: torch.dtype):
        # codes: [out, in] uint8 in [0, 15]; scales, zeros: [out, in / 32] bf16 (whatever activation_dtype)
        super().__init__(cpu_ops, codes, cpu_ops.pack_skinny_int4(codes, scales, zeros), cpu_ops.skinny_linear_int4,
                         cpu_ops.prompt_linear_int4, cpu_ops.prompt_silu_and_mul_int4, activation_dtype)

    @staticmethod
    def fits(device: torch.device, group_size: int) -> bool:
        return device.type == "cpu" and group_size == INT8_ACTIVATION_GROUP
