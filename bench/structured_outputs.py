"""Structured outputs at load: every request constrained by a JSON schema, against the same
requests unconstrained, on one stack.

    python -m bench.structured_outputs                   # 64 requests, concurrency 32
    python -m bench.structured_outputs --num-requests 32 --concurrency 16 --threads 1
    python -m bench.structured_outputs --peers llama-server   # and llama.cpp's server, side by side
    python -m bench.structured_outputs --peers llama-server,openvino --openvino-threads 1,2

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
grammar), built once by ``bench.peers.llama_server``. ``--peers openvino`` runs them on OpenVINO
GenAI's ``ContinuousBatchingPipeline`` (set up once by ``bench.peers.openvino_peer``: its venv and
the ``--openvino-weights`` IR export), in-process (``bench/peers/openvino_structured_runner.py``,
no HTTP), each request's ``GenerationConfig`` carrying ``StructuredOutputConfig(json_schema=...)``
(xgrammar inside); the same chat prompts as token ids (the gateway's chat template and tokenizer),
greedy, one warm pipeline per ``--openvino-threads`` value, the replies decoded by the gateway's
tokenizer and validated as kvserve's. The schemas a peer refuses are left out for every system,
so all rows run the same requests. Writes ``--out``/results.json and lscpu.txt.
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

from bench.client import sse_chunks
from bench.peers import OPENVINO_WEIGHTS, parse_list
from bench.peers.common import PeerUnavailable, lscpu_text, write_lscpu
from bench.report import percentile
from bench.routing_bench import service_env
from bench.structured_schemas import SCHEMAS
from kvserve.launcher import StackConfig, start_stack
from kvserve.ports import free_port


STRUCTURED_PEERS = ("llama-server", "openvino")


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
        async for chunk in sse_chunks(reply):
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
    return row_summary(results, wall)


def row_summary(results: list[dict], wall: float) -> dict:
    """A row's numbers from its requests' ``ttft_s``, ``latency_s`` and ``tokens``."""
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
        rounds.append(round_summary(constrained, plain, workload))
    return rounds


def round_summary(constrained: dict, plain: dict, workload) -> dict:
    return {"json_schema": constrained, "unconstrained": plain,
            "ratio": constrained["output_tok_s"] / plain["output_tok_s"],
            "valid": validity(constrained["results"], [s for _, _, s in workload])}


def run_kvserve(model: Path, workload, args) -> tuple[list[dict], dict]:
    """(the rounds, the system's facts: its executor's dtype and threads as its log says)."""
    executor_args = ["--num-threads", str(args.threads)] if args.threads else []
    config = StackConfig(model_dir=model, kvmanager_port=free_port(), executor_port=free_port(),
                         gateway_port=free_port(), http_port=free_port(), executor_args=executor_args,
                         gateway_args=["--max-num-seqs", str(max(args.concurrency, 8))],
                         log_dir=args.out / "logs", env=service_env())
    stack = start_stack(config)
    try:
        rounds = measure(stack.http_url + "/v1/chat/completions", workload, args)
    finally:
        stack.stop()
    executor = executor_log_facts(args.out / "logs" / f"executor-{config.executor_port}.log")
    return rounds, {"weights": f"bf16 safetensors, compute {executor.get('dtype', '?')}",
                    "threads": executor.get("torch_threads", args.threads or "?"),
                    "kv": f"{executor.get('kv', '?')}", "transport": "HTTP"}


def executor_log_facts(path: Path) -> dict:
    """The executor's compute dtype, torch threads and KV cache, read from its JSON log lines."""
    facts: dict = {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return facts
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "model_loaded":
            facts["dtype"] = event.get("dtype")
        elif event.get("event") == "executor_ready":
            facts["torch_threads"] = event.get("torch_threads")
        elif event.get("event") == "kv_cache_allocated":
            facts["kv"] = f"{event.get('bytes', 0) / 2**30:.1f} GiB, {event.get('kv_cache_dtype')} K/V"
    return facts


def parse_threads(text: str) -> list[int]:
    """``1,2`` -> [1, 2]: positive thread counts, in order, without repeats."""
    counts: list[int] = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"a thread count is a positive integer, got {item!r}")
        if int(item) not in counts:
            counts.append(int(item))
    if not counts:
        raise ValueError("no thread count given")
    return counts


