"""A verify step's cost: one sequence's decode token plus drafts against a plain decode step.

    python -m bench.verify_step_bench [--model DIR] [--quantization none,int8,int4] [--dtype auto]
                                      [--context 300] [--drafts 1,3,5] [--threads 2] [--rounds 15]

For each weight quantization, ``ModelRunner.execute`` runs one sequence at ``--context`` cached
tokens: a plain decode step and a step of its token and n drafts (``num_draft_tokens``), taking
turns (bench/timing.py), best of ``--rounds``. Prompt-lookup drafting pays when the tokens a step
emits (accepted drafts + 1) outnumber the ratio printed here. Prints ``lscpu``'s model name first.
"""
from __future__ import annotations

import argparse

import torch

from bench.peers.common import lscpu_summary, lscpu_text
from bench.timing import timed_interleaved
from executor.devices import tune_host_allocator
from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from kvserve.paths import default_model_dir

BLOCK = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model_dir())
    parser.add_argument("--quantization", default="none,int8,int4")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--drafts", default="1,3,5", help="drafts a verify step carries, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    tune_host_allocator()
    torch.set_num_threads(args.threads)
    drafts = [int(n) for n in args.drafts.split(",")]
    print(f"CPU: {lscpu_summary(lscpu_text()).get('Model name', 'unknown')}; torch threads {args.threads}; "
          f"context {args.context}")
    print("| weights | plain step | " + " | ".join(f"1 + {n} drafts" for n in drafts) + " |")
    print("|---|---:|" + "---:|" * len(drafts))
    for quantization in args.quantization.split(","):
        blocks = -(-(args.context + max(drafts) + 1) // BLOCK)
        runner = ModelRunner(RunnerOptions(args.model, dtype=args.dtype, quantization=quantization,
                                           num_blocks=1 + blocks))  # block 0 is the null block
        table = list(range(1, 1 + blocks))
        runner.execute([SequenceInput(0, [(7 * i) % 30000 + 100 for i in range(args.context)], 0, table, sample=True)])
        steps = {n: SequenceInput(0, [101 + j for j in range(n + 1)], args.context, table, sample=True,
                                  num_draft_tokens=n) for n in [0, *drafts]}
        best = timed_interleaved({n: (lambda seq=seq: runner.execute([seq])) for n, seq in steps.items()},
                                 args.rounds)
        cells = [f"{best[n]:.1f} ms ({best[n] / best[0]:.2f}x)" for n in drafts]
        print(f"| {runner.info.dtype} | {best[0]:.1f} ms | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
