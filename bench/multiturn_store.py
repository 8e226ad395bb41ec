"""Multi-turn chats whose KV outgrows the executor's pool: the KV store tier against recompute.

    python -m bench.multiturn_store                     # 16 conversations x 3 turns, all six rows
    python -m bench.multiturn_store --rows off,directory --num-conversations 8 --turns 2
    python -m bench.multiturn_store --rows two-off,two-directory
    python -m bench.multiturn_store --workload long-context --rows off,directory,redis,restart

Two workloads, both a seeded draw of ShareGPT conversations with ``--turns``+ exchanges.
``--workload sharegpt`` (the default): each conversation cut to its first ``--turns`` user turns
(user messages truncated so that the context at the last turn stays within ``--max-context``).
ShareGPT turns are short, so a round is mostly decoding and the store has little prefill to
save. ``--workload long-context``, the shape of coding-session and document-QA traffic (a long
shared context, short turns): the first user turn pastes a document, the conversation's
assistant replies joined and cut to ``--document-tokens`` (768), then asks a question; each later
turn asks one more. The questions are the conversation's user turns cut to ``--question-tokens``
(48). Where the last turn would pass ``--max-context``, the document shrinks to fit (results.json's
``workload`` has ``kind``, the document tokens asked for and the least/mean/most kept; the
report's first line too). Every turn of a conversation starts with its document; no two
conversations' documents open alike. Defaults: 16 conversations x 3 turns, a working set of about
15.9k tokens (4x the pool); the four single-executor rows take an estimated 8 minutes on 2 cores
(2.3 ms/token prefill, about 0.12 s a decode step), the two-executor rows about 5.
Results go to ``bench/results/multiturn-store-long-context`` unless ``--out`` says otherwise.

Turn *k*'s prompt is the history, with the replies the model generated (greedy, streamed
``/v1/chat/completions`` with usage), plus user turn *k*. Round *k* sends turn *k* of every
conversation, ``--concurrency`` in flight, so a conversation returns only after the other
sessions' turns. The executor's pool holds about 1/4 of all conversations' last-turn context.
Rows, each a fresh kvmanager + executor + gateway on free ports: ``off`` (no ``--kv-store``),
``directory`` (a temp dir), ``redis`` (a redis-server started here), ``restart`` (directory;
the executor is SIGKILLed between rounds 1 and 2, once kvmanager has the round's saves, and
started again on its port with the same flags); ``two-off`` and ``two-directory`` (both on one
temp dir) have two executors (the gateway's ``--executor-address A,B``, routing ``kv``), each
with half the pool rounded up (never less than the longest conversation needs) and half of
``--num-threads`` (at least 1: on the default 2, ``--num-threads 1`` each, so the two share the
cores one executor has; the single-executor rows keep ``--num-threads``). Over rounds 2+:
TTFT p50/p90 (first streamed chunk), output tokens / wall time, prefix hit rate (sum of usage
``cached_tokens`` / ``prompt_tokens``: pool + store hits), ``kvserve:kv_store_hit_tokens_total``;
kvmanager's GetStats of every pool. Then, in this process: the best of 3 512-token prefills
(``ModelRunner.execute``) against the best of 10 loads of its 32 blocks (``BlockMover.load``) from
the directory store (files in the page cache) and Redis (``--dtype auto``: the executor's choice,
reported with the prefill). Writes ``--out``/results.json (every number, per-turn records, lscpu),
lscpu.txt, logs/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.client import sse_chunks
from bench.peers.common import lscpu_text, write_lscpu
from bench.report import percentile
from bench.cluster import Cluster, service_env, start_cluster, wait_ready
from bench.routing_bench import ChatTokenizer, Conversation, truncate
from kvserve.ports import free_port

BLOCK = 16
POOL_FRACTION = 4  # the working set is this many times the pool
MAX_MODEL_LEN = 2048  # every executor's --max-model-len


@dataclass(frozen=True)
class Row:
    name: str
    executors: int = 1  # each an executor process with its own pool, behind one gateway
    store: str = "directory"  # --kv-store: "" (none), "directory" (a temp dir, shared by the executors), "redis"
    restart: bool = False  # SIGKILL and restart the executor between rounds 1 and 2


ROWS = {"off": Row("store off", store=""), "directory": Row("directory store"),
        "redis": Row("redis store", store="redis"), "restart": Row("directory store, executor restarted", restart=True),
        "two-off": Row("two executors, store off", 2, store=""),
        "two-directory": Row("two executors, one shared directory store", 2)}
STORE_HITS = ("kvserve:kv_store_hit_tokens_total", "kvserve:kv_store_hit_tokens")


# --- the workload --------------------------------------------------------------------------


WORKLOADS = ("sharegpt", "long-context")
DOCUMENT_INTRO = "Here is a document. Read it, then answer my questions about it.\n\n"


@dataclass
class Chat:
    user_turns: list[str]
    context_tokens: int  # at the last turn, its reply included (estimated: replies of max_tokens)
    document_tokens: int = 0  # long-context: the document's tokens (it opens the first user turn)


def fair_caps(lengths: list[int], budget: int) -> list[int]:
    """Token caps summing to at most ``budget``: short messages keep everything, the longer
    ones share what is left evenly."""
    caps, left = [0] * len(lengths), budget
    for n, i in enumerate(sorted(range(len(lengths)), key=lengths.__getitem__)):
        caps[i] = max(0, min(lengths[i], left // (len(lengths) - n)))
        left -= caps[i]
    return caps


def build_chats(conversations: list[Conversation], tokenizer: ChatTokenizer, *, num: int, turns: int,
                max_tokens: int, max_context: int, seed: int) -> list[Chat]:
    """``num`` conversations with ``turns`` user turns each (seeded draw), truncated to fit ``max_context``."""
    skeleton = [{"role": role, "content": ""} for _ in range(turns) for role in ("user", "assistant")][:-1]
    overhead = len(tokenizer.chat_ids(skeleton))  # template tokens, the empty replies' end-of-turn included
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    chats = []
    for i in order:
        if len(conversations[i].exchanges) < turns:
            continue
        ids = [tokenizer.encode(user) for user, _ in conversations[i].exchanges[:turns]]
        caps = fair_caps([len(x) for x in ids], max_context - overhead - turns * max_tokens)
        texts = [tokenizer.decode(x[:cap]) if cap < len(x) else user
                 for x, cap, (user, _) in zip(ids, caps, conversations[i].exchanges)]
        if all(t.strip() for t in texts):
            chats.append(Chat(texts, overhead + sum(caps) + turns * max_tokens))
            if len(chats) == num:
                return chats
    raise ValueError(f"only {len(chats)} ShareGPT conversations have {turns}+ turns; asked for {num}")


def build_long_context_chats(conversations: list[Conversation], tokenizer: ChatTokenizer, *, num: int, turns: int,
                              max_tokens: int, max_context: int, document_tokens: int, question_tokens: int,
                              seed: int) -> list[Chat]:
    """``num`` document-QA conversations (seeded draw of ShareGPT ones with ``turns``+ exchanges): the
    first user turn pastes a document, the ShareGPT conversation's assistant replies joined and cut
    to ``document_tokens`` (conversations with fewer reply tokens, or a document opening like an
    earlier one's, are passed over), then asks its first question; each later turn asks one more.
    The questions are the conversation's user turns cut to ``question_tokens``. The document shrinks
    until the last turn (template, document, questions, ``max_tokens`` per reply) fits ``max_context``."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    chats, openings = [], set()
    for i in order:
        exchanges = conversations[i].exchanges
        if len(exchanges) < turns:
            continue
        questions = [truncate(tokenizer, user, question_tokens).strip() for user, _ in exchanges[:turns]]
        replies = "\n\n".join(reply.strip() for _, reply in exchanges)[:16 * document_tokens]  # ample for the cut
        ids = tokenizer.encode(replies)
        if not all(questions) or len(ids) < document_tokens or tuple(ids[:2 * BLOCK]) in openings:
            continue
        size = document_tokens
        while True:
            document = tokenizer.decode(ids[:size]).strip()
            user_turns = [f"{DOCUMENT_INTRO}{document}\n\n{questions[0]}", *questions[1:]]
            skeleton = [{"role": role, "content": text if role == "user" else ""}
                        for text in user_turns for role in ("user", "assistant")][:-1]
            context = len(tokenizer.chat_ids(skeleton)) + turns * max_tokens
            if context <= max_context:
                break
            size -= context - max_context
            if size < 2 * BLOCK:
                raise ValueError(f"--max-context {max_context} leaves no room for a document after {turns} "
                                 f"questions of up to {question_tokens} tokens and replies of {max_tokens}")
        openings.add(tuple(ids[:2 * BLOCK]))
        chats.append(Chat(user_turns, context, len(tokenizer.encode(document))))
        if len(chats) == num:
            return chats
    raise ValueError(f"only {len(chats)} ShareGPT conversations have {turns}+ turns and {document_tokens}+ "
                     f"reply tokens; asked for {num}")


def build_workload(conversations: list[Conversation], tokenizer: ChatTokenizer, args) -> list[Chat]:
    """``args.workload``'s conversations: ``build_chats`` (sharegpt) or ``build_long_context_chats``."""
    common = {"num": args.num_conversations, "turns": args.turns, "max_tokens": args.max_tokens,
              "max_context": args.max_context, "seed": args.seed}
    if args.workload == "long-context":
        return build_long_context_chats(conversations, tokenizer, document_tokens=args.document_tokens,
                                        question_tokens=args.question_tokens, **common)
    return build_chats(conversations, tokenizer, **common)


def describe_workload(args, chats: list[Chat]) -> dict:
    """results.json's ``workload``: its kind, its parameters (long-context: the document tokens asked
    for and the least, mean and most pasted) and every conversation."""
    out = {"kind": args.workload, "conversations": len(chats), "turns": args.turns, "max_tokens": args.max_tokens,
           "max_context": args.max_context, "concurrency": args.concurrency, "seed": args.seed}
    if args.workload == "long-context":
        docs = [c.document_tokens for c in chats]
        out.update(document_tokens=args.document_tokens, question_tokens=args.question_tokens,
                   document_tokens_min=min(docs), document_tokens_mean=sum(docs) / len(docs),
                   document_tokens_max=max(docs))
    return {**out, "chats": [asdict(c) for c in chats]}


def plan_pool(chats: list[Chat], block_size: int = BLOCK, fraction: int = POOL_FRACTION) -> dict:
    """``--num-blocks`` (one of them the null block) for a pool of 1/``fraction`` of the working set,
    and for each of two executors' pools half of it rounded up; never less than one conversation's
    last turn needs (a request that cannot fit an executor's pool fails)."""
    total = sum(c.context_tokens for c in chats)
    least = -(-max(c.context_tokens for c in chats) // block_size) + 1
    blocks = max(total // fraction // block_size, least)
    half = max(-(-blocks // 2), least)
    return {"working_set_tokens": total, "num_blocks": blocks + 1, "pool_tokens": blocks * block_size,
            "ratio": total / (blocks * block_size), "two_num_blocks": half + 1,
            "two_ratio": total / (2 * half * block_size)}


# --- one row -------------------------------------------------------------------------------


async def send_turn(client, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat turn: TTFT (first chunk with a choice), its text and its usage."""
    import httpx

    out = {"ttft": None, "e2e": None, "text": "", "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0,
           "error": ""}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                out["error"] = f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')[:300]}"
                return out
            async for chunk in sse_chunks(reply):
                out["error"] = str(chunk.get("error", ""))[:300] or out["error"]
                for choice in chunk.get("choices") or []:
                    out["ttft"] = out["ttft"] or time.perf_counter() - start
                    out["text"] += (choice.get("delta") or {}).get("content") or ""
                if usage := chunk.get("usage"):
                    out["prompt_tokens"], out["output_tokens"] = usage["prompt_tokens"], usage["completion_tokens"]
                    out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["e2e"] = time.perf_counter() - start
    out["error"] = out["error"] or ("" if out["ttft"] is not None else "no output")
    return out


def hit_rate(turns: list[dict]) -> float | None:
    ok = [t for t in turns if not t["error"]]
    prompt = sum(t["prompt_tokens"] for t in ok)
    return sum(t["cached_tokens"] for t in ok) / prompt if prompt else None


async def play(url: str, chats: list[Chat], args, between_rounds=None) -> tuple[list[dict], dict]:
    """Every round in turn; returns the rounds and what the gateway counted over rounds 2+."""
    import httpx

    from bench.server_metrics import COUNTERS, parse_prometheus, pick

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=30.0)) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        if (warm := await send_turn(client, url, model, [{"role": "user", "content": "Say hello."}], 4))["error"]:
            raise RuntimeError(f"warm-up request failed: {warm['error']}")
        histories: list[list[dict]] = [[] for _ in chats]
        rounds, before = [], {}
        for k in range(args.turns):
            if k == 1:
                if between_rounds:
                    await asyncio.to_thread(between_rounds)
                before = parse_prometheus((await client.get(url + "/metrics")).text)
            gate = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> dict:
                messages = histories[i] + [{"role": "user", "content": chats[i].user_turns[k]}]
                async with gate:
                    result = await send_turn(client, url, model, messages, args.max_tokens)
                histories[i] = messages + [{"role": "assistant", "content": result["text"]}]
                return {"conversation": i, **result}

            t0 = time.perf_counter()
            turns = await asyncio.gather(*(one(i) for i in range(len(chats))))
            rounds.append({"round": k + 1, "wall_s": time.perf_counter() - t0, "turns": turns})
            print(f"   round {k + 1}: {rounds[-1]['wall_s']:.1f} s, hit rate {fmt(hit_rate(turns), '.1%')}",
                  file=sys.stderr, flush=True)
        after = parse_prometheus((await client.get(url + "/metrics")).text)
    names = {**COUNTERS, "store_hit_tokens": STORE_HITS}
    return rounds, {key: (pick(after, n) or 0.0) - (pick(before, n) or 0.0) for key, n in names.items()}


def pool_stats(kvmanager_address: str, executor_address: str) -> dict:
    """kvmanager's GetStats of the executor's pool (store_hits, num_store_blocks, num_store_saves...)."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

    with grpc.insecure_channel(kvmanager_address) as channel:
        reply = kvmanager_pb2_grpc.KVManagerStub(channel).GetStats(
            kvmanager_pb2.GetStatsRequest(pool_id=f"executor@{executor_address}"), timeout=10)
    return MessageToDict(reply, preserving_proto_field_name=True)


def row_setup(slug: str, pool: dict, args, store_dir: str, redis_url: str) -> dict:
    """A row's services, decided before any starts: ``executors``, each executor's flags (the same
    ``--kv-store`` for all: one directory, or Redis); ``threads``, each executor's ``--num-threads``:
    ``args.num_threads`` split among the row's executors (at least 1; two executors on the default
    2 get 1 each, a single executor keeps all of them); ``env``, the services' environment (OpenMP
    and MKL limited to ``threads``)."""
    spec = ROWS[slug]
    threads = max(1, args.num_threads // spec.executors)
    store = {"": [], "redis": ["--kv-store", redis_url]}.get(spec.store, ["--kv-store", store_dir])
    blocks = pool["num_blocks"] if spec.executors == 1 else pool["two_num_blocks"]
    flags = ["--model", str(args.model), "--dtype", args.dtype, "--num-blocks", str(blocks), "--block-size",
             str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", str(threads), *store]
    return {"executors": [list(flags) for _ in range(spec.executors)], "threads": threads,
            "env": service_env(threads)}


def start_row_stack(executor_args: list[list[str]], model: Path, env: dict, log_dir: Path) -> Cluster:
    """kvmanager, one executor per entry of ``executor_args`` (its flags) and a gateway with all of
    them (bench/cluster.py); returns once the gateway has them all up."""
    return start_cluster(executor_args, ["--model", str(model), "--unavailable-timeout", "300"], log_dir, env=env)


def restart_executor(stack: Cluster, executor_args: list[str], env: dict, log_dir: Path) -> float:
    """Once kvmanager's count of saves stands still for 1 s: SIGKILL the (first) executor, start it
    again on its port with the same flags, wait for the gateway to have it up. Returns the seconds."""
    from kvserve.launcher import start_healthy

    executor = stack.executors[0]
    saves, deadline = None, time.monotonic() + 60
    while time.monotonic() < deadline:
        now = pool_stats(stack.kvmanager.address, executor.address).get("num_store_saves")
        if now == saves:
            break
        saves = now
        time.sleep(1.0)
    t0 = time.perf_counter()
    executor.proc.kill()
    executor.proc.wait()
    stack.executors[0] = start_healthy("executor", executor_args, port=executor.port, timeout=300, env=env,
                                       log_path=log_dir / f"executor-{executor.port}-restarted.log")
    wait_ready(stack, time.monotonic() + 300)
    return time.perf_counter() - t0


def run_row(slug: str, chats: list[Chat], pool: dict, args, redis_url: str) -> dict:
    """A fresh stack for the row, the rounds on it, its numbers over rounds 2+."""
    spec = ROWS[slug]
    log_dir = args.out / "logs" / slug
    log_dir.mkdir(parents=True, exist_ok=True)
    store_dir = tempfile.mkdtemp(prefix=f"kvserve-bench-{slug}-")
    setup = row_setup(slug, pool, args, store_dir, redis_url)
    executor_args, env = setup["executors"][0], setup["env"]
    row = {"slug": slug, "name": spec.name, "executors": spec.executors, "threads_per_executor": setup["threads"],
           "executor_args": executor_args}
    t0 = time.perf_counter()
    stack = start_row_stack(setup["executors"], args.model, env, log_dir)
    row["startup_s"] = time.perf_counter() - t0
    restart = lambda: row.update(restart_s=restart_executor(stack, executor_args, env, log_dir))  # noqa: E731
    try:
        rounds, row["gateway_counters"] = asyncio.run(play(stack.http_url, chats, args,
                                                          restart if spec.restart else None))
        row["kvmanager_stats"] = {f"executor@{e.address}": pool_stats(stack.kvmanager.address, e.address)
                                  for e in stack.executors}
    finally:
        stack.stop()
        shutil.rmtree(store_dir, ignore_errors=True)
    later = [t for r in rounds[1:] for t in r["turns"]]
    ok = [t for t in later if not t["error"]]
    ttft, wall = [1000 * t["ttft"] for t in ok], sum(r["wall_s"] for r in rounds[1:])
    return {**row, "completed": len(ok), "failed": len(later) - len(ok), "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p90_ms": percentile(ttft, 90), "output_tok_s": sum(t["output_tokens"] for t in ok) / wall,
            "hit_rate": hit_rate(later), "round1_hit_rate": hit_rate(rounds[0]["turns"]),
            "store_hit_tokens": row["gateway_counters"]["store_hit_tokens"], "rounds": rounds,
            "errors": sorted({t["error"] for r in rounds for t in r["turns"] if t["error"]})[:5]}


@contextmanager
def redis_server(data_dir: Path):
    """A throwaway redis-server on a free loopback port, no persistence; yields (URL, client)."""
    import redis
    from redis.backoff import ConstantBackoff
    from redis.retry import Retry

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(data_dir)], stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, retry=Retry(ConstantBackoff(0.05), 200))  # retried while it starts
        client.ping()
        yield f"redis://127.0.0.1:{port}/0", client
    finally:
        proc.kill()
        proc.wait()


# --- load vs prefill, in-process -----------------------------------------------------------


def load_vs_prefill(args, stores: dict[str, str], tokens: int = 512) -> dict:
    """Best-of-3 ms of a ``tokens``-token prefill and best-of-10 of loading its blocks back from
    each store (the least disturbed numbers on a shared machine)."""
    import torch

    from executor.devices import dtype_name
    from executor.kv_tier import BlockMover
    from executor.runner import ModelRunner, RunnerOptions, SequenceInput
    from kvserve.kv_store import block_hash_of, open_store

    torch.set_num_threads(args.num_threads)
    table = list(range(1, tokens // BLOCK + 1))
    runner = ModelRunner(RunnerOptions(args.model, dtype=args.dtype, num_blocks=len(table) + 1, block_size=BLOCK,
                                       kv_store=stores["directory"]))
    seq = SequenceInput(0, [(17 * i) % 40000 + 100 for i in range(tokens)], 0, table, sample=True)

    def best_ms(fn, repeats: int) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return min(times)

    prefill_ms = best_ms(lambda: runner.execute([seq]), 3)
    keys = [f"bench-multiturn-{i}".encode() for i in table]
    hashes = [block_hash_of(k) for k in keys]
    out = {"tokens": tokens, "dtype": dtype_name(runner.dtype), "threads": args.num_threads, "prefill_ms": prefill_ms,
           "bytes_per_block": runner.store_mover.bytes_per_block, "prefill_us_per_token": 1e3 * prefill_ms / tokens}
    for name, url in stores.items():
        mover = runner.store_mover if name == "directory" else \
            BlockMover(open_store(url), runner.store_mover.namespace, runner.kv_caches)
        saved, missing = sum(mover.save(table, hashes, keys)), []
        load_ms = best_ms(lambda: missing.extend(mover.load(table, hashes)), 10)
        out.setdefault("stores", {})[name] = {
            "load_ms": load_ms, "load_us_per_token": 1e3 * load_ms / tokens, "saved": saved,
            "missed_loads": len(missing), "MB_per_s": mover.bytes_per_block * len(table) / load_ms / 1e3,
            "load_over_prefill": load_ms / prefill_ms}
    return out


# --- report --------------------------------------------------------------------------------


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_report(results: dict) -> str:
    """The Markdown table, the ratios, the load-vs-prefill lines and ``lscpu | head -20``."""
    w, p = results["workload"], results["pool"]
    if w.get("kind", "sharegpt") == "long-context":
        what = (f"{w['conversations']} long-context conversations (workload long-context: a pasted document of "
                f"{w['document_tokens']} tokens asked, {w['document_tokens_min']}-{w['document_tokens_max']} kept, "
                f"mean {w['document_tokens_mean']:.0f}; questions of up to {w['question_tokens']} tokens)")
    else:
        what = f"{w['conversations']} ShareGPT conversations"
    lines = [f"{what} x {w['turns']} turns, max_tokens {w['max_tokens']}, "
             f"concurrency {w['concurrency']}: working set {p['working_set_tokens']} tokens at the last turn vs "
             f"pool {p['pool_tokens']} tokens ({p['num_blocks']} blocks incl. the null block) = {p['ratio']:.1f}x; "
             f"two executors: {p['two_num_blocks']} blocks each = {p['two_ratio']:.1f}x",
             "", "| row | TTFT p50 (ms) | TTFT p90 (ms) | output tok/s | prefix hit rate | store hit tokens |",
             "|---|---:|---:|---:|---:|---:|"]
    done = {r["slug"]: r for r in results["rows"] if not r.get("skipped")}
    for r in results["rows"]:
        lines.append(f"| {r['name']} | skipped: {r['skipped']} | | | | |" if r.get("skipped") else
                     f"| {r['name']} | {fmt(r['ttft_p50_ms'], '.0f')} | {fmt(r['ttft_p90_ms'], '.0f')} | "
                     f"{fmt(r['output_tok_s'], '.1f')} | {fmt(r['hit_rate'], '.1%')} | {r['store_hit_tokens']:.0f} |")
    lines.append("")
    pairs = [(done.get("off"), r, "off/store", "store/off") for slug, r in done.items()
             if slug != "off" and ROWS[slug].executors == 1]
    pairs.append((done.get("two-off"), done.get("two-directory"), "two-off/two-directory", "two-directory/two-off"))
    for off, r, p50_label, tput_label in (pair for pair in pairs if pair[0] and pair[1]):
        p50 = off["ttft_p50_ms"] / r["ttft_p50_ms"] if off["ttft_p50_ms"] and r["ttft_p50_ms"] else None
        tput = r["output_tok_s"] / off["output_tok_s"] if off["output_tok_s"] else None
        lines.append(f"- {r['name']}: TTFT p50 {p50_label} = {fmt(p50, '.2f')}x, throughput {tput_label} = "
                     f"{fmt(tput, '.2f')}x")
    restart, same = done.get("restart"), done.get("directory")
    if restart and same and restart["hit_rate"] is not None and same["hit_rate"]:
        kept = restart["hit_rate"] / same["hit_rate"]
        lines.append(f"- executor restarted: hit rate of rounds 2+ {restart['hit_rate']:.1%} vs {same['hit_rate']:.1%} "
                     f"without the restart = {kept:.0%} (target >= 90%: {'HOLDS' if kept >= 0.9 else 'MISSED'})")
    lp = results.get("load_vs_prefill") or {}
    for name, s in lp.get("stores", {}).items():
        lines.append(f"- load from the {name} store: {s['load_us_per_token']:.1f} us/token ({s['MB_per_s']:.0f} "
                     f"MB/s) vs prefill {lp['prefill_us_per_token']:.1f} us/token ({lp['tokens']} tokens, "
                     f"{lp['dtype']}, {lp['threads']} threads) = {s['load_over_prefill']:.1%} (target <= 5%: "
                     f"{'HOLDS' if s['load_over_prefill'] <= 0.05 else 'MISSED'})")
    lines += [f"- {r['name']}: errors: {r['errors']}" for r in done.values() if r["errors"]]
    return "\n".join(lines + ["", "lscpu | head -20:", *results.get("lscpu", "").splitlines()[:20]])


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The flags (``--out`` resolved for the workload) and the rows asked for."""
    from kvserve.paths import default_model_dir

    parser = argparse.ArgumentParser(prog="python -m bench.multiturn_store", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="sharegpt",
                        help="sharegpt: ShareGPT's user turns; long-context: a pasted document, then short questions")
    parser.add_argument("--document-tokens", type=int, default=768,
                        help="long-context: the document's tokens (fewer where --max-context needs)")
    parser.add_argument("--question-tokens", type=int, default=48, help="long-context: a question's tokens at most")
    parser.add_argument("--num-conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3, help="user turns per conversation (= rounds)")
    parser.add_argument("--max-tokens", type=int, default=32, help="reply tokens per turn at most (greedy)")
    parser.add_argument("--max-context", type=int, default=1024, help="a conversation's tokens at its last turn")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-threads", type=int, default=2,
                        help="the cores of a row: a single executor's --num-threads, split evenly among the "
                        "two-executor rows' executors (1 each at 2); this process's for load vs prefill")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    parser.add_argument("--dtype", default="auto", help="executor --dtype (auto: the executor's choice, "
                        "bfloat16 where the CPU runs it natively, else float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--out", type=Path, help="default: bench/results/multiturn-store (sharegpt), "
                        "bench/results/multiturn-store-long-context (long-context)")
    args = parser.parse_args(argv)
    suffix = "-long-context" if args.workload == "long-context" else ""
    args.out = args.out or Path(f"bench/results/multiturn-store{suffix}")
    wanted = [s.strip() for s in args.rows.split(",") if s.strip()]
    if not wanted or set(wanted) - ROWS.keys() or args.turns < 2:
        parser.error(f"--rows: a comma list of {', '.join(ROWS)}; --turns: at least 2")
    if args.max_context > MAX_MODEL_LEN:
        parser.error(f"--max-context: at most the executors' --max-model-len {MAX_MODEL_LEN}")
    return args, wanted


def main(argv: list[str] | None = None) -> int:
    args, wanted = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))  # unwinds through the stacks' stop()
    started = time.perf_counter()
    from bench.routing_bench import ModelChatTokenizer, load_conversations

    chats = build_workload(load_conversations(min_turns=args.turns), ModelChatTokenizer(args.model), args)
    results = {"command": "python -m bench.multiturn_store " + " ".join(sys.argv[1:] if argv is None else argv),
               "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "args": {k: str(v) for k, v in vars(args).items()},
               "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
               "workload": describe_workload(args, chats),
               "pool": plan_pool(chats), "lscpu": lscpu_text(), "lscpu_summary": write_lscpu(args.out), "rows": []}
    print(format_report(results).split("\n")[0], file=sys.stderr)
    save = lambda: (args.out / "results.json").write_text(json.dumps(results, indent=1))  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp, redis_server(Path(tmp)) as (redis_url, redis):
        for slug in wanted:
            print(f"== {ROWS[slug].name}", file=sys.stderr, flush=True)
            redis.flushall()
            try:
                row = run_row(slug, chats, results["pool"], args, redis_url)
            except Exception as exc:  # a broken row must not lose the others
                row = {"slug": slug, "name": ROWS[slug].name, "skipped": f"{type(exc).__name__}: {exc}"[:1500]}
            results["rows"].append(row)
            save()
        print("== load vs prefill, in-process", file=sys.stderr, flush=True)
        redis.flushall()
        results["load_vs_prefill"] = load_vs_prefill(args, {"directory": str(Path(tmp) / "store"), "redis": redis_url})
    results["wall_s"] = time.perf_counter() - started
    save()
    print("\n" + format_report(results))
    print(f"\nwrote {args.out / 'results.json'} ({results['wall_s']:.0f} s)")
    return 0 if all(not r.get("skipped") and not r["failed"] for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
