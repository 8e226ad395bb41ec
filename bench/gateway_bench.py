"""Gateway benchmark: N concurrent streaming requests over HTTP, and where each step's time goes.

    python -m bench.gateway_bench                       # starts kvmanager + executor (bf16) + gateway
    python -m bench.gateway_bench --base-url http://127.0.0.1:8000   # measures a running gateway

Reports output tokens/s, TTFT p50/p99, inter-token latency p50/p99 (client side,
from SSE chunk arrival), and — from the gateway's ``kvserve:step_time_seconds``
counters, read between the moment every request has its first token and the
moment the first one finishes, i.e. while all N run together — the share of a
step spent outside the executor's forward pass (scheduler + kvmanager RPC +
executor RPC overhead), plus the time between steps (streaming to clients).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.client import sse_chunks
from bench.report import percentile
from bench.server_metrics import scrape
from kvserve.ports import free_port

WORDS = ("river mountain story engine garden history window silver planet music language market "
         "winter bridge doctor forest village ocean kitchen letter season teacher island castle "
         "science harbor desert journey library circus theatre machine lantern meadow").split()
PHASE = re.compile(r'^kvserve:step_time_seconds_total\{[^}]*phase="([a-z_]+)"[^}]*\}\s+(\S+)', re.M)
COUNTER = re.compile(r"^(kvserve:steps_total|kvserve:step_running_seqs_total)\{[^}]*\}\s+(\S+)", re.M)


def percentile_ms(values: list[float], q: float) -> float:
    """The q-th percentile of seconds, in milliseconds (NaN when empty)."""
    value = percentile(values, q)
    return float("nan") if value is None else 1000 * value


def make_prompts(n: int, words_per_prompt: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}. Write a long story about " + " ".join(rng.choice(WORDS) for _ in range(words_per_prompt))
            for i in range(n)]


async def step_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """The gateway's step-time phases and step counters, from one /metrics scrape."""
    text = await scrape(client, base_url)
    values = {f"phase:{k}": float(v) for k, v in PHASE.findall(text)}
    values.update({k: float(v) for k, v in COUNTER.findall(text)})
    return values


async def one_request(client, url, body, record, first_token_barrier: asyncio.Event, state: dict):
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {await reply.aread()}")
        async for chunk in sse_chunks(reply):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
                if len(arrivals) == 1:
                    state["first_tokens"] += 1
                    if state["first_tokens"] == state["n"]:
                        first_token_barrier.set()
    if "first_done" not in state:
        state["first_done"] = time.perf_counter()
        state["first_done_event"].set()
    record.append({"ttft": arrivals[0] - start, "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
                   "tokens": tokens, "e2e": time.perf_counter() - start})


async def run_load(base_url: str, concurrency: int, output_len: int, prompt_words: int, seed: int) -> dict:
    url = base_url + "/v1/completions"
    prompts = make_prompts(concurrency, prompt_words, seed)
    record: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        model = (await client.get(base_url + "/v1/models")).json()["data"][0]["id"]
        warm = {"model": model, "prompt": "warm up", "max_tokens": 4, "temperature": 0}
        await client.post(url, json=warm)
        all_started, first_done = asyncio.Event(), asyncio.Event()
        state = {"first_tokens": 0, "n": concurrency, "first_done_event": first_done}
        bodies = [{"model": model, "prompt": p, "max_tokens": output_len, "min_tokens": output_len,
                   "ignore_eos": True, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}} for p in prompts]
        begin = await step_counters(client, base_url)
        wall0 = time.perf_counter()
        tasks = [asyncio.create_task(one_request(client, url, b, record, all_started, state)) for b in bodies]
        await asyncio.wait([asyncio.create_task(all_started.wait()), *tasks], return_when=asyncio.FIRST_COMPLETED)
        steady_begin, steady_t0 = await step_counters(client, base_url), time.perf_counter()
        await first_done.wait()
        steady_end, steady_t1 = await step_counters(client, base_url), time.perf_counter()
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - wall0
        end = await step_counters(client, base_url)
    ttft = [r["ttft"] for r in record]
    itl = [gap for r in record for gap in r["itl"]]
    tokens = sum(r["tokens"] for r in record)
    return {
        "model": model, "concurrency": concurrency, "output_len": output_len, "requests": len(record),
        "completion_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
        "ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p99_ms": percentile_ms(ttft, 99),
        "itl_p50_ms": percentile_ms(itl, 50), "itl_p99_ms": percentile_ms(itl, 99),
        "itl_mean_ms": 1000 * statistics.fmean(itl) if itl else float("nan"),
        "steady": step_profile(steady_begin, steady_end, steady_t1 - steady_t0),
        "whole_run": step_profile(begin, end, wall),
    }


