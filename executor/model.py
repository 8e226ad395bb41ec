"""The Llama-family decoder (Llama incl. SmolLM2, Qwen2, Qwen3) over a paged KV cache.

gpt-fast style: one file, plain modules. Tokens of every sequence in a step
are flattened into one ``[num_tokens]`` dimension with their positions; the
attention backend knows (from ``AttentionMetadata``) which tokens belong to
which sequence and where their KV lives. Differences between the families
are flags on ``ModelConfig``: Qwen2 has q/k/v biases, Qwen3 normalizes q and k
per head and sets ``head_dim`` explicitly, SmolLM2 ties the LM head to the
embedding.
"""
from __future__ import annotations

import functools

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from executor.attention import AttentionBackend, AttentionMetadata, KVCache
from executor.layer_ops import TorchLayerOps
from executor.skinny import GateUpActivation, SkinnyF32Matmul, SkinnyMatmul, bf16_skinny_max_rows

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """config.json describes a model this executor cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # rope_type + its parameters ({} = plain RoPE)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    checkpoint_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        architectures = raw.get("architectures") or [raw.get("model_type", "?")]
        arch = architectures[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window") or (arch == "MistralForCausalLM" and raw.get("sliding_window")):
            raise UnsupportedModel("sliding-window attention is not supported")
        # transformers v5 keeps rope_theta inside rope_parameters; v4 has it top level
        # and Llama-3 scaling under rope_scaling. Merge both spellings.
        rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModel(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling={"rope_type": rope_type, **rope} if rope_type != "default" else {},
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            o_bias=arch != "Qwen2ForCausalLM" and raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            checkpoint_dtype=str(dtype).removeprefix("torch."),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UnsupportedModel(f"cannot read {path}: {exc}") from exc
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            raise UnsupportedModel(f"{path} lacks {exc.args[0]!r}") from exc

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2], with linear or Llama-3 scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated (transformers' _compute_llama3_parameters).
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(config: ModelConfig, max_len: int, device: torch.device) -> torch.Tensor:
    """cos and sin for every position: [max_len, 2, head_dim] float32 (halves duplicated, as HF)."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()), dim=1).to(device)


