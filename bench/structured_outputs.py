"""Structured outputs at load: every request constrained by a JSON schema, against the same
requests unconstrained, on one stack.

    python -m bench.structured_outputs                   # 64 requests, concurrency 32
    python -m bench.structured_outputs --num-requests 32 --concurrency 16 --threads 1
    python -m bench.structured_outputs --peers llama-server   # and llama.cpp's server, side by side

The requests are the schemas of ``bench/structured_schemas.py`` (cycled to ``--num-requests``),
each its prompt through ``/v1/chat/completions`` at temperature 0. Row ``json_schema``: each
request carries ``response_format: json_schema`` and ends when its grammar completes (or at
``--max-tokens``). Row ``unconstrained``: the same prompts, no constraint, ``max_tokens =
min_tokens`` = the constrained reply's length with ``ignore_eos``, so both rows generate the
same number of tokens per request. Output tok/s is all generated tokens over the row's wall
time; TTFT and end-to-end latency are per request. A first pass sends every prompt once (one
token), so both rows find the prompts in the prefix cache and the schemas compiled. Also reported: the share of constrained
replies that parse and validate (``jsonschema``), and the gateway's mask time per token
measured in process (``GrammarState.allowed_bitmask``). The rows alternate ``--rounds``
times on one warm stack, so that machine noise falls on both. ``--peers llama-server`` runs
the same rounds on llama.cpp's server (its ``response_format`` json_schema becomes a GBNF
grammar), built once by ``bench.peers.llama_server``; the schemas it refuses are left out for
every system, so all rows run the same requests. Writes ``--out``/results.json and
lscpu.txt.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

from bench.peers.common import lscpu_text, write_lscpu
from bench.report import percentile
from bench.routing_bench import service_env
from bench.structured_schemas import SCHEMAS
from kvserve.launcher import StackConfig, start_stack
from kvserve.ports import free_port


def schema_body(name: str, prompt: str, schema: dict, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}


def plain_body(prompt: str, num_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": num_tokens, "min_tokens": num_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    first, text, tokens, finish = None, "", 0, None
    async with client.stream("POST", url, json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                content = choice["delta"].get("content") or ""
                if content and first is None:
                    first = time.perf_counter() - start
                text += content
                finish = choice.get("finish_reason") or finish
    return {"ttft_s": first, "latency_s": time.perf_counter() - start, "tokens": tokens, "text": text,
            "finish_reason": finish}


async def run_row(url: str, bodies: list[dict], concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=1800) as client:
        async def limited(body):
            async with limit:
                return await one(client, url, body)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(b) for b in bodies))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft_s"] * 1000 for r in results if r["ttft_s"] is not None]
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "latency_p50_s": percentile([r["latency_s"] for r in results], 50), "results": results}


def validity(results: list[dict], schemas: list[dict]) -> float:
    import jsonschema

    valid = 0
    for result, schema in zip(results, schemas):
        try:
            valid += not list(jsonschema.Draft202012Validator(schema).iter_errors(json.loads(result["text"])))
        except ValueError:
            pass
    return valid / len(results)


def mask_cost_us(model_dir: Path, workload: list[tuple[str, str, dict]], replies: list[dict]) -> float:
    """Mean in-process time of one allowed-token mask along the constrained replies."""
    from gateway.constraints import ConstraintSpec, GrammarCompiler
    from gateway.detokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(model_dir)
    compiler = GrammarCompiler.for_tokenizer(tokenizer)
    total, count = 0.0, 0
    for (_, _, schema), reply in zip(workload, replies):
        state = compiler.compile_now(ConstraintSpec.json_schema(schema)).new_state()
        for token in tokenizer.encode(reply["text"]):
            start = time.perf_counter()
            state.allowed_bitmask(tokenizer.vocab_size)
            total += time.perf_counter() - start
            count += 1
            if not state.consume(token):
                break
    return total / max(count, 1) * 1e6


def measure(url: str, workload: list[tuple[str, str, dict]], args) -> list[dict]:
    """The rounds on one warm server at ``url`` (an OpenAI-compatible chat completions URL)."""
    # Every prompt once, so that both rows find the same prompts in the prefix cache; and
    # every schema compiled once (the gateway caches compiled grammars).
    asyncio.run(run_row(url, [schema_body(n, p, s, 1) for n, p, s in workload], args.concurrency))
    rounds = []
    for _ in range(args.rounds):
        constrained = asyncio.run(run_row(url, [schema_body(n, p, s, args.max_tokens) for n, p, s in workload],
                                          args.concurrency))
        lengths = [max(r["tokens"], 1) for r in constrained["results"]]
        plain = asyncio.run(run_row(url, [plain_body(p, k) for (_, p, _), k in zip(workload, lengths)],
                                    args.concurrency))
        rounds.append({"json_schema": constrained, "unconstrained": plain,
                       "ratio": constrained["output_tok_s"] / plain["output_tok_s"],
                       "valid": validity(constrained["results"], [s for _, _, s in workload])})
    return rounds


def run_kvserve(model: Path, workload, args) -> list[dict]:
    executor_args = ["--num-threads", str(args.threads)] if args.threads else []
    config = StackConfig(model_dir=model, kvmanager_port=free_port(), executor_port=free_port(),
                         gateway_port=free_port(), http_port=free_port(), executor_args=executor_args,
                         gateway_args=["--max-num-seqs", str(max(args.concurrency, 8))],
                         log_dir=args.out / "logs", env=service_env())
    stack = start_stack(config)
    try:
        return measure(stack.http_url + "/v1/chat/completions", workload, args)
    finally:
        stack.stop()


async def accepted(url: str, workload) -> list[bool]:
    """Which schemas the server takes (llama-server refuses some shapes, e.g. ``prefixItems``)."""
    async with httpx.AsyncClient(timeout=300) as client:
        async def takes(item) -> bool:
            reply = await client.post(url, json={**schema_body(*item, 1), "stream": False})
            return reply.status_code == 200
        return list(await asyncio.gather(*(takes(item) for item in workload)))


class LlamaServer:
    """llama.cpp's server on the embedded Q4_1 GGUF (what a llama.cpp user runs), ``--peer-threads``,
    one slot per concurrent request, a unified KV of 512 tokens a slot; its structured outputs turn
    the JSON schema into a GBNF grammar."""

    def __init__(self, args):
        self.args = args

    def __enter__(self) -> str:
        import subprocess

        from bench.peers.llama_server import _wait_ready, embedded_gguf, server_command, setup

        binary, _, _ = setup()
        port = free_port()
        cmd = server_command(binary, embedded_gguf(), port=port, threads=self.args.peer_threads,
                             parallel=self.args.concurrency, ctx=512 * self.args.concurrency, alias="smollm2")
        log_path = self.args.out / "logs" / "llama-server.log"
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _wait_ready(f"http://127.0.0.1:{port}", self.proc, 300, log_path)
        return f"http://127.0.0.1:{port}/v1/chat/completions"

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def print_rounds(system: str, rounds: list[dict]) -> None:
    for i, r in enumerate(rounds, 1):
        for slug in ("json_schema", "unconstrained"):
            row = r[slug]
            valid = f"{r['valid']:.0%}" if slug == "json_schema" else ""
            print(f"| {system} | {i} | {slug} | {row['output_tok_s']:.1f} | {row['ttft_p50_ms']:.0f} | "
                  f"{row['ttft_p99_ms']:.0f} | {valid} |")


def main(argv: list[str] | None = None) -> int:
    from executor.prepare_model import default_model_dir, prepare

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="executor --num-threads (default: its own)")
    parser.add_argument("--peers", default="", help="comma-separated: llama-server")
    parser.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured-outputs"))
    args = parser.parse_args(argv)
    model = args.model or prepare(default_model_dir())
    workload = [SCHEMAS[i % len(SCHEMAS)] for i in range(args.num_requests)]
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    cpu = write_lscpu(args.out)
    peers = [p for p in args.peers.split(",") if p]
    if any(p != "llama-server" for p in peers):
        parser.error(f"--peers: only llama-server is known, got {args.peers!r}")
    refused = []
    if peers:  # every system runs the schemas every system takes
        with LlamaServer(args) as url:
            takes = asyncio.run(accepted(url, workload))
        refused = sorted({name for (name, _, _), ok in zip(workload, takes) if not ok})
        workload = [item for item, ok in zip(workload, takes) if ok]
    systems = {"kvserve": run_kvserve(model, workload, args)}
    if peers:
        with LlamaServer(args) as url:
            systems["llama-server"] = measure(url, workload, args)
    mask_us = mask_cost_us(model, workload, systems["kvserve"][-1]["json_schema"]["results"])
    summary = {"command": "python -m bench.structured_outputs " + " ".join(sys.argv[1:] if argv is None else argv),
               "args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu, "lscpu": lscpu_text(),
               "nproc": os.cpu_count(), "mask_us_per_token": mask_us, "refused_by_a_peer": refused,
               "num_requests_run": len(workload), "systems": systems}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(workload)} requests, concurrency {args.concurrency}, CPU: {cpu}")
    if refused:
        print(f"schemas a peer refuses, left out for every system: {', '.join(refused)}")
    print("| system | round | row | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | valid |")
    print("|---|---|---|---:|---:|---:|---:|")
    for system, rounds in systems.items():
        print_rounds(system, rounds)
    for system, rounds in systems.items():
        ratios = [r["ratio"] for r in rounds]
        print(f"{system}: constrained / unconstrained output tok/s {', '.join(f'{x:.3f}' for x in ratios)}")
    ratios = [r["ratio"] for r in systems["kvserve"]]
    print(f"kvserve target >= 0.9: {'met' if min(ratios) >= 0.9 else 'missed'}; gateway mask {mask_us:.0f} us a token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
