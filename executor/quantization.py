"""Quantization of the decoder's projections: ``--quantization none|int8|int4``.

The seven projections of every layer (q/k/v and gate/up fused, o, down) are
replaced after loading; the embedding and the norms stay in the compute dtype,
and on the CPU with the compiled kernels the (tied or separate) LM head gets an
int8 copy (``quantize_lm_head``) used at every step. On the CPU with the compiled
kernels both modes also round each token's activations per group of
``INT8_ACTIVATION_GROUP`` inputs (``quantize_activations_int8``) so that their
products are integer dot products — except steps with prompt tokens on a CPU with
AMX bf16 tiles, which take the activations unrounded (``prompt_linear_*``,
executor/skinny.py); elsewhere (torch's kernels) they are weight-only: the kernels
dequantize weights inside the matmul.

- ``int8``: per output channel, symmetric: ``w ≈ q * scale``, ``q`` in [-127, 127].
  ``torch.ops.aten._weight_int8pack_mm`` (CPU; other devices where this torch has it).
- ``int4``: per group of ``INT4_GROUP_SIZE`` (32) consecutive input features,
  asymmetric — a scale and a minimum per group, the layout of GGUF's Q4_1:
  ``w ≈ q * scale + min``, ``q`` in [0, 15]. The kernels take it as
  ``(q - 8) * scale + zero`` with ``zero = min + 8 * scale``.
  ``_weight_int4pack_mm_for_cpu`` on the CPU, tinygemm's ``_weight_int4pack_mm`` on
  CUDA (bf16 only); elsewhere, or on a torch without the op, start-up refuses. On the
  CPU in bf16 with the compiled kernels, every step takes the same codes in
  executor/skinny.py's layout instead (int4 1.7x torch's kernel at one token, 2x at 256;
  int8 2.9x and 1.5x).

Scales (and int4 zeros) are stored in the compute dtype, as the kernels want, and
the integer codes are rounded against those stored values, so ``dequantize_*``
is exactly what the kernels multiply by. docs/quantization.md has accuracy and speed.
"""
from __future__ import annotations

import torch
from torch import nn

from executor.skinny import INT8_ACTIVATION_GROUP, GateUpActivation, SkinnyInt4Matmul, SkinnyInt8Matmul
from kvserve.logs import get_logger

log = get_logger("executor.quantization")

QUANTIZATION_MODES = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32

# The device type's dispatch key, for asking whether this torch build has a kernel there.
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "musa": "PrivateUse1"}
# (pack op, matmul op) of the weight-only int4 kernels per device type.
_INT4_OPS = {"cpu": ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"),
             "cuda": ("_convert_weight_to_int4pack", "_weight_int4pack_mm")}


class QuantizationUnsupported(ValueError):
    """The asked-for quantization cannot run with this torch build, device, dtype or model."""


def has_kernel(op_name: str, device: torch.device) -> bool:
    """True when this torch build has ``aten::op_name`` and a kernel for it on ``device``'s type."""
    key = _DISPATCH_KEYS.get(device.type)
    return (key is not None and hasattr(torch.ops.aten, op_name)
            and torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op_name}", key))


def check_supported(mode: str, dtype: torch.dtype, device: torch.device) -> None:
    """Raises QuantizationUnsupported (naming the flag's field) unless ``mode`` can run here."""
    if mode not in QUANTIZATION_MODES:
        raise QuantizationUnsupported(f"quantization: {mode!r} is not one of {', '.join(QUANTIZATION_MODES)}")
    if mode == "int8" and not has_kernel("_weight_int8pack_mm", device):
        raise QuantizationUnsupported(f"quantization: int8 needs aten::_weight_int8pack_mm, which this torch "
                                      f"build ({torch.__version__}) lacks on {device.type}")
    if mode == "int4":
        ops = _INT4_OPS.get(device.type)
        if ops is None or not all(has_kernel(op, device) for op in ops):
            wanted = " and ".join(f"aten::{op}" for op in ops) if ops else "a weight-only int4 kernel"
            raise QuantizationUnsupported(f"quantization: int4 is not supported by this torch build "
                                          f"({torch.__version__}) on {device.type}: it needs {wanted}")
        if device.type == "cuda" and dtype != torch.bfloat16:
            raise QuantizationUnsupported(f"quantization: int4 on cuda needs --dtype bfloat16 "
                                          f"(tinygemm's kernel), got {str(dtype).removeprefix('torch.')}")


