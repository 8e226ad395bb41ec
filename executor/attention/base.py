"""The interface between the model and an attention backend.

The model runner turns block tables into an ``AttentionMetadata`` once per
step; each layer then calls ``write_kv`` (reshape-and-cache) and ``attend``.
A backend owns its KV cache layout: the torch backend keeps its own, the
native (CUDA/MUSA) backend uses vLLM's
K ``[num_blocks, num_kv_heads, head_size // x, block_size, x]`` and
V ``[num_blocks, num_kv_heads, head_size, block_size]``.
"""
from __future__ import annotations

import enum
import mmap
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.layer_ops import TorchLayerOps

# One layer's cache: (key_cache, value_cache), layout chosen by the backend.
KVCache = tuple[torch.Tensor, torch.Tensor]


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape)``; on the host, over a fresh anonymous mapping instead: the kernel hands
    out its pages already zero at their first write, where ``torch.zeros`` writes every byte of a
    1 GiB cache before the executor can start (a second on two busy cores). The tensor keeps the
    mapping alive; the start's huge-page collapse (``start_huge_pages``) reaches it like the heap."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=dtype).view(shape)


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the paged cache. Sequences are in batch order;
    each sequence's new tokens are contiguous in the flattened token dimension."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset; -1 = do not write
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0 (the null block)
    query_lens_cpu: list[int]  # new tokens per sequence, on the host
    seq_lens_cpu: list[int]  # seq_lens on the host
    max_query_len: int
    max_seq_len: int
    block_size: int
    verify_rows: bool = False  # a verify step's rows (executor.runner.attention_rows)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def step_kind(self) -> StepKind:
        if self.verify_rows:
            return StepKind.VERIFY
        return StepKind.DECODE if self.max_query_len == 1 else StepKind.PROMPT


class StepKind(enum.IntEnum):
    """What the matmuls of a step may choose by (false only for PROMPT, as the bool ``decode_step``
    it replaces): VERIFY rows must each compute the bits a one-row decode step gives, so they take
    the few-row kernels however many there are, where a plain decode step of many rows may take a
    faster GEMM that sums in another order (oneDNN beyond ``executor.skinny.bf16_skinny_max_rows``
    where the CPU has no AMX; with AMX the kernel beyond sums each row as the few-row one does)."""

    PROMPT = 0
    DECODE = 1
    VERIFY = 2


class AttentionBackend(ABC):
    """Paged attention over one layer's KV cache. One instance serves every layer."""

    name: str
    # A compiled greedy pick for this device's float32 logits [rows, vocab] → (token_ids [rows] int64,
    # logprobs [rows] float32), as argmax and log_softmax would give; None: the sampler's torch ops.
    greedy_sample: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    # The device's RMSNorm, RoPE and SiLU·mul (executor/layer_ops.py); stateless, so one instance serves all.
    layer_ops: TorchLayerOps = TorchLayerOps()
    # The device's compiled few-row matmuls for decode steps (executor/skinny.py: the CPU's
    # ``torch.ops.kvserve_cpu``), which the loader gives the model; None: the usual kernels only.
    skinny_matmul_ops = None
    # Whether the cache may hold another float dtype than the model computes in (a float32 model's
    # bf16 cache: ``--kv-cache-dtype bfloat16``): written rounded to it, read widened back.
    reads_other_kv_dtype = False

    @abstractmethod
    def allocate_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """Zero-filled K and V caches for one layer."""

    @abstractmethod
    def write_kv(self, kv_cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Stores new K/V in their slots (slot < 0 skipped).
        key, value: [num_tokens, num_kv_heads, head_size]; slot_mapping: [num_tokens] int64."""

    @abstractmethod
    def attend(self, query: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of each new token over its sequence's cached context
        (which already holds this step's K/V).
        query: [num_tokens, num_heads, head_size] → [num_tokens, num_heads, head_size]."""

    def decode_kernel_inputs(self, meta: AttentionMetadata, kv_cache: KVCache,
                             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step of decode tokens only whose attention the compiled decode kernel takes
        (``paged_decode_attention`` with ``dtype`` queries): the (block_tables, seq_lens) it takes,
        so that a whole layer can run in one compiled call (``decode_layer``); else None."""
        return None

    @abstractmethod
    def copy_blocks(self, kv_caches: list[KVCache], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: block src[i] → dst[i] in every layer. src, dst: [num_pairs] int64."""
