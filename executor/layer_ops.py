"""The elementwise ops between a decoder layer's matmuls: RMSNorm (with the residual add
folded in), RoPE and SiLU·mul.

``TorchLayerOps`` is plain torch on any device and the reference the compiled versions are
tested against. ``CpuLayerOps`` runs ``csrc/cpu/layer_ops.cpp``: one pass per op instead of
~35 small torch kernels a layer (docs/executor.md has what it saves). An attention backend
names the layer ops of its device (``AttentionBackend.layer_ops``), as it does its
greedy sampler.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchLayerOps:
    """The ops in torch, rounding as transformers' Llama does."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # x: [num_tokens, hidden] → [num_tokens, hidden]; normalized in float32 and cast back
        # before the weight multiply, exactly as transformers does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [num_tokens, hidden] → (rms_norm(x + residual), x + residual)
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def rotary_embedding_(self, x: torch.Tensor, cos_sin: torch.Tensor) -> None:
        # x: [num_tokens, heads, head_dim], rotated in place; cos_sin: [num_tokens, 2, head_dim]
        cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]  # [num_tokens, 1, head_dim], broadcast over heads
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [num_tokens, 2 * intermediate] → [num_tokens, intermediate]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuLayerOps(TorchLayerOps):
    """The same ops compiled for the CPU (``torch.ops.kvserve_cpu``); tensors must be on the CPU."""

    def __init__(self, ops):
        self._ops = ops

    def rms_norm(self, x, weight, eps):
        return self._ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self._ops.add_rms_norm(x, residual, weight, eps)

    def rotary_embedding_(self, x, cos_sin):
        self._ops.rotary_embedding_(x, cos_sin)

    def silu_and_mul(self, gate_up):
        return self._ops.silu_and_mul(gate_up)