def step_profile(begin: dict, end: dict, wall_s: float) -> dict:
    delta = {k: end.get(k, 0.0) - begin.get(k, 0.0) for k in end}
    steps = delta.get("kvserve:steps_total", 0.0)
    step = delta.get("phase:step", 0.0)
    if not steps or not step:
        return {"steps": steps}
    forward = delta.get("phase:executor_forward", 0.0)
    executor_total = delta.get("phase:executor_total", 0.0)
    executor_rpc = delta.get("phase:executor_rpc", 0.0)
    return {
        "steps": steps, "mean_seqs_per_step": delta.get("kvserve:step_running_seqs_total", 0.0) / steps,
        "mean_step_ms": 1000 * step / steps, "mean_forward_ms": 1000 * forward / steps,
        "share_outside_forward": (step - forward) / step,
        "share_outside_executor_compute": (step - executor_total) / step,
        "share_scheduler": delta.get("phase:scheduler", 0.0) / step,
        "share_kvmanager_rpc": delta.get("phase:kvmanager_rpc", 0.0) / step,
        "share_executor_rpc_overhead": (executor_rpc - executor_total) / step,
        "share_executor_sampling_and_copies": (executor_total - forward) / step,
        "between_steps_share_of_wall": max(0.0, wall_s - step) / wall_s,
    }


def start_stack(args):
    from kvserve.launcher import StackConfig, start_stack as launch
    from kvserve.paths import default_model_dir

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    config = StackConfig(
        model_dir=Path(args.model or default_model_dir()), kvmanager_port=free_port(), executor_port=free_port(),
        gateway_port=free_port(), http_port=free_port(), log_dir=log_dir,
        executor_args=["--dtype", args.dtype, *args.executor_args.split()],
        gateway_args=args.gateway_args.split(),
    )
    return launch(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running gateway; default: start the three services")
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--executor-args", default="", help="extra executor flags")
    parser.add_argument("--gateway-args", default="", help="extra gateway flags")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=60, help="random words per prompt (~1.2 tokens each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="bench/results/gateway-logs")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    stack = None
    base_url = args.base_url
    if base_url is None:
        stack = start_stack(args)
        base_url = stack.http_url
    try:
        result = asyncio.run(run_load(base_url, args.concurrency, args.output_len, args.prompt_words, args.seed))
    finally:
        if stack is not None:
            stack.stop()
    print(json.dumps(result, indent=2))
    steady = result["steady"]
    print(f"\n{result['requests']} requests x {args.output_len} tokens, concurrency {args.concurrency}: "
          f"{result['output_tok_s']:.1f} output tok/s; TTFT p50 {result['ttft_p50_ms']:.0f} ms p99 "
          f"{result['ttft_p99_ms']:.0f} ms; ITL p50 {result['itl_p50_ms']:.1f} ms p99 {result['itl_p99_ms']:.1f} ms",
          file=sys.stderr)
    if "share_outside_forward" in steady:
        print(f"steady state ({steady['mean_seqs_per_step']:.1f} seqs/step, {steady['mean_step_ms']:.1f} ms/step): "
              f"{100 * steady['share_outside_forward']:.2f}% of each step outside the forward pass "
              f"(scheduler {100 * steady['share_scheduler']:.2f}%, kvmanager RPC "
              f"{100 * steady['share_kvmanager_rpc']:.2f}%, executor RPC overhead "
              f"{100 * steady['share_executor_rpc_overhead']:.2f}%, executor sampling+copies "
              f"{100 * steady['share_executor_sampling_and_copies']:.2f}%); between steps "
              f"{100 * steady['between_steps_share_of_wall']:.2f}% of wall time", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