def openvino_requests(tokenizer, workload) -> list[dict]:
    """The runner's requests: each chat prompt as the gateway renders and tokenizes it (so both
    systems prefill the same ids), its schema as JSON text."""
    return [{"name": name, "input_ids": tokenizer.encode(tokenizer.apply_chat_template(
                 [{"role": "user", "content": prompt}])), "schema": json.dumps(schema)}
            for name, prompt, schema in workload]


def openvino_row(row: dict, tokenizer) -> dict:
    """A runner's row as ``run_row``'s: each reply decoded (special tokens skipped, as the gateway
    streams it), its tokens every generated id."""
    results = [{"ttft_s": r["ttft_s"], "latency_s": r["latency_s"], "tokens": len(r["token_ids"]),
                "text": tokenizer.decode(r["token_ids"]), "finish_reason": r.get("finish_reason"),
                "error": r.get("error") or ""} for r in row["results"]]
    return row_summary(results, row["wall_s"])


def openvino_rounds(payload: dict, tokenizer, workload) -> list[dict]:
    return [round_summary(openvino_row(r["json_schema"], tokenizer), openvino_row(r["unconstrained"], tokenizer),
                          workload) for r in payload["rounds"]]


def openvino_system(weight_format: str, threads: int) -> str:
    return f"OpenVINO GenAI {weight_format.upper()} IR, {threads} thread{'s' if threads != 1 else ''} (in-process)"


class OpenVINO:
    """OpenVINO GenAI's ContinuousBatchingPipeline on the ``--openvino-weights`` IR of the same HF
    directory, in-process: prefix caching on (the warm pass fills it, as kvserve's), dynamic
    split-fuse, ``max_num_batched_tokens`` 2048 and ``max_num_seqs`` as kvserve's gateway, a 1 GB
    KV cache (kvserve's CPU default) in the plugin's default K/V precision, the plugin's default
    inference precision (``--openvino-precision`` to set it), ``INFERENCE_NUM_THREADS``."""

    def __init__(self, args, model: Path):
        from bench.peers.openvino_peer import export, setup_venv

        self.args, self.model = args, model
        self.python, install_s = setup_venv()
        self.ir_dir, export_s = export(self.python, model, args.openvino_weights)
        self.setup = {"install_s": install_s, "export_s": export_s}

    def job(self, mode: str, requests: list[dict], threads: int) -> dict:
        return {"model_dir": str(self.ir_dir), "threads": threads, "inference_precision": self.args.openvino_precision,
                "cache_size_gb": 1, "max_num_batched_tokens": 2048,
                "max_num_seqs": max(self.args.concurrency, 8), "mode": mode, "requests": requests,
                "concurrency": self.args.concurrency, "max_tokens": self.args.max_tokens, "rounds": self.args.rounds}

    def refused(self, requests: list[dict]) -> dict[str, str]:
        """{schema name: OpenVINO's message} for the schemas it refuses."""
        from bench.peers.openvino_peer import run_structured

        job = self.job("probe", requests, max(self.args.openvino_threads))
        return run_structured(self.python, job, self.args.out / "logs", "openvino-probe")["refused"]

    def measure(self, requests: list[dict], threads: int) -> dict:
        from bench.peers.openvino_peer import run_structured

        return run_structured(self.python, self.job("measure", requests, threads), self.args.out / "logs",
                              f"openvino-structured-{self.args.openvino_weights}-{threads}t")

    def facts(self, payload: dict, threads: int) -> dict:
        from bench.peers.openvino_peer import WEIGHT_FORMATS

        facts = payload.get("facts", {})
        weights = WEIGHT_FORMATS.get(self.args.openvino_weights, self.args.openvino_weights)
        return {"weights": f"{weights} IR, compute {facts.get('INFERENCE_PRECISION_HINT', '?')}", "threads": threads,
                "kv": f"1 GB, {facts.get('KV_CACHE_PRECISION', '?')} K/V", "transport": "in-process",
                "openvino": facts.get("openvino", "?"), "openvino_genai": facts.get("openvino_genai", "?"),
                **({"note": facts["fallback"]} if facts.get("fallback") else {}), **self.setup}


