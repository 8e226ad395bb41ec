"""The sampler alone (executor/sampling.py's ``sample``) on a model's own next-token logits.

    python -m bench.sampling_bench [--model DIR] [--rows 1,8,32,64] [--threads 2]

Logits: the default model (transformers, float32) over a few prompts, one row a position, so the
distributions are a model's (a few likely tokens over a long tail), not random. For each number of
rows and each setting (temperature 1 with and without seeds, top_p, top_k) it prints ``sample``'s
time; "before": the sampler it replaced, which drew by the exponential race (``argmax(p / E)``, E
drawn by ``exponential_`` for every token of the vocabulary) and filtered top-k / top-p by sorting
the whole vocabulary; "full sort": today's draw with that sort. The three run in turn and the best of
``--rounds`` is kept (bench/timing.py).
Prints ``lscpu``'s model name first.
"""
from __future__ import annotations

import argparse
from unittest import mock

import torch

from executor import sampling
from bench.peers.common import lscpu_summary, lscpu_text
from bench.timing import timed_interleaved
from executor.sampling import SamplingParams, sample, seed_for
from kvserve.paths import default_model_dir

PROMPTS = [
    "The history of the Roman Empire spans many centuries, beginning with the founding of the city and ending",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n    left =",
    "Write a short poem about the sea. The waves roll in and out, the gulls",
    "<|im_start|>user\nWhat are three tips for staying healthy?<|im_end|>\n<|im_start|>assistant\nHere are three",
]
SETTINGS = {
    "temperature 1": {},
    "temperature 1, seeded": {"seed": 0},
    "top_p 0.9, seeded": {"seed": 0, "top_p": 0.9},
    "top_k 50, seeded": {"seed": 0, "top_k": 50},
}


def model_logits(model_dir, rows: int) -> torch.Tensor:
    """[rows, vocab] float32: the model's logits at the last positions of PROMPTS, repeated as needed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        per_prompt = [model(tokenizer(p, return_tensors="pt").input_ids).logits[0, -16:] for p in PROMPTS]
    logits = torch.cat(per_prompt)
    return logits.repeat(-(-rows // len(logits)), 1)[:rows].contiguous()


def exponential_race(probs: torch.Tensor, uniforms_params, positions, generator) -> torch.Tensor:
    """What ``sample`` drew with before: E ~ Exp(1) for every token, ``argmax(p / E)``."""
    noise = torch.empty_like(probs)
    for row, (p, pos) in enumerate(zip(uniforms_params, positions)):
        row_generator = generator if p.seed is None else torch.Generator().manual_seed(seed_for(p.seed, pos))
        noise[row].exponential_(generator=row_generator)
    return (probs / noise).argmax(dim=-1)


def time_sample(logits: torch.Tensor, params: list[SamplingParams], rounds: int) -> dict[str, float]:
    """Best-of-``rounds`` ms of one ``sample`` call: as it is ("sample"), with the whole-vocabulary sort
    ("full sort", only where top-k / top-p filter) and as it was ("before"), interleaved."""
    positions = list(range(len(params)))
    generator = torch.Generator().manual_seed(0)

    def today():
        sample(logits, params, positions, generator)

    def full_sort():
        with mock.patch.object(sampling, "_filter_top_k_top_p", sampling._filter_sorted):
            sample(logits, params, positions, generator)

    def before():  # the race takes the rows' params in place of their uniforms
        with mock.patch.object(sampling, "_filter_top_k_top_p", sampling._filter_sorted), \
                mock.patch.object(sampling, "_uniforms", lambda ps, pos, gen: (ps, pos, gen)), \
                mock.patch.object(sampling, "_draw", lambda probs, u: exponential_race(probs, *u)):
            sample(logits, params, positions, generator)

    fns = {"sample": today, "before": before}
    if any(p.top_k > 0 or 0.0 < p.top_p < 1.0 for p in params):
        fns["full sort"] = full_sort
    return timed_interleaved(fns, rounds, warmup=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model_dir())
    parser.add_argument("--rows", default="1,8,32,64", help="rows (sequences) a step samples, comma-separated")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    logits = model_logits(args.model, max(rows_list))
    print(f"CPU: {lscpu_summary(lscpu_text()).get('Model name', 'unknown')}; torch threads {torch.get_num_threads()}; vocabulary {logits.shape[1]}")
    print(f"{'rows':>4}  {'setting':24} {'sample ms':>9}  {'before ms':>9}  {'full sort ms':>12}")
    for rows in rows_list:
        for name, extra in SETTINGS.items():
            params = [SamplingParams(temperature=1.0, **{k: v + i if k == "seed" else v for k, v in extra.items()})
                      for i in range(rows)]
            best = time_sample(logits[:rows], params, args.rounds)
            print(f"{rows:4d}  {name:24} {best['sample']:9.2f}  {best['before']:9.2f}  "
                  f"{best.get('full sort', float('nan')):12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