def cpu_weight_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN pre-packed bf16 linears: CPU only, where this torch build has the op and the CPU runs it."""
    return device.type == "cpu" and dtype == torch.bfloat16 and cpu_packs_bf16()


@functools.cache
def cpu_packs_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively: oneDNN's bf16 packing needs AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT, and raises on an AVX2-only CPU (where bf16 is emulated, many times
    slower than float32). Asked of the op itself, once: the CPU's feature flags are not exposed
    alike by every torch build."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(32, 32, dtype=torch.bfloat16), 32)
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight in oneDNN's blocked layout, so that matmuls skip the re-packing F.linear does per call."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(GateUpActivation, nn.Linear):
    """nn.Linear whose bf16 weight can be pre-packed on the CPU: for oneDNN (F.linear re-packs the
    weight into oneDNN's blocked layout on every call, ``packed_weight`` is that layout made once)
    and, for decode steps of a few tokens, for ``SkinnyMatmul`` (executor/skinny.py). Once packed
    the unpacked weight is released (``weight`` is None, ``release_unpacked_weights``): nothing
    reads it, and it would be one copy more. ``decode_step``: every sequence of the step computes
    one token. Prompt tokens always take oneDNN, however few are left after a prefix-cache hit, so
    that a prompt's rounding (and a greedy answer at a near-tie) does not depend on how much of it
    was cached — except where the CPU has AMX bf16 tiles, where ``SkinnyMatmul`` takes every step
    (its kernels sum each row alike at any row count; oneDNN's copy released; the MLP's gate_up
    applies the SiLU to the prompt kernel's sums, ``GateUpActivation``), and a float32 model's
    ``SkinnyF32Matmul``, which takes every step (its float32 weight released)."""

    packed_weight: torch.Tensor | None = None
    skinny: SkinnyMatmul | SkinnyF32Matmul | None = None

    def forward(self, x: torch.Tensor, decode_step: bool = False) -> torch.Tensor:
        if self.skinny is not None and self.skinny.takes(x, decode_step):
            return self.skinny(x, self.bias)
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm; with ``residual`` given, of ``x + residual``, returning that sum too (the
    residual stream's next value), so that the add and the norm are one op."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ops: TorchLayerOps, residual: torch.Tensor | None = None):
        # x, residual: [num_tokens, dim] → normed [num_tokens, dim] (and x + residual when given)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        # q, k and v in one matmul: [q_size + 2 * kv_size, hidden].
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.scale = config.head_dim**-0.5

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        # x: [num_tokens, hidden]; cos_sin: [num_tokens, 2, head_dim]
        c = self.config
        ops = backend.layer_ops
        num_tokens = x.shape[0]
        heads = c.num_heads + 2 * c.num_kv_heads
        decode_step = meta.step_kind
        qkv = self.qkv_proj(x, decode_step).view(num_tokens, heads, c.head_dim)  # [num_tokens, q heads + k heads + v heads, head_dim]
        if c.qk_norm:
            q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)
            qkv = torch.cat((self.q_norm(q.reshape(-1, c.head_dim), ops).view(q.shape),
                             self.k_norm(k.reshape(-1, c.head_dim), ops).view(k.shape), v), dim=1)
        qk, v = qkv.split([c.num_heads + c.num_kv_heads, c.num_kv_heads], dim=1)
        # RoPE on q and k heads together, in place: one op instead of two.
        ops.rotary_embedding_(qk, cos_sin)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        backend.write_kv(kv_cache, k, v, meta.slot_mapping)
        out = backend.attend(q, kv_cache, meta, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, c.q_size), decode_step)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        # gate and up in one matmul: [2 * intermediate, hidden].
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, ops: TorchLayerOps, decode_step: bool = False) -> torch.Tensor:
        # x: [num_tokens, hidden] → [num_tokens, hidden]
        return self.down_proj(self.gate_up_proj.silu_and_mul(x, ops, decode_step), decode_step)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos_sin, kv_cache, meta, backend):
        # x: [num_tokens, hidden], the previous layer's output not yet added to ``residual``
        # (None at the first layer) → (this layer's output, the residual stream before it)
        ops = backend.layer_ops
        if residual is None:
            residual, x = x, self.input_layernorm(x, ops)
        else:
            x, residual = self.input_layernorm(x, ops, residual)
        x = self.self_attn(x, cos_sin, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(x, ops, residual)
        return self.mlp(x, ops, meta.step_kind), residual


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # An explicit weight skips the random init: on the meta device its normal_ goes through
        # torch._refs, whose first use imports torch._dynamo (3 s of every executor's start).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope_cache: torch.Tensor | None = None  # [max_len, 2, head_dim], set by setup_rope
        self.packed_lm_head: torch.Tensor | None = None  # set by pack_weights_for_cpu
        self.skinny_lm_head: SkinnyMatmul | SkinnyF32Matmul | None = None  # set by use_skinny_matmuls
        self.fused_decode = None  # a FusedDecodeLayers (executor/decode_layer.py), set by the loader
        # set by quantize_model (executor/quantization.py): an int8 head for every step, in place of both
        self.quantized_lm_head = None

    def setup_rope(self, max_len: int) -> None:
        device = self.embed_tokens.weight.device
        self.rope_cache = rope_cos_sin(self.config, max_len, device).to(self.embed_tokens.weight.dtype)

    def pack_weights_for_cpu(self) -> None:
        """Pre-packs every float projection and the LM head for oneDNN (bf16 on the CPU only);
        quantized projections (executor/quantization.py) are not ``Linear`` and keep their own layout."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.packed_weight = pack_weight(module.weight)
        if self.quantized_lm_head is None:
            self.packed_lm_head = pack_weight(self.lm_head_weight())

    def use_skinny_matmuls(self, cpu_ops) -> None:
        """Gives every oneDNN-packed projection and the LM head a ``SkinnyMatmul`` (``cpu_ops``:
        ``torch.ops.kvserve_cpu``) for decode steps of as few tokens as it is faster for
        (``bf16_skinny_max_rows``)."""
        max_rows = bf16_skinny_max_rows(cpu_ops)
        for module in self.modules():
            if isinstance(module, Linear) and module.packed_weight is not None and SkinnyMatmul.fits(module.weight):
                module.skinny = SkinnyMatmul(cpu_ops, module.weight, max_rows)
                if module.skinny.takes_every_step:
                    module.packed_weight = None  # oneDNN never runs for it
        if self.packed_lm_head is not None and SkinnyMatmul.fits(self.lm_head_weight()):
            self.skinny_lm_head = SkinnyMatmul(cpu_ops, self.lm_head_weight(), max_rows)
            if self.skinny_lm_head.takes_every_step:
                self.packed_lm_head = None

    def use_skinny_f32_matmuls(self, cpu_ops) -> None:
        """Gives every float32 projection and the LM head whose values are all bf16 a
        ``SkinnyF32Matmul`` for every step: a float32 model on a CPU without native bf16 reads the
        checkpoint's bf16 weights in half the bytes. The projections' float32 weights are dropped
        (nothing reads them); the LM head's matrix stays (tied, it is the embedding table)."""
        for module in self.modules():
            if isinstance(module, Linear) and SkinnyF32Matmul.fits(module.weight):
                module.skinny = SkinnyF32Matmul(cpu_ops, module.weight)
                module.weight = None
        if self.quantized_lm_head is None and SkinnyF32Matmul.fits(self.lm_head_weight()):
            self.skinny_lm_head = SkinnyF32Matmul(cpu_ops, self.lm_head_weight())

    def release_unpacked_weights(self) -> None:
        """Drops each oneDNN-packed projection's plain weight once every layout is made from it. The
        LM head's matrix is not a ``Linear`` and stays (tied, it is the embedding table)."""
        for module in self.modules():
            if isinstance(module, Linear) and (module.packed_weight is not None or module.skinny is not None):
                module.weight = None

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        # token_ids, positions: [num_tokens] int64 → hidden states [num_tokens, hidden] (final-normed)
        x = self.embed_tokens(token_ids)
        # index_select, not indexing: on the CPU torch's advanced indexing opens an OpenMP region
        # (wakes every thread and joins them) at any size, here a few KiB once a step.
        cos_sin = self.rope_cache.index_select(0, positions)  # [num_tokens, 2, head_dim]
        residual = None
        fused = self.fused_decode
        step = fused.step_inputs(x, meta, kv_caches[0], backend) if fused is not None else None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if step is not None:
                x, residual = fused(index, x, residual, cos_sin, kv_cache, step)
            else:
                x, residual = layer(x, residual, cos_sin, kv_cache, meta, backend)
        normed, _ = self.norm(x, backend.layer_ops, residual)
        return normed

    def compute_logits(self, hidden: torch.Tensor, decode_step: bool = False) -> torch.Tensor:
        # hidden: [num_sampled, hidden] → logits [num_sampled, vocab] in the head's dtype (widened by
        # whoever needs float32: the compiled greedy pick reads bf16 as it is); decode_step as Linear's
        if self.quantized_lm_head is not None:
            return self.quantized_lm_head(hidden, None)
        if self.skinny_lm_head is not None and self.skinny_lm_head.takes(hidden, decode_step):
            return self.skinny_lm_head(hidden, None)
        if self.packed_lm_head is not None:
            return packed_linear(hidden, self.packed_lm_head, None)
        return F.linear(hidden, self.lm_head_weight())