# ---- the formats ---------------------------------------------------------------------------------
def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] → (codes [out, in] int8, scales [out] in ``scale_dtype``); w ≈ codes * scale."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127).to(scale_dtype)
    inverse = torch.where(scales > 0, 1 / scales.float(), 0.0)
    codes = torch.round(w * inverse[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(codes [out, in] int8, scales [out]) → weight [out, in] float32."""
    return codes.float() * scales.float()[:, None]


def quantize_activations_int8(x: torch.Tensor, group_size: int = INT8_ACTIVATION_GROUP) -> torch.Tensor:
    """What the compiled int8 kernel multiplies the weights by: x [rows, in] with each row's groups of
    ``group_size`` inputs rounded to 255 levels, ``round(x / s) * s`` with ``s = max|x| / 127``
    (ties to even, float32), as float32 [rows, in]."""
    rows, in_features = x.shape
    groups = x.float().reshape(rows, in_features // group_size, group_size)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    # Tensors divided by tensors: one rounding each, as the kernel's divisions (torch turns a
    # division by a scalar into a product with its reciprocal, two roundings, which can move a
    # code at a tie).
    scale = amax / torch.full_like(amax, 127.0)
    codes = torch.round(groups / torch.where(amax > 0, scale, 1.0)).clamp_(-127, 127)
    return (codes * scale).reshape(rows, in_features)


def quantize_int4(weight: torch.Tensor, scale_dtype: torch.dtype,
                  group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] → (codes [out, in] uint8 in [0, 15], scales [out, in / group], zeros [out, in / group]),
    scales and zeros in ``scale_dtype``; w ≈ (codes - 8) * scale + zero, per group of ``group_size`` inputs."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).to(scale_dtype)
    zeros = (low + 8 * scales.float()).to(scale_dtype)
    inverse = torch.where(scales > 0, 1 / scales.float(), 0.0)
    codes = torch.round((groups - zeros.float()[..., None]) * inverse[..., None]) + 8
    return codes.clamp_(0, 15).to(torch.uint8).reshape(out_features, in_features), scales, zeros


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int = INT4_GROUP_SIZE) -> torch.Tensor:
    """(codes [out, in] in [0, 15], scales and zeros [out, in / group]) → weight [out, in] float32."""
    out_features, in_features = codes.shape
    groups = codes.float().reshape(out_features, in_features // group_size, group_size) - 8
    return (groups * scales.float()[..., None] + zeros.float()[..., None]).reshape(out_features, in_features)


# ---- the layers ----------------------------------------------------------------------------------
class Int8Linear(GateUpActivation, nn.Module):
    """A linear layer with per-channel int8 weights; same inputs and outputs as the float one.
    With ``skinny_ops`` (and bf16 scales on the CPU, in_features a multiple of 32) every step
    takes executor/skinny.py's kernels, and torch's copy is not kept: decode steps the VNNI / AMX
    int8 kernel on int8-rounded activations (its rows round alike at any batch size), steps with
    prompt tokens (``decode_step`` False) its AMX bf16 one where the CPU has it."""

    def __init__(self, linear: nn.Linear, skinny_ops=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, scales = quantize_int8(linear.weight.detach(), linear.weight.dtype)
        self.bias = linear.bias
        self.skinny = (SkinnyInt8Matmul(skinny_ops, codes, scales, linear.weight.dtype)
                       if skinny_ops is not None and SkinnyInt8Matmul.fits(codes, scales) else None)
        keep = self.skinny is None
        self.register_buffer("codes", codes if keep else None)  # [out, in] int8
        self.register_buffer("scales", scales if keep else None)  # [out], compute dtype

    def forward(self, x: torch.Tensor, decode_step: bool = False) -> torch.Tensor:
        # x: [..., in] → [..., out]
        rows = x.reshape(-1, self.in_features)
        if self.skinny is not None:
            return self.skinny(rows, self.bias, prompt=not decode_step).view(*x.shape[:-1], self.out_features)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


class Int4Linear(GateUpActivation, nn.Module):
    """A linear layer with group-wise int4 weights, packed once for the device's kernel. With
    ``skinny_ops``, as ``Int8Linear``: executor/skinny.py's layout only (2x torch's CPU kernel)."""

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE, skinny_ops=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = group_size
        weight = linear.weight.detach()
        device = weight.device
        # The CPU kernel's records hold bf16 scales and zeros, whatever the model computes in.
        skinny = skinny_ops is not None and SkinnyInt4Matmul.fits(device, group_size)
        codes, scales, zeros = quantize_int4(weight, torch.bfloat16 if skinny else weight.dtype, group_size)
        self.bias = linear.bias
        self.skinny = SkinnyInt4Matmul(skinny_ops, codes, scales, zeros, weight.dtype) if skinny else None
        packed = scales_and_zeros = None
        if self.skinny is None:
            pack_op, mm_op = _INT4_OPS[device.type]
            self._mm = getattr(torch.ops.aten, mm_op)
            if device.type == "cpu":
                packed = getattr(torch.ops.aten, pack_op)(codes.to(torch.int32), 1)  # [out, in / 2] uint8
            else:
                # tinygemm takes two codes per byte, the even input feature in the high nibble.
                pairs = (codes[:, ::2] << 4) | codes[:, 1::2]  # [out, in / 2] uint8
                packed = getattr(torch.ops.aten, pack_op)(pairs, _inner_k_tiles(self.in_features))
            # [in / group, out, 2]: (scale, zero) per group and output, as both kernels read them.
            scales_and_zeros = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def forward(self, x: torch.Tensor, decode_step: bool = False) -> torch.Tensor:
        # x: [..., in] → [..., out]
        rows = x.reshape(-1, self.in_features)
        if self.skinny is not None:
            return self.skinny(rows, self.bias, prompt=not decode_step).view(*x.shape[:-1], self.out_features)
        out = self._mm(rows, self.packed, self.group_size, self.scales_and_zeros)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def _inner_k_tiles(in_features: int) -> int:
    """tinygemm's innerKTiles: the largest of 8, 4, 2 with ``in_features`` a multiple of 16 times it."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (16 * tiles) == 0)


def check_shapes(mode: str, linears: dict[str, nn.Linear], device: torch.device) -> None:
    """Raises QuantizationUnsupported naming the first projection the int4 kernels cannot take."""
    if mode != "int4":
        return
    out_multiple, in_multiple = (16, INT4_GROUP_SIZE) if device.type == "cpu" else (8, 32)
    for name, linear in linears.items():
        if linear.out_features % out_multiple or linear.in_features % in_multiple:
            raise QuantizationUnsupported(
                f"quantization: int4 needs out_features % {out_multiple} == 0 and in_features % {in_multiple} == 0 "
                f"on {device.type}; {name} is [{linear.out_features}, {linear.in_features}]")


def quantize_lm_head(model: nn.Module, skinny_ops) -> int:
    """Gives ``model`` an int8 LM head (``SkinnyInt8Matmul``, every step) where the CPU kernels take
    it, as the quantized checkpoints of the peers have (llama.cpp's Q4_1 GGUF: a Q8_0 head;
    OpenVINO's int8 export: int8); the bf16 matrix stays for the embedding. Returns its bytes."""
    weight = model.lm_head_weight()
    if skinny_ops is None:
        return 0
    codes, scales = quantize_int8(weight.detach(), weight.dtype)
    if not SkinnyInt8Matmul.fits(codes, scales):
        return 0
    model.quantized_lm_head = SkinnyInt8Matmul(skinny_ops, codes, scales, weight.dtype)
    if not model.config.tie_word_embeddings:
        model.lm_head = None  # nothing else reads a separate head's matrix
    return model.quantized_lm_head.packed.nbytes


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, skinny_ops=None) -> int:
    """Replaces the projections of every decoder layer of ``model`` (a ``Transformer``) by their
    ``mode`` form, in place (the float weights are dropped). Returns the bytes they now take.
    ``skinny_ops``: as ``load_model``'s, for the few-row layouts of executor/skinny.py."""
    if mode == "none":
        return 0
    projections = [(f"layers.{i}.{part}.{attr}", getattr(layer, part), attr)
                   for i, layer in enumerate(model.layers)
                   for part, attr in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                                      ("mlp", "gate_up_proj"), ("mlp", "down_proj"))]
    device = model.embed_tokens.weight.device
    check_supported(mode, model.embed_tokens.weight.dtype, device)
    check_shapes(mode, {name: getattr(parent, attr) for name, parent, attr in projections}, device)
    total = quantize_lm_head(model, skinny_ops)
    for _, parent, attr in projections:  # one at a time, so that each float weight is freed as it goes
        linear = getattr(parent, attr)
        replacement = (Int8Linear if mode == "int8" else Int4Linear)(linear, skinny_ops=skinny_ops)
        setattr(parent, attr, replacement)
        skinny = getattr(replacement, "skinny", None)
        total += sum(b.nbytes for b in replacement.buffers()) + (skinny.packed.nbytes if skinny is not None else 0)
    if device.type == "cpu" and skinny is None:
        # Measured on an AVX2-only EPYC (float32 compute, one thread, a 1536 x 576 projection at 27
        # rows): torch's int8 kernel 66 ms, the float32 matmul 4 ms.
        log.warning("quantization_slower_than_none", mode=mode, dtype=str(model.embed_tokens.weight.dtype),
                    reason="the compiled int8/int4 kernels are not built here; torch's kernels run instead, "
                           "several times slower than --quantization none at more than one row a step")
    return total
