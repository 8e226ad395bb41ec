"""The decode attention kernel alone, on the CPU backend's KV layout and on the head-major one it
replaced, at the model's shapes, on this machine.

    python -m bench.attention_bench [--model DIR] [--cases 1x512,20x512,32x1024] [--threads 1]
        [--query-dtype bfloat16|float32] [--kv-dtype bfloat16|float32|int8]

For each (batch, context) case, ``paged_decode_attention`` runs over one layer's worth of caches
at a time, cycling through enough layers that their K/V (over 512 MiB) cannot stay in the CPU's
caches, as in a real step where 30 layers' K/V pass through once. Block tables are either
consecutive block ids (a fresh prompt's blocks) or shuffled ones (blocks handed out, freed and
reused by many sequences). The same kernel reads both layouts (it takes any block and head
stride): *block-major* is the backend's ``[num_blocks, kv_heads, tile]`` (K and V apart), where
one block's tiles for every head lie side by side; *head-major* is ``[kv_heads, num_blocks, tile]``,
where each (head, block) tile is a 2 KiB island. The layouts run in turn, round after round, and
the best of ``--rounds`` is kept. GB/s is K/V bytes attended per second. ``--query-dtype float32``
with the default bf16 K/V is a float32 model's bf16 cache (the default where the CPU has no native
bf16); ``--kv-dtype float32`` its float32 cache; ``--kv-dtype int8`` the int8 cache
(``--kv-cache-dtype int8``: each tile's codes, then its 16 per-token float32 scales) read by
``paged_decode_attention_int8``, GB/s counting those records' bytes.
"""
from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from bench.timing import timed_interleaved
from executor.attention.cpu_backend import int8_record_bytes
from executor.attention.csrc_loader import csrc_build_script
from executor.model import ModelConfig
from kvserve.paths import default_model_dir

BLOCK = 16
CACHE_BYTES = 512 << 20  # K/V of all cycled layers together: beyond any CPU's last-level cache


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        batch, ctx = item.lower().split("x")
        cases.append((int(batch), int(ctx)))
    return cases


def int8_records(shape: tuple[int, ...], head_size: int, generator: torch.Generator) -> torch.Tensor:
    """Int8 cache records of ``shape`` + (record,): random codes, then 16 positive float32 scales."""
    codes = torch.randint(-127, 128, (*shape, BLOCK * head_size), generator=generator, dtype=torch.int8)
    scales = (torch.rand(*shape, BLOCK, generator=generator) * 0.02 + 0.001).view(torch.int8)
    return torch.cat([codes, scales], dim=-1)


def layer_caches(layout: str, num_blocks: int, kv_heads: int, head_size: int, generator: torch.Generator,
                 dtype: torch.dtype = torch.bfloat16):
    """One layer's (K, V) as the kernel's views [num_blocks, kv_heads, ...] of ``layout``: 4-d tiles,
    or for int8 3-d records."""
    if dtype == torch.int8:
        if layout == "block-major":
            return (int8_records((num_blocks, kv_heads), head_size, generator),
                    int8_records((num_blocks, kv_heads), head_size, generator))
        return (int8_records((kv_heads, num_blocks), head_size, generator).transpose(0, 1),
                int8_records((kv_heads, num_blocks), head_size, generator).transpose(0, 1))
    if layout == "block-major":
        return (torch.randn(num_blocks, kv_heads, head_size, BLOCK, generator=generator).to(dtype),
                torch.randn(num_blocks, kv_heads, BLOCK, head_size, generator=generator).to(dtype))
    keys = torch.randn(kv_heads, num_blocks, head_size, BLOCK, generator=generator).to(dtype)
    values = torch.randn(kv_heads, num_blocks, BLOCK, head_size, generator=generator).to(dtype)
    return keys.transpose(0, 1), values.transpose(0, 1)


def block_tables(batch: int, ctx: int, num_blocks: int, order: str, generator: torch.Generator) -> torch.Tensor:
    per_seq = -(-ctx // BLOCK)
    if order == "consecutive":
        ids = torch.arange(batch * per_seq) + 1
    else:
        ids = torch.randperm(num_blocks - 1, generator=generator)[: batch * per_seq] + 1
    return ids.view(batch, per_seq).to(torch.int32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attention_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--cases", type=parse_cases, default=parse_cases("1x512,20x512,32x1024"),
                        help="batch x context pairs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--query-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the queries' dtype: the model's (float32 where the CPU has no native bf16)")
    parser.add_argument("--kv-dtype", choices=("bfloat16", "float32", "int8"), default="bfloat16", help="the cache's")
    args = parser.parse_args(argv)
    query_dtype, kv_dtype = getattr(torch, args.query_dtype), getattr(torch, args.kv_dtype)
    torch.set_num_threads(args.threads)
    ops = csrc_build_script().load_cpu()
    config = ModelConfig.from_dir(args.model)
    kv_heads, head_size, num_heads = config.num_kv_heads, config.head_dim, config.num_heads
    scale = head_size ** -0.5
    generator = torch.Generator().manual_seed(0)
    print(f"paged_decode_attention, {config.architecture} shapes ({num_heads} heads, {kv_heads} KV heads, "
          f"head_size {head_size}), {args.query_dtype} queries, {args.kv_dtype} K/V, {args.threads} thread(s), "
          f"best of {args.rounds}; ms per layer")
    print("| batch x context | block order | head-major | block-major | speed-up |")
    print("|---|---|---:|---:|---:|")
    for batch, ctx in args.cases:
        per_seq = -(-ctx // BLOCK)
        num_blocks = max(1 + batch * per_seq, 4096)
        # bytes of one (block, KV head) tile of K or V as the cache holds it
        tile_bytes = int8_record_bytes(BLOCK, head_size) if kv_dtype == torch.int8 else \
            BLOCK * head_size * kv_dtype.itemsize
        layer_bytes = num_blocks * 2 * kv_heads * tile_bytes
        num_layers = max(2, -(-CACHE_BYTES // layer_bytes))
        attended = batch * ctx * 2 * kv_heads * tile_bytes // BLOCK
        query = torch.randn(batch, num_heads, head_size, generator=generator).to(query_dtype)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        for order in ("consecutive", "shuffled"):
            tables = block_tables(batch, ctx, num_blocks, order, generator)
            layers = {layout: [layer_caches(layout, num_blocks, kv_heads, head_size, generator, kv_dtype)
                               for _ in range(num_layers)] for layout in ("head-major", "block-major")}
            attend = ops.paged_decode_attention_int8 if kv_dtype == torch.int8 else ops.paged_decode_attention

            def every_layer(caches, query=query, tables=tables, lens=lens):
                for key_cache, value_cache in caches:
                    attend(query, key_cache, value_cache, tables, lens, scale)

            best = {layout: ms / num_layers for layout, ms in timed_interleaved(
                {layout: partial(every_layer, caches) for layout, caches in layers.items()}, args.rounds,
                warmup=0).items()}
            cells = [f"{best[layout]:.3f} ({attended / best[layout] / 1e6:.1f} GB/s)" for layout in layers]
            print(f"| {batch} x {ctx} | {order} | {cells[0]} | {cells[1]} | "
                  f"{best['head-major'] / best['block-major']:.2f}x |", flush=True)
            del layers
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
