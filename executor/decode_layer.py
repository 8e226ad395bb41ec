"""A decoder layer of a decode step in one compiled call on the CPU (``csrc/cpu/decode_layer.cpp``).

At one token a step, the Python around a layer's dozen kernels (module calls, views, the attention
backend's dispatch) cost about half what the kernels did on a 2-core AVX2 EPYC. ``decode_layer``
runs the same kernels in the same order from C++, so a step gives the same bits either way. It takes
the layers whose projections all have a few-row layout (``SkinnyMatmul`` in bf16,
``SkinnyF32Matmul`` in float32, the int8 and int4 ones in either), without q/k norms, and steps of
decode tokens only (any number but for bf16's row limit), whose attention the compiled decode kernel runs
(``AttentionBackend.decode_kernel_inputs``: over a float cache or the int8 cache's records); every
other step runs ``DecoderLayer`` as before.
"""
from __future__ import annotations

import torch

from executor.attention.base import AttentionMetadata, AttentionBackend, KVCache
from executor.skinny import SkinnyF32Matmul, SkinnyInt4Matmul, SkinnyInt8Matmul, SkinnyMatmul

# All but bf16's take decode steps of any size (the quantized ones have no other kernel, the float32
# one is ahead of torch's float32 matmul at any size measured).
FEW_ROW_LAYOUTS = (SkinnyMatmul, SkinnyF32Matmul, SkinnyInt8Matmul, SkinnyInt4Matmul)


def projections(layer) -> tuple:
    """A decoder layer's four projections, in the order ``decode_layer`` takes them."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


class FusedDecodeLayers:
    """The model's layers as ``decode_layer``'s arguments, gathered once at load."""

    def __init__(self, cpu_ops, model):
        c = model.config
        self._op = cpu_ops.decode_layer
        self.sizes = [c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size]
        self.eps = c.rms_norm_eps
        self.layers = []
        for layer in model.layers:
            qkv, o, gate_up, down = (p.skinny.packed for p in projections(layer))
            weights = [layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down]
            self.layers.append((weights, [p.bias for p in projections(layer)], layer.self_attn.scale))
        self.max_rows = min((p.skinny.max_rows for layer in model.layers for p in projections(layer)
                             if isinstance(p.skinny, SkinnyMatmul)), default=None)

    @staticmethod
    def fits(model) -> bool:
        """Every layer's four projections have one few-row layout, and no q/k norm."""
        if model.config.qk_norm:
            return False
        kinds = {type(getattr(p, "skinny", None)) for layer in model.layers for p in projections(layer)}
        return len(kinds) == 1 and issubclass(kinds.pop(), FEW_ROW_LAYOUTS)

    def step_inputs(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                    backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(block_tables, seq_lens, slot_mapping) when this step takes ``decode_layer``, else None."""
        if self.max_rows is not None and x.shape[0] > self.max_rows and not meta.verify_rows:
            return None
        attention = backend.decode_kernel_inputs(meta, kv_cache, x.dtype)
        return None if attention is None else (*attention, meta.slot_mapping)

    def __call__(self, index: int, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor,
                 kv_cache: KVCache, step: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        # x: [num_tokens, hidden] → (layer output, residual stream before it), as DecoderLayer.forward
        weights, biases, scale = self.layers[index]
        block_tables, seq_lens, slot_mapping = step
        return self._op(x, residual, weights, biases, kv_cache[0], kv_cache[1], block_tables, seq_lens,
                        slot_mapping, cos_sin, self.sizes, self.eps, scale)
