"""Executor step times against transformers with its static cache, on this machine.

    python -m bench.executor_bench [--model DIR] [--dtype bfloat16] [--steps 10]

Decode step time at batch 1, 8, 32 × context 128, 1024, and a 512-token prefill, for
this executor called in-process, over gRPC (a real ``python -m executor`` process),
and for transformers (eager, ``StaticCache`` sized to the context, the same
greedy pick of the next token). Each decode step attends over ``context`` cached
positions, which prefills wrote first (``write_contexts``: unwritten pool pages would be
read from cache, not memory; transformers' cache is zeroed, written).
The three run in turn, round after round, and the best of ``--steps``
rounds is kept: on a shared machine the minimum is the least disturbed number.
"gRPC transport" is the median of (client wall time - the server's own ``timings.total_ms``)
per call: what the RPC adds, apart from the server process computing the same step.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import grpc
import torch

from bench.timing import timed_interleaved
from executor.devices import tune_host_allocator
from executor.layer_ops import TorchLayerOps
from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from kvserve.health import wait_until_serving
from kvserve.paths import default_model_dir
from kvserve.v1 import executor_pb2 as pb
from kvserve.v1 import executor_pb2_grpc

DECODE_CASES = [(b, ctx) for ctx in (128, 1024) for b in (1, 8, 32)]
PREFILL_TOKENS = 512
BLOCK = 16


def decode_batch(batch: int, ctx: int) -> list[SequenceInput]:
    """``batch`` sequences, each decoding its token at position ``ctx`` over ``ctx`` cached ones."""
    blocks = -(-(ctx + 1) // BLOCK)
    return [SequenceInput(i, [100 + i], ctx, list(range(1 + i * blocks, 1 + (i + 1) * blocks)), sample=True)
            for i in range(batch)]


def prefill_batch() -> list[SequenceInput]:
    tokens = [(17 * i) % 40000 + 100 for i in range(PREFILL_TOKENS)]
    return [SequenceInput(0, tokens, 0, list(range(1, 1 + PREFILL_TOKENS // BLOCK)), sample=True)]


def num_blocks_needed() -> int:
    return 1 + max(b * -(-(ctx + 1) // BLOCK) for b, ctx in DECODE_CASES)


def context_prefills(batch: int, ctx: int) -> list[SequenceInput]:
    """One prefill per sequence of ``decode_batch(batch, ctx)`` that writes K/V into every block it
    reads (and so into those of every smaller case). The executor's pool is a fresh anonymous mapping
    whose untouched pages all read as the kernel's one zero page: a decode step over them reads cache,
    not memory, and 32 sequences at context 1024 took 50 ms a step there against 71 over written
    blocks (AMX Xeon, 2 threads)."""
    blocks = -(-(ctx + 1) // BLOCK)
    tokens = [(7 * j) % 40000 + 100 for j in range(blocks * BLOCK)]
    return [SequenceInput(i, tokens, 0, list(range(1 + i * blocks, 1 + (i + 1) * blocks)), sample=False)
            for i in range(batch)]


def write_contexts(execute: Callable[[list[SequenceInput]], object],
                   cases: list[tuple[int, int]] = DECODE_CASES) -> None:
    """Runs ``context_prefills`` for the largest of the (batch, context) ``cases`` through
    ``execute``, one sequence a step."""
    batch, ctx = max(cases, key=lambda case: case[0] * case[1])
    for seq in context_prefills(batch, ctx):
        execute([seq])


def to_proto(seqs: list[SequenceInput]) -> pb.ExecuteRequest:
    return pb.ExecuteRequest(sequences=[
        pb.ExecuteSequence(seq_id=s.seq_id, token_ids=s.token_ids, start_position=s.start_position,
                           block_table=s.block_table, sample=s.sample) for s in seqs])


def start_grpc_executor(model_dir: Path, dtype: str, port: int) -> tuple[subprocess.Popen, executor_pb2_grpc.ExecutorStub]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "executor", "--model", str(model_dir), "--dtype", dtype, "--port", str(port),
         "--num-blocks", str(num_blocks_needed()), "--log-level", "warning",
         "--num-threads", str(torch.get_num_threads())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_until_serving(f"127.0.0.1:{port}", 300, is_alive=lambda: proc.poll() is None)
    return proc, executor_pb2_grpc.ExecutorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


class TransformersStatic:
    """transformers, eager, with a StaticCache sized to the context: one decode step or a prefill."""

    def __init__(self, model_dir: Path, dtype: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def decode_step(self, batch: int, ctx: int):
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=ctx + 1)
        ids = torch.arange(100, 100 + batch).view(batch, 1)
        position, cache_position = torch.full((batch, 1), ctx), torch.tensor([ctx])
        mask = torch.ones(batch, ctx + 1, dtype=torch.long)

        @torch.inference_mode()
        def step():
            logits = self.model(input_ids=ids, position_ids=position, cache_position=cache_position,
                                attention_mask=mask, past_key_values=cache, use_cache=True).logits
            return logits[:, -1].argmax(-1).tolist()

        return step

    def prefill(self, tokens: list[int]):
        from transformers import StaticCache

        ids = torch.tensor([tokens])

        @torch.inference_mode()
        def step():
            cache = StaticCache(config=self.model.config, max_cache_len=len(tokens))
            logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                                cache_position=torch.arange(len(tokens)), logits_to_keep=1).logits
            return logits[:, -1].argmax(-1).tolist()

        return step


def with_layer_ops(runner: ModelRunner, layer_ops: TorchLayerOps, seqs: list[SequenceInput]):
    """A step of ``runner`` with ``layer_ops`` (the backend's compiled ones or the torch reference)."""
    def step():
        runner.backend.layer_ops = layer_ops
        runner.execute(seqs)

    return step


def run(model_dir: Path, dtype: str, rounds: int, port: int, only: set[str]) -> dict[str, dict[str, float]]:
    """{case: {column: best ms}} for every case, the columns measured side by side."""
    runner = ModelRunner(RunnerOptions(model_dir, dtype=dtype, num_blocks=num_blocks_needed())) \
        if "executor" in only else None
    proc, stub = start_grpc_executor(model_dir, dtype, port) if "grpc" in only else (None, None)
    hf = TransformersStatic(model_dir, dtype) if "transformers" in only else None
    if runner is not None:
        write_contexts(runner.execute)
    if stub is not None:
        write_contexts(lambda seqs: stub.Execute(to_proto(seqs)))
    compiled_ops = runner.backend.layer_ops if runner is not None else None
    results = {}
    try:
        cases = [(f"decode b={b} ctx={ctx}", decode_batch(b, ctx), (b, ctx)) for b, ctx in DECODE_CASES]
        cases.append((f"prefill {PREFILL_TOKENS}", prefill_batch(), None))
        for name, seqs, decode in cases:
            fns = {}
            if runner is not None:
                fns["executor"] = with_layer_ops(runner, compiled_ops, seqs)
                if "torch-layer-ops" in only:
                    fns["torch-layer-ops"] = with_layer_ops(runner, TorchLayerOps(), seqs)
            transport: list[float] = []
            if stub is not None:
                request = to_proto(seqs)

                def grpc_call(request=request, transport=transport):
                    start = time.perf_counter()
                    reply = stub.Execute(request)
                    # What the RPC adds: client wall time minus the server's own time for the step.
                    transport.append((time.perf_counter() - start) * 1e3 - reply.timings.total_ms)

                fns["grpc"] = grpc_call
            if hf is not None:
                fns["transformers"] = hf.decode_step(*decode) if decode else hf.prefill(seqs[0].token_ids)
            n = rounds if decode else max(3, rounds // 3)
            results[name] = timed_interleaved(fns, n, warmup=2 if decode else 1)
            if transport:
                results[name]["grpc transport"] = statistics.median(transport)
            print(f"{name}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in results[name].items()), file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.executor_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--steps", type=int, default=10, help="timed rounds per case, best kept (prefill: a third)")
    parser.add_argument("--port", type=int, default=50153, help="port of the gRPC executor it starts")
    parser.add_argument("--only", default="executor,grpc,transformers",
                        help="comma-separated subset; add torch-layer-ops for the executor with the torch "
                             "reference of its layer ops (executor/layer_ops.py) beside the compiled ones")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for all three (default: torch's). On a shared machine 1 is steadier: "
                             "an OpenMP team waits for its slowest thread at every op")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    # As `python -m executor` does; in this process it applies to transformers too.
    tune_host_allocator()
    results = run(args.model, args.dtype, args.steps, args.port, only)
    columns = {c: {case: r[c] for case, r in results.items()} for c in ("executor", "torch-layer-ops", "grpc", "transformers")
               if c in only}
    cases = list(next(iter(columns.values())))
    header = f"| {'case':<22} | " + " | ".join(f"{c + ' ms':>16}" for c in columns)
    if {"executor", "transformers"} <= columns.keys():
        header += " | speedup vs HF"
    if {"executor", "grpc"} <= columns.keys():
        header += " | gRPC transport | transport / executor"
    print(header + " |")
    print("|" + "---|" * header.count("|"))
    for case in cases:
        row = f"| {case:<22} | " + " | ".join(f"{columns[c][case]:>16.2f}" for c in columns)
        if {"executor", "transformers"} <= columns.keys():
            row += f" | {columns['transformers'][case] / columns['executor'][case]:>12.2f}x"
        if {"executor", "grpc"} <= columns.keys():
            transport = results[case]["grpc transport"]
            row += f" | {transport:>11.2f} ms | {transport / columns['executor'][case] * 100:>+19.1f}%"
        print(row + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
