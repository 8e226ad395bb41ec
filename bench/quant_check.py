"""Greedy agreement and decode step times of ``--quantization int8 / int4`` against ``none``.

    python -m bench.quant_check [--model DIR] [--new-tokens 64] [--rounds 10] [--threads 2]

Agreement, on 16 fixed prompts (chat turns and plain continuations) × ``--new-tokens``
greedy tokens, all prompts in one batch, the unquantized model (the checkpoint's
weights in bf16) as reference:

- *prefix match*: the quantized model generates freely; the fraction of the reference's
  tokens it reproduces before the first divergence (mean over prompts);
- *top-1 agreement*: teacher forcing — the quantized model is fed the reference's tokens,
  and at each position its greedy pick is compared with the reference's next token.

Decode step times: ``bench.executor_bench``'s decode batches (batch 1 and 32 at
``--context`` cached positions, written first by ``write_contexts``), the three runners
called in turn, best of ``--rounds``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.executor_bench import BLOCK, decode_batch, write_contexts
from bench.timing import timed_interleaved
from executor.devices import tune_host_allocator
from executor.quantization import QUANTIZATION_MODES
from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from kvserve.logs import configure_logging
from kvserve.paths import default_model_dir

BATCHES = (1, 32)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [CHAT.format(q) for q in (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better.",
    "What causes the seasons on Earth?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a cup of green tea?",
)] + [
    "The history of the Roman Empire spans many centuries, from the founding of the city to",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes",
    "1, 2, 3, 4, 5,",
    "The mitochondria is often called the powerhouse of the cell because",
    "In machine learning, overfitting happens when",
]


def block_tables(lengths: list[int]) -> list[list[int]]:
    """Disjoint block tables (block 0 is the null block) holding ``lengths`` positions each."""
    tables, next_block = [], 1
    for n in lengths:
        blocks = -(-n // BLOCK)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    return tables


def generate(runner: ModelRunner, prompts: list[list[int]], new_tokens: int,
             forced: list[list[int]] | None = None) -> list[list[int]]:
    """Greedy picks after each prompt and then after each generated token, ``new_tokens`` per prompt,
    all prompts in one batch. With ``forced`` (a token list per prompt), those tokens are fed instead
    of the model's own picks (teacher forcing); the picks are returned either way."""
    tables = block_tables([len(p) + new_tokens for p in prompts])
    fed = [list(p) for p in prompts]
    picks: list[list[int]] = [[] for _ in prompts]
    done = [0] * len(prompts)  # tokens of each sequence whose KV is cached
    for step in range(new_tokens):
        out = runner.execute([SequenceInput(i, fed[i][done[i]:], done[i], tables[i], sample=True)
                              for i in range(len(prompts))])
        for i, token in enumerate(out.sampled_token_ids):
            done[i] = len(fed[i])
            picks[i].append(token)
            fed[i].append(forced[i][step] if forced is not None else token)
    return picks


def agreement(runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(mean prefix match, top-1 agreement under teacher forcing) of ``runner`` against ``reference``."""
    new_tokens = len(reference[0])
    free = generate(runner, prompts, new_tokens)
    prefix = []
    for ours, ref in zip(free, reference):
        diverged = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), new_tokens)
        prefix.append(diverged / new_tokens)
    forced = generate(runner, prompts, new_tokens, forced=reference)
    same = sum(a == b for ours, ref in zip(forced, reference) for a, b in zip(ours, ref))
    return sum(prefix) / len(prefix), same / (len(reference) * new_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant_check", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--context", type=int, default=128, help="cached positions of the timed decode steps")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per batch size, best kept")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args(argv)
    configure_logging("warning")
    torch.set_num_threads(args.threads)
    tune_host_allocator()

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    prompts = [tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    agreement_blocks = sum(-(-(len(p) + args.new_tokens) // BLOCK) for p in prompts)
    timing_blocks = max(BATCHES) * -(-(args.context + 1) // BLOCK)
    num_blocks = 1 + max(agreement_blocks, timing_blocks)
    runners = {}
    for mode in QUANTIZATION_MODES:
        start = time.monotonic()
        runners[mode] = ModelRunner(RunnerOptions(args.model, dtype=args.dtype, quantization=mode,
                                                  num_blocks=num_blocks))
        print(f"loaded {mode} in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)

    reference = generate(runners["none"], prompts, args.new_tokens)
    rows = {}
    for mode in QUANTIZATION_MODES:
        rows[mode] = agreement(runners[mode], prompts, reference)
        print(f"{mode}: prefix match {rows[mode][0]:.3f}, top-1 {rows[mode][1]:.3f}", file=sys.stderr, flush=True)
    times: dict[int, dict[str, float]] = {}
    if not args.skip_timing:
        for runner in runners.values():
            write_contexts(runner.execute, [(batch, args.context) for batch in BATCHES])
        for batch in BATCHES:
            seqs = decode_batch(batch, args.context)
            times[batch] = timed_interleaved({m: (lambda r=r: r.execute(seqs)) for m, r in runners.items()},
                                             args.rounds)

    print(f"{len(prompts)} prompts × {args.new_tokens} greedy tokens, {args.dtype}, {args.threads} threads, "
          f"reference: --quantization none")
    header = "| quantization | prefix match | top-1 (teacher-forced)"
    header += "".join(f" | decode b={b} ctx={args.context} ms" for b in times)
    print(header + " |")
    print("|" + "---|" * header.count("|"))
    for mode in QUANTIZATION_MODES:
        prefix, top1 = rows[mode]
        row = f"| {mode:<12} | {prefix:>12.3f} | {top1:>22.3f}"
        row += "".join(f" | {times[b][mode]:>8.2f} ({times[b][mode] / times[b]['none']:.2f}x)" for b in times)
        print(row + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
