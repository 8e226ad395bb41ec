"""How many CPU threads the torch thread computes on: ``--num-threads auto`` measures it at start.

Why a probe and not a rule: the fastest count depends on the CPU's matrix units and memory
bandwidth, not on its core count: on a 2-vCPU AMX Xeon the executor serves 1.76x the output
tokens on two threads than on one, while the one-thread rule the benchmarks used before was
measured on a 2-vCPU Zen 4, where the second core served the gateway and kvmanager. So the
executor times a real decode step of its own model at each candidate count, after the model
is loaded, and keeps the fastest (the fewer threads when two are within 5 %: a thread that
does not speed the step up only competes with the gateway for a core, and an OpenMP team
whose core is busy stalls at every parallel region).

The candidates are 1, 2, 4, ... and every CPU this process may use (its affinity mask and
its cgroup's CPU quota: a container limited to 2 CPUs on a 64-core host probes 1 and 2).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvserve.cpus import thread_counts_to_try, usable_cpus

# Two counts whose step times are this close count as equally fast: the fewer threads win.
EQUAL_WITHIN = 0.05
PROBE_ROUNDS = 3
PROBE_BUDGET_S = 2.0  # no probe round starts after this long
PROBE_ROWS = 16  # the batched decode step's sequences (the single-stream step has one)
PROBE_CONTEXT = 128  # tokens of history each probed sequence attends over


def parse_num_threads(text: str) -> int | None:
    """``--num-threads``: ``auto`` (None: probe at start) or a count >= 1."""
    if text.strip().lower() == "auto":
        return None
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"--num-threads: 'auto' or a whole number >= 1, got {text!r}") from None
    if count < 1:
        raise ValueError(f"--num-threads: 'auto' or a whole number >= 1, got {count}")
    return count


def choose_thread_count(seconds: dict[int, float], equal_within: float = EQUAL_WITHIN) -> int:
    """The fewest threads whose step time is within ``equal_within`` of the fastest count's."""
    fastest = min(seconds.values())
    return min(count for count, took in seconds.items() if took <= fastest * (1 + equal_within))


@dataclass
class ThreadProbe:
    """Each candidate count's fastest probe step, and the count chosen."""

    seconds: dict[int, float]
    chosen: int

    def summary(self) -> dict[str, float]:
        """Milliseconds per count, for the start-up log: {"1": 21.4, "2": 12.9}."""
        return {str(count): round(took * 1e3, 2) for count, took in sorted(self.seconds.items())}


def probe_thread_counts(step: Callable[[], None], counts: list[int], rounds: int = PROBE_ROUNDS,
                        budget_s: float = PROBE_BUDGET_S,
                        set_threads: Callable[[int], None] = torch.set_num_threads,
                        clock: Callable[[], float] = time.perf_counter) -> ThreadProbe:
    """Times ``step`` at each count in turn, round after round (a burst of other work on the machine
    then slows every count alike), keeps each count's fastest run, and leaves the chosen count set.
    One untimed step first; after the first round, a count more than twice the fastest's time is
    not tried again, and no round starts once ``budget_s`` has passed: on a busy machine the probe
    stays short.
    Call it from the thread that runs torch: the count applies to that thread's OpenMP team."""
    seconds = {count: math.inf for count in counts}
    started = clock()
    step()  # the first step of a process pays one-time costs (lazy initialisation, page faults): untimed
    contenders = list(counts)
    for _ in range(rounds):
        for count in contenders:
            set_threads(count)
            begun = clock()
            step()
            seconds[count] = min(seconds[count], clock() - begun)
        if clock() - started > budget_s:
            break
        fastest = min(seconds.values())
        contenders = [count for count in contenders if seconds[count] <= 2 * fastest]
    chosen = choose_thread_count(seconds)
    set_threads(chosen)
    return ThreadProbe(seconds, chosen)


def decode_probe_step(runner) -> Callable[[], None]:
    """A decode step of one sequence and one of up to PROBE_ROWS sequences, each attending over up
    to PROBE_CONTEXT tokens and sampled greedily: the model's own weights, kernels and LM head.
    It writes K/V into blocks no sequence owns yet (a new executor's pool holds nothing a client
    can find: kvmanager knows it by a new instance id), never block 0, the null block."""
    from executor.runner import SequenceInput  # the runner module imports torch models; only needed here

    block_size, free_blocks = runner.block_size, max(0, runner.num_blocks - 1)
    context = min(PROBE_CONTEXT, runner.max_model_len - 1, max(0, free_blocks * block_size - 1))
    blocks_per_seq = context // block_size + 1
    rows = max(1, min(PROBE_ROWS, free_blocks // blocks_per_seq))
    if free_blocks < blocks_per_seq:
        return lambda: None  # no room for even one sequence: nothing to measure
    token = min(1, runner.config.vocab_size - 1)

    def batch(count: int) -> list:
        return [SequenceInput(seq_id=i, token_ids=[token], start_position=context, sample=True,
                              block_table=list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)))
                for i in range(count)]

    single, batched = batch(1), batch(rows)

    def step() -> None:
        runner.execute(single)
        runner.execute(batched)

    return step


def loading_thread_count(cpus: int | None = None) -> int:
    """``--num-threads auto``: the threads the model loads on, before the probe chooses: half the
    usable CPUs (at least one). The gateway, kvmanager or another replica usually start beside
    it, and OpenMP teams that outnumber the cores stall at every parallel region: on 2 cores two
    replicas loading SmolLM2 at once took 4.9 s each on 2 threads and 2.7 s on 1 (alone: 2.1 s
    and 2.7 s)."""
    return max(1, (cpus or usable_cpus()) // 2)


def probe_runner_threads(runner, cpus: int | None = None) -> ThreadProbe | None:
    """``--num-threads auto`` on the CPU: probe the runner's decode step (run it in the torch
    thread). None on a GPU device, where the CPU threads only feed the device: torch's default."""
    if runner.device.type != "cpu":
        return None
    counts = thread_counts_to_try(cpus or usable_cpus())
    if len(counts) == 1:
        torch.set_num_threads(counts[0])
        return ThreadProbe({counts[0]: 0.0}, counts[0])
    return probe_thread_counts(decode_probe_step(runner), counts)


def main(argv: list[str] | None = None) -> int:
    """``python -m executor.threads``: what ``--num-threads auto`` picks here, as one JSON line
    (the benchmarks record it beside their swept thread counts)."""
    import argparse
    import json
    from pathlib import Path

    from executor.runner import ModelRunner, RunnerOptions
    from kvserve.paths import default_model_dir

    parser = argparse.ArgumentParser(prog="python -m executor.threads", description=main.__doc__)
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args(argv)
    runner = ModelRunner(RunnerOptions(args.model, dtype=args.dtype, quantization=args.quantization,
                                       kv_cache_dtype=args.kv_cache_dtype, num_blocks=PROBE_ROWS * 10 + 1))
    probe = probe_runner_threads(runner)
    print(json.dumps({"chosen": probe.chosen if probe else None, "cpus": usable_cpus(),
                      "decode_step_ms_by_threads": probe.summary() if probe else {}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
