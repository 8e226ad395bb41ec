"""Prompt-lookup speculative decoding against plain decoding, on the same executor, interleaved.

Starts kvmanager and one executor, and two gateways on the same pool: one with
``--speculative-decoding off``, one with ``prompt-lookup`` (the default). Prefix caching is off in both, so neither arm
finds the prompts the other computed. Every measurement runs both arms back to back
(alternating which goes first), so load from other processes on the box falls on both.

* copy-heavy, single stream: chat requests that ask the model to repeat a text exactly
  (real ShareGPT answers as the texts) or to return a code snippet with one name changed;
  greedy, up to the text's length + 24 tokens, stopping at EOS; a third arm sends them to the
  prompt-lookup gateway with OpenAI's ``prediction`` (the text, or the snippet as it was: what a
  client expects back), the drafts then following the prediction first;
* ShareGPT, single stream: real first turns, greedy, a fixed number of output tokens;
* ShareGPT at concurrency 32: output tokens per second over the whole run.

Per token latency (ITL): the gap between two streamed chunks divided by the tokens the later
one carries (a speculative step streams the accepted drafts and the token after them in one
chunk); its mean is (end - first token) / (tokens - 1) per request. Prints the ``lscpu`` model
line and a table; writes ``--out``/results.json and lscpu.txt.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from pathlib import Path

import httpx

from bench.peers.common import lscpu_summary, lscpu_text
from bench.workload import load_pairs, load_tokenizer, sample_requests
from kvserve.config import without_flag_env
from kvserve.launcher import StackConfig, spawn, start_stack, wait_healthy
from kvserve.ports import free_port

CODE_SNIPPETS = [
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price"
    " * item.quantity\n    return subtotal * (1 + tax_rate)\n",
    "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self, step=1):\n"
    "        self.count += step\n        return self.count\n",
    "def read_lines(path):\n    with open(path) as handle:\n        lines = handle.readlines()\n    return [line.strip()"
    " for line in lines if line.strip()]\n",
]


def copy_prompts(tokenizer, count: int) -> list[tuple[str, int, str]]:
    """(user message, max_tokens, the output a client would predict): repeat-this-text over ShareGPT
    answers of 40..110 tokens, and code edits."""
    prompts = []
    for _, answer in load_pairs():
        n = len(tokenizer.encode(answer, add_special_tokens=False).ids)
        if 40 <= n <= 110 and "```" not in answer:
            prompts.append((f"Repeat the following text exactly, word for word.\n\nText:\n{answer}", n + 24, answer))
        if len(prompts) == count - count // 3:
            break
    for snippet in CODE_SNIPPETS[:count // 3]:
        n = len(tokenizer.encode(snippet, add_special_tokens=False).ids)
        prompts.append((f"Rewrite this Python code with the function or class name in capital letters, and "
                        f"nothing else changed:\n\n{snippet}", n + 24, snippet))
    return prompts


async def stream(client: httpx.AsyncClient, url: str, body: dict, tokenizer) -> dict:
    """One streamed request: ttft, per-token gaps, output tokens, text, end time."""
    start = time.perf_counter()
    last, ttft, gaps, text, tokens = start, None, [], [], 0
    async with client.stream("POST", url, json={**body, "stream": True,
                                                "stream_options": {"include_usage": True}}) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                part = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if not part:
                    continue
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    k = max(1, len(tokenizer.encode(part, add_special_tokens=False).ids))
                    gaps += [(now - last) / k] * k
                last = now
                text.append(part)
    e2e = time.perf_counter() - start
    return {"ttft": ttft or e2e, "e2e": e2e, "tokens": tokens, "gaps": gaps, "text": "".join(text),
            "tpot": (e2e - (ttft or e2e)) / max(1, tokens - 1)}


def summarize(results: list[dict], wall: float | None = None) -> dict:
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    busy = wall if wall is not None else sum(r["e2e"] for r in results)
    return {"itl_mean_ms": 1e3 * statistics.mean(r["tpot"] for r in results),
            "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
            "output_tok_s": tokens / busy, "output_tokens": tokens, "requests": len(results)}


async def single_stream(urls: dict[str, str], bodies: list[dict], tokenizer,
                        extra: dict[str, list[dict]] | None = None) -> dict:
    """Each body on every arm back to back, the order of the arms alternating; ``extra``: fields
    an arm adds to each body (one dict a body)."""
    results: dict[str, list[dict]] = {arm: [] for arm in urls}
    arms = list(urls)
    extra = extra or {}
    async with httpx.AsyncClient(timeout=600) as client:
        for i, body in enumerate(bodies):
            for arm in (arms if i % 2 == 0 else arms[::-1]):
                sent = {**body, **extra[arm][i]} if arm in extra else body
                results[arm].append(await stream(client, urls[arm], sent, tokenizer))
    same = sum(len({r["text"] for r in texts}) == 1 for texts in zip(*results.values()))
    return {**{arm: summarize(r) for arm, r in results.items()}, "identical_texts": f"{same}/{len(bodies)}"}


async def concurrent(url: str, bodies: list[dict], concurrency: int, tokenizer) -> dict:
    queue = iter(bodies)
    results = []
    async with httpx.AsyncClient(timeout=1200, limits=httpx.Limits(max_connections=None)) as client:
        async def worker():
            for body in queue:
                results.append(await stream(client, url, body, tokenizer))
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(results, wall)


def wait_http(base: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base} did not answer /v1/models within {timeout} s")
        time.sleep(0.5)


def spec_counters(base: str) -> tuple[float, float]:
    text = httpx.get(base + "/metrics").text
    values = [re.search(rf"^vllm:spec_decode_num_{name}_tokens_total{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
              for name in ("draft", "accepted")]
    return tuple(float(v.group(1)) if v else 0.0 for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prompt_lookup_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto",
                        help="the executor's --dtype (auto: bfloat16 where the CPU has it natively, else float32)")
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                        help="the executor's --quantization (weights)")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--copy-prompts", type=int, default=9)
    parser.add_argument("--sharegpt-prompts", type=int, default=8)
    parser.add_argument("--sharegpt-output-len", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--concurrent-prompts", type=int, default=64)
    parser.add_argument("--concurrent-output-len", type=int, default=64)
    parser.add_argument("--concurrent-rounds", type=int, default=2,
                        help="rounds of the concurrency run, each arm once per round, the first arm alternating "
                             "(0: skip it)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/prompt-lookup"))
    args = parser.parse_args(argv)
    from executor.prepare_model import default_model_dir, prepare

    model_dir = Path(args.model) if args.model else prepare(default_model_dir())
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    cpu = lscpu_text()
    (args.out / "lscpu.txt").write_text(cpu)
    print("lscpu:", lscpu_summary(cpu).get("Model name", "?"), flush=True)
    tokenizer = load_tokenizer(model_dir)
    common = ["--no-enable-prefix-caching", "--max-num-seqs", str(max(64, args.concurrency))]
    stack = start_stack(StackConfig(model_dir=model_dir, kvmanager_port=free_port(), executor_port=free_port(),
                                    gateway_port=free_port(), http_port=free_port(), log_dir=args.out / "logs",
                                    executor_args=["--dtype", args.dtype, "--quantization", args.quantization],
                                    gateway_args=[*common, "--speculative-decoding", "off"]))
    spec_http = free_port()
    spec = spawn("gateway", ["--kvmanager-address", stack.kvmanager.address, "--executor-address",
                             stack.executor.address, "--model", str(model_dir), "--http-port", str(spec_http),
                             "--speculative-decoding", "prompt-lookup", "--num-speculative-tokens",
                             str(args.num_speculative_tokens), *common],
                 port=free_port(), log_path=args.out / "logs" / "gateway-spec.log", env=without_flag_env())
    try:
        wait_healthy([spec], timeout=120)
        bases = {"plain": stack.http_url, "prompt-lookup": f"http://127.0.0.1:{spec_http}"}
        wait_http(bases["prompt-lookup"])
        chat = {arm: base + "/v1/chat/completions" for arm, base in bases.items()}
        completions = {arm: base + "/v1/completions" for arm, base in bases.items()}
        copies = copy_prompts(tokenizer, args.copy_prompts)
        copy_bodies = [{"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": n,
                        "temperature": 0} for text, n, _ in copies]
        predictions = [{"prediction": {"type": "content", "content": expected}} for _, _, expected in copies]
        model = httpx.get(bases["plain"] + "/v1/models").json()["data"][0]["id"]
        for body in copy_bodies:
            body["model"] = model
        share = sample_requests(tokenizer, args.sharegpt_prompts + args.concurrent_prompts, max_input_len=512)
        share_bodies = [{"model": model, "prompt": r.prompt, "max_tokens": args.sharegpt_output_len,
                         "temperature": 0, "ignore_eos": True} for r in share[:args.sharegpt_prompts]]
        many = [{"model": model, "prompt": r.prompt, "max_tokens": args.concurrent_output_len, "temperature": 0,
                 "ignore_eos": True} for r in share[args.sharegpt_prompts:]]
        asyncio.run(single_stream(chat, [{**copy_bodies[0], "max_tokens": 8}], tokenizer))  # warm-up
        results = {"lscpu_model": lscpu_summary(cpu).get("Model name", "?"), "dtype": args.dtype,
                   "quantization": args.quantization,
                   "num_speculative_tokens": args.num_speculative_tokens}
        before = spec_counters(bases["prompt-lookup"])
        results["copy_heavy"] = asyncio.run(single_stream(
            {**chat, "prediction": chat["prompt-lookup"]}, copy_bodies, tokenizer, {"prediction": predictions}))
        after = spec_counters(bases["prompt-lookup"])
        results["copy_heavy"]["drafted_accepted"] = [after[0] - before[0], after[1] - before[1]]
        print("copy-heavy", json.dumps(results["copy_heavy"]), flush=True)
        results["sharegpt"] = asyncio.run(single_stream(completions, share_bodies, tokenizer))
        again = spec_counters(bases["prompt-lookup"])
        results["sharegpt"]["drafted_accepted"] = [again[0] - after[0], again[1] - after[1]]
        print("sharegpt", json.dumps(results["sharegpt"]), flush=True)
        rounds = []
        for i in range(args.concurrent_rounds):
            order = ("plain", "prompt-lookup") if i % 2 == 0 else ("prompt-lookup", "plain")
            rounds.append({arm: asyncio.run(concurrent(completions[arm], many, args.concurrency, tokenizer))
                           for arm in order})
        if rounds:
            results["sharegpt_concurrent"] = {arm: statistics.mean(r[arm]["output_tok_s"] for r in rounds)
                                              for arm in bases}
            print("sharegpt c=%d" % args.concurrency, json.dumps(results["sharegpt_concurrent"]), flush=True)
    finally:
        spec.stop()
        stack.stop()
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(table(results, args.concurrency))
    return 0


def table(r: dict, concurrency: int) -> str:
    """The drafting arm against plain decoding: prompt lookup alone, and with ``prediction``."""
    rows = ["| workload | metric | plain | drafted | ratio |", "|---|---|---|---|---|"]
    for name, key, arm in (("copy-heavy, 1 stream", "copy_heavy", "prompt-lookup"),
                           ("copy-heavy, 1 stream, with `prediction`", "copy_heavy", "prediction"),
                           ("ShareGPT, 1 stream", "sharegpt", "prompt-lookup")):
        p, s = r[key]["plain"], r[key][arm]
        rows.append(f"| {name} | ITL mean (ms) | {p['itl_mean_ms']:.1f} | {s['itl_mean_ms']:.1f} | "
                    f"{p['itl_mean_ms'] / s['itl_mean_ms']:.2f}x lower |")
        rows.append(f"| {name} | ITL P50 (ms) | {p['itl_p50_ms']:.1f} | {s['itl_p50_ms']:.1f} | "
                    f"{p['itl_p50_ms'] / max(s['itl_p50_ms'], 1e-9):.2f}x lower |")
        rows.append(f"| {name} | output tok/s | {p['output_tok_s']:.1f} | {s['output_tok_s']:.1f} | "
                    f"{s['output_tok_s'] / p['output_tok_s']:.2f}x |")
    c = r.get("sharegpt_concurrent")
    if c:
        rows.append(f"| ShareGPT, concurrency {concurrency} (prompt lookup) | output tok/s | {c['plain']:.1f} | "
                    f"{c['prompt-lookup']:.1f} | {c['prompt-lookup'] / c['plain']:.2f}x |")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