def keep_accepted(workload, refusals: dict[str, dict[str, str]]):
    """(the workload without any schema some system refuses, the refused names sorted)."""
    refused = sorted({name for by_system in refusals.values() for name in by_system})
    return [item for item in workload if item[0] not in refused], refused


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
    parser.add_argument("--peers", default="", help="comma-separated: llama-server, openvino")
    parser.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1, help="llama-server's threads")
    parser.add_argument("--openvino-threads", default=f"1,{os.cpu_count() or 1}",
                        help="comma-separated INFERENCE_NUM_THREADS values, one OpenVINO system each")
    parser.add_argument("--openvino-weights", default="fp16", choices=OPENVINO_WEIGHTS,
                        help="the IR's weights (fp16: beside kvserve's bf16 checkpoint)")
    parser.add_argument("--openvino-precision", default=None, choices=["bf16", "f16", "f32"],
                        help="INFERENCE_PRECISION_HINT (default: the CPU plugin's; a run dying with SIGFPE there "
                             "runs again in f32)")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured-outputs"))
    args = parser.parse_args(argv)
    try:
        peers = parse_list(args.peers, STRUCTURED_PEERS, "peer")
        args.openvino_threads = parse_threads(args.openvino_threads)
    except ValueError as exc:
        parser.error(str(exc))
    model = args.model or prepare(default_model_dir())
    workload = [SCHEMAS[i % len(SCHEMAS)] for i in range(args.num_requests)]
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    cpu = write_lscpu(args.out)
    refusals: dict[str, dict[str, str]] = {}  # every system runs the schemas every system takes
    skipped: dict[str, str] = {}
    if "llama-server" in peers:
        with LlamaServer(args) as url:
            takes = asyncio.run(accepted(url, workload))
        refusals["llama-server"] = {name: "HTTP error" for (name, _, _), ok in zip(workload, takes) if not ok}
    openvino = None
    if "openvino" in peers:
        from gateway.detokenizer import ModelTokenizer

        tokenizer = ModelTokenizer(model)
        try:
            openvino = OpenVINO(args, model)
            refusals["openvino"] = openvino.refused(openvino_requests(tokenizer, workload))
        except PeerUnavailable as exc:
            skipped["openvino"] = str(exc)
            openvino = None
            print(f"OpenVINO GenAI skipped: {exc}")
    workload, refused = keep_accepted(workload, refusals)
    load_before = os.getloadavg()[0]
    rounds, kvserve_facts = run_kvserve(model, workload, args)
    systems, facts = {"kvserve": rounds}, {"kvserve": {**kvserve_facts, "loadavg_1m": [load_before,
                                                                                      os.getloadavg()[0]]}}
    if "llama-server" in peers:
        load_before = os.getloadavg()[0]
        with LlamaServer(args) as url:
            systems["llama-server"] = measure(url, workload, args)
        facts["llama-server"] = {"weights": "Q4_1 GGUF", "threads": args.peer_threads,
                                 "kv": f"{512 * args.concurrency} tokens, unified", "transport": "HTTP",
                                 "loadavg_1m": [load_before, os.getloadavg()[0]]}
    if openvino is not None:
        requests = openvino_requests(tokenizer, workload)
        for threads in args.openvino_threads:
            name = openvino_system(args.openvino_weights, threads)
            load_before = os.getloadavg()[0]
            try:
                payload = openvino.measure(requests, threads)
            except PeerUnavailable as exc:
                skipped[name] = str(exc)
                print(f"{name} failed: {exc}")
                continue
            systems[name] = openvino_rounds(payload, tokenizer, workload)
            facts[name] = {**openvino.facts(payload, threads), "loadavg_1m": [load_before, os.getloadavg()[0]]}
    mask_us = mask_cost_us(model, workload, systems["kvserve"][-1]["json_schema"]["results"])
    summary = {"command": "python -m bench.structured_outputs " + " ".join(sys.argv[1:] if argv is None else argv),
               "args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu, "lscpu": lscpu_text(),
               "nproc": os.cpu_count(), "mask_us_per_token": mask_us, "refused_by_a_peer": refused,
               "refusals": refusals, "skipped": skipped, "num_requests_run": len(workload), "facts": facts,
               "systems": systems}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    print(f"{len(workload)} requests, concurrency {args.concurrency}, CPU: {cpu}")
    if refused:
        by = {name: [system for system, names in refusals.items() if name in names] for name in refused}
        print("schemas a peer refuses, left out for every system: "
              + ", ".join(f"{name} ({', '.join(systems_)})" for name, systems_ in by.items()))
    print("| system | weights | threads | KV | transport | load avg before, after |")
    print("|---|---|---:|---|---|---|")
    for system, fact in facts.items():
        print(f"| {system} | {fact['weights']} | {fact['threads']} | {fact['kv']} | {fact['transport']} | "
              f"{', '.join(f'{x:.1f}' for x in fact['loadavg_1m'])} |")
    print()
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
