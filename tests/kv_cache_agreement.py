"""How far a model over one KV cache layout strays from the same model over another: the drive the
K/V cache dtype tests share (tests/test_executor_kv_int8.py, test_executor_kv_bf16.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from executor.runner import ModelRunner, SequenceInput


@dataclass
class Agreement:
    worst: float  # nats: the largest gap on the reference's 5 likeliest tokens
    mean: float
    agree: int  # rows whose greedy pick is the reference's
    total: int

    def line(self, what: str) -> str:
        return (f"{what}: top-5 logprob error worst {self.worst:.4f}, mean {self.mean:.4f} nats, "
                f"argmax agreement {self.agree}/{self.total}")


def drive(runners: dict[str, ModelRunner], prompts: list[list[int]], reference: str, candidate: str,
          each_step: Callable[[dict[str, torch.Tensor]], None] = lambda logits: None) -> Agreement:
    """Each prompt prefilled in two chunks (the second attends over the first's cached blocks), then
    9 greedy decode steps of all prompts at once and of one alone, every runner fed the reference's
    greedy tokens; ``each_step`` sees every runner's logits of each step."""
    tables = [[1 + 4 * i + j for j in range(4)] for i in range(len(prompts))]
    cut = [len(p) // 2 for p in prompts]
    errors, agree, total = [], 0, 0
    for batch in (list(range(len(prompts))), [3]):
        for runner in runners.values():
            runner.forward_logits([SequenceInput(i, prompts[i][:cut[i]], 0, tables[i]) for i in batch])
        seqs = [SequenceInput(i, prompts[i][cut[i]:], cut[i], tables[i]) for i in batch]
        for step in range(9):
            logits = {name: runner.forward_logits(seqs) for name, runner in runners.items()}
            each_step(logits)
            usual, other = logits[reference], logits[candidate]
            top5 = usual.topk(5, dim=-1).indices
            errors.append((other.log_softmax(-1).gather(1, top5) - usual.log_softmax(-1).gather(1, top5)).abs())
            agree += int((other.argmax(-1) == usual.argmax(-1)).sum())
            total += len(seqs)
            seqs = [SequenceInput(i, [t], len(prompts[i]) + step, tables[i])
                    for i, t in zip(batch, usual.argmax(-1).tolist())]
    errors = torch.cat(errors)
    return Agreement(errors.max().item(), errors.mean().item(), agree, total)


def copied_blocks_logits(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """A 40-token prompt's blocks copied (copy-on-write) to others: the next token's logits over the
    original blocks and over the copies."""
    prompt = list(range(300, 340))
    runner.forward_logits([SequenceInput(0, prompt, 0, [20, 21, 22])])
    runner.execute([SequenceInput(1, [7], 0, [30])], copy_src=[20, 21, 22], copy_dst=[40, 41, 42])
    original = runner.forward_logits([SequenceInput(0, [5], len(prompt), [20, 21, 22])])
    copied = runner.forward_logits([SequenceInput(2, [5], len(prompt), [40, 41, 42])])
    return original, copied
