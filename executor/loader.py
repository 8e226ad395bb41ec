"""Loads a Hugging Face model directory into ``Transformer``: safetensors straight into place.

The model is built on the meta device (no random init), materialized empty on
the target device, and every checkpoint tensor is copied into its parameter —
q/k/v into slices of the fused ``qkv_proj``, gate/up into ``gate_up_proj`` —
converting dtype on the way. Sharded checkpoints are read through
``model.safetensors.index.json``. No transformers at run time.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from executor.decode_layer import FusedDecodeLayers
from executor.model import ModelConfig, Transformer, UnsupportedModel, cpu_weight_packing_available
from executor.quantization import check_supported, quantize_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Checkpoint tensors that are derived, not weights.
IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint files: those the shard index names, else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModel(f"{model_dir} has no *.safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise UnsupportedModel(f"missing shards: {', '.join(missing)}")
    return files


def _destinations(model: Transformer) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Checkpoint tensor name → (parameter, start row, end row) it fills."""
    c = model.config
    dest: dict[str, tuple[torch.Tensor, int, int]] = {}

    def whole(name: str, param: torch.Tensor) -> None:
        dest[name] = (param, 0, param.shape[0])

    whole("model.embed_tokens.weight", model.embed_tokens.weight)
    whole("model.norm.weight", model.norm.weight)
    if not c.tie_word_embeddings:
        whole("lm_head.weight", model.lm_head.weight)
    qkv_rows = {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.q_size + c.kv_size),
                "v_proj": (c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)}
    gate_up_rows = {"gate_proj": (0, c.intermediate_size), "up_proj": (c.intermediate_size, 2 * c.intermediate_size)}
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for kind in ("weight", "bias"):
            for proj, (lo, hi) in qkv_rows.items():
                if kind == "weight" or c.qkv_bias:
                    dest[f"{prefix}self_attn.{proj}.{kind}"] = (getattr(attn.qkv_proj, kind), lo, hi)
            for proj, (lo, hi) in gate_up_rows.items():
                if kind == "weight" or c.mlp_bias:
                    dest[f"{prefix}mlp.{proj}.{kind}"] = (getattr(mlp.gate_up_proj, kind), lo, hi)
        whole(f"{prefix}self_attn.o_proj.weight", attn.o_proj.weight)
        if c.o_bias:
            whole(f"{prefix}self_attn.o_proj.bias", attn.o_proj.bias)
        whole(f"{prefix}mlp.down_proj.weight", mlp.down_proj.weight)
        if c.mlp_bias:
            whole(f"{prefix}mlp.down_proj.bias", mlp.down_proj.bias)
        whole(f"{prefix}input_layernorm.weight", layer.input_layernorm.weight)
        whole(f"{prefix}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        if c.qk_norm:
            whole(f"{prefix}self_attn.q_norm.weight", attn.q_norm.weight)
            whole(f"{prefix}self_attn.k_norm.weight", attn.k_norm.weight)
    return dest


def materialize_empty(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Uninitialized storage on ``device`` for every parameter and buffer built on the meta device,
    floating ones in ``dtype``: ``model.to(dtype).to_empty(device)`` without its ``empty_like`` on
    meta tensors, which runs through torch._refs and imports sympy on first use (1 s of a start)."""
    made: dict[int, torch.Tensor] = {}  # a tensor two modules share stays one tensor

    def empty(tensor: torch.Tensor, as_parameter: bool) -> torch.Tensor:
        if id(tensor) not in made:
            kind = dtype if tensor.is_floating_point() else tensor.dtype
            storage = torch.empty(tuple(tensor.shape), dtype=kind, device=device)
            made[id(tensor)] = torch.nn.Parameter(storage, requires_grad=False) if as_parameter else storage
        return made[id(tensor)]

    for module in model.modules():
        for tensors, as_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in tensors.items():
                if tensor is not None:
                    tensors[name] = empty(tensor, as_parameter)


@torch.no_grad()
def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_len: int,
               quantization: str = "none", skinny_ops=None) -> Transformer:
    """Builds the model for ``model_dir`` on ``device`` in ``dtype`` with RoPE tables up to ``max_len``,
    its projections quantized as ``quantization`` says (executor/quantization.py). ``skinny_ops``
    (an attention backend's ``skinny_matmul_ops``) adds the few-row layouts of executor/skinny.py."""
    config = ModelConfig.from_dir(model_dir)
    check_supported(quantization, dtype, device)
    with torch.device("meta"):
        model = Transformer(config)
    materialize_empty(model, dtype, device)
    model.eval().requires_grad_(False)
    dest = _destinations(model)
    loaded: set[str] = set()
    for path in safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if IGNORED_TENSORS.match(name):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # some tied checkpoints store the shared matrix twice
                if name not in dest:
                    raise UnsupportedModel(f"{path.name}: unexpected tensor {name!r} for {config.architecture}")
                param, lo, hi = dest[name]
                tensor = f.get_tensor(name)
                target = param.data[lo:hi]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise UnsupportedModel(f"{name}: shape {tuple(tensor.shape)} in the checkpoint, expected {tuple(target.shape)}")
                target.copy_(tensor)
                loaded.add(name)
    missing = sorted(set(dest) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise UnsupportedModel(f"{model_dir}: checkpoint lacks {shown}")
    model.setup_rope(max_len)
    quantize_model(model, quantization, skinny_ops)
    if cpu_weight_packing_available(dtype, device):
        model.pack_weights_for_cpu()
        if skinny_ops is not None:
            model.use_skinny_matmuls(skinny_ops)
        model.release_unpacked_weights()
    elif skinny_ops is not None and dtype == torch.float32 and device.type == "cpu":
        model.use_skinny_f32_matmuls(skinny_ops)
    if skinny_ops is not None and FusedDecodeLayers.fits(model):
        model.fused_decode = FusedDecodeLayers(skinny_ops, model)
    return model


def model_fingerprint(model_dir: Path) -> str:
    """sha256 (hex) over config.json, tokenizer.json and each safetensors file's name, size and
    header (names, shapes, dtypes, offsets): stable for the same weights, cheap to compute."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json"):
        path = model_dir / name
        digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b""))
    for path in safetensors_files(model_dir):
        with path.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = fh.read(header_len)
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode() + header)
    return digest.hexdigest()


def eos_token_ids(model_dir: Path, config: ModelConfig) -> list[int]:
    """EOS ids from config.json and generation_config.json, in first-seen order."""
    ids = list(config.eos_token_ids)
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        try:
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except ValueError:
            eos = None
        for tid in eos if isinstance(eos, list) else ([] if eos is None else [eos]):
            if tid not in ids:
                ids.append(tid)
    return ids
