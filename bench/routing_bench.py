"""Routing benchmark (issue 12): several executors behind one gateway, multi-turn chats.

    python -m bench.routing_bench                              # 2 executors: kv, round-robin, least-loaded
                                                               # + the single big executor baseline
    python -m bench.routing_bench --executors 2 --routing kv,round-robin
    python -m bench.routing_bench --executors 1                # only the single executor

The workload has real prefix reuse: ShareGPT multi-turn conversations replayed turn
by turn over ``/v1/chat/completions``. Turn *k* of a conversation sends the shared
system prompt, the conversation's first *k* user turns with the dataset's own
assistant answers in between (so the prompts are deterministic, whatever the model
generates), and user turn *k + 1*; it is sent only once turn *k*'s answer came back.
Output lengths are fixed (``max_tokens`` with ``ignore_eos``). ``--concurrency``
conversations are in flight at once; each worker plays its conversations to the end.

Each row starts fresh services (``kvserve.launcher.spawn``): one kvmanager, N
executors (``--num-threads`` and ``OMP_NUM_THREADS`` each) and a gateway with the
row's ``--routing``. Every row has the same KV in total (``--total-blocks``, split
evenly over its executors); the single-executor baseline row ("single big
executor") gets all the blocks, so its hit rate is what one shared cache achieves.
It runs with ``--threads-per-executor`` threads too (``--baseline-threads``
changes that), i.e. with 1/N of the other rows' compute: compare its hit rate,
not its speed. Per row:

* prefix hit rate: cached / prompt tokens, from each response's
  ``usage.prompt_tokens_details.cached_tokens`` (the gateway's
  ``vllm:prefix_cache_hits/queries`` counters are kept in the JSON too);
* TTFT p50/p99 (client side: first streamed chunk), output and total tokens/s;
* the gateway's kvmanager RPC share of step time
  (``kvserve:step_time_seconds_total{phase="kvmanager_rpc"}`` / ``{phase="step"}``).
  The routing call itself (``LookupPrefix``, made once per request before it is
  queued, outside any step) has no gateway metric, so after the run the bench
  times it directly against the row's running kvmanager: every turn's prompt token
  ids (rendered with the model's chat template, as the gateway does) against all
  the row's pools, median and p99 of the client-side round trip;
* how the gateway spread the requests (``kvserve:routing_decisions_total``).

Results go to ``bench/results/routing-<timestamp>/`` (``results.json``,
``results.md``, ``lscpu.txt``, service logs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Protocol

from bench.client import sse_chunks
from bench.cluster import Cluster, service_env
from bench.cluster import start_cluster as start_cluster_of

MIN_TURNS = 2  # a conversation of one turn has nothing to reuse but the system prompt
WARMUP_PROMPTS = ("Say hello in one short sentence.", "Name a colour.", "Count to three.", "Name a fruit.",
                  "Say goodbye politely.", "Name an animal.", "Name a city.", "Name a planet.")
ROUTING_DECISIONS = ("kvserve:routing_decisions_total", "kvserve:routing_decisions")


# --- the workload: multi-turn conversations -------------------------------------------


class ChatTokenizer(Protocol):
    """What the workload needs of a tokenizer (``ModelChatTokenizer`` or a test fake)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat_ids(self, messages: list[dict]) -> list[int]: ...


class ModelChatTokenizer:
    """The model's tokenizer and chat template exactly as the gateway applies them
    (``gateway.detokenizer.ModelTokenizer``: template rendered with the generation
    prompt, tokenized without added special tokens)."""

    def __init__(self, model_dir: Path):
        from gateway.detokenizer import ModelTokenizer

        self.model = ModelTokenizer(Path(model_dir))

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(ids, skip_special_tokens=False)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self.model.encode(self.model.apply_chat_template(messages, add_generation_prompt=True))


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation: its (user turn, reference answer) exchanges in order."""

    conv_id: str
    exchanges: tuple[tuple[str, str], ...]


@dataclass
class Turn:
    """One request of the replay: turn ``index`` of workload conversation ``conversation``."""

    conversation: int
    index: int
    messages: list[dict]  # system prompt, history (dataset answers), this user turn
    prompt_len: int  # tokens of the rendered chat prompt
    max_tokens: int


def exchanges_of(record: dict) -> list[tuple[str, str]]:
    """The leading run of (human, gpt) pairs of a ShareGPT record. Anything before the
    first human turn (a system or greeting turn) is skipped; the run stops at the first
    turn out of alternation or with empty text."""
    turns = record.get("conversations") or record.get("conversation") or []
    start = next((i for i, t in enumerate(turns) if t.get("from") in ("human", "user")), len(turns))
    out = []
    for i in range(start, len(turns) - 1, 2):
        user, answer = turns[i], turns[i + 1]
        if user.get("from") not in ("human", "user") or answer.get("from") not in ("gpt", "assistant", "chatgpt"):
            break
        user_text, answer_text = (user.get("value") or "").strip(), (answer.get("value") or "").strip()
        if not user_text or not answer_text:
            break
        out.append((user_text, answer_text))
    return out


def conversations_from_records(records: Iterable[dict], min_turns: int = MIN_TURNS) -> list[Conversation]:
    out = []
    for number, record in enumerate(records):
        exchanges = exchanges_of(record)
        if len(exchanges) >= min_turns:
            out.append(Conversation(str(record.get("id", number)), tuple(exchanges)))
    return out


def load_conversations(path: Path | None = None, min_turns: int = MIN_TURNS) -> list[Conversation]:
    """Every conversation of the packaged ShareGPT file with at least ``min_turns``
    exchanges (the file is cut mid-record: ``bench.workload.iter_records`` drops the tail;
    the whole parse takes about a second, so nothing is cached)."""
    from bench.workload import iter_records, sharegpt_path

    path = path or sharegpt_path()
    return conversations_from_records(iter_records(path.read_text(encoding="utf-8")), min_turns)


def truncate(tokenizer: ChatTokenizer, text: str, max_tokens: int) -> str:
    """``text`` cut to its first ``max_tokens`` tokens (unchanged when it fits)."""
    ids = tokenizer.encode(text)
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def turn_messages(system_prompt: str, exchanges: list[tuple[str, str]], index: int) -> list[dict]:
    """The chat messages of turn ``index``: system prompt, the exchanges before it (user
    turn and the dataset's answer), and its own user turn."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for user, answer in exchanges[:index]:
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": exchanges[index][0]})
    return messages


def build_turns(tokenizer: ChatTokenizer, conversation: int, exchanges: list[tuple[str, str]], *,
                system_prompt: str, max_turns: int, max_tokens: int, max_prompt_len: int) -> list[Turn]:
    """The turns of one conversation, at most ``max_turns``, stopping before the first
    whose prompt plus ``max_tokens`` would exceed ``max_prompt_len``."""
    turns = []
    for index in range(min(max_turns, len(exchanges))):
        messages = turn_messages(system_prompt, exchanges, index)
        prompt_len = len(tokenizer.chat_ids(messages))
        if prompt_len + max_tokens > max_prompt_len:
            break
        turns.append(Turn(conversation, index, messages, prompt_len, max_tokens))
    return turns


def select_workload(conversations: list[Conversation], tokenizer: ChatTokenizer, *, num_conversations: int,
                    max_turns: int = 4, min_turns: int = MIN_TURNS, max_tokens: int = 32,
                    max_message_tokens: int = 128, max_prompt_len: int = 1536, system_prompt: str = "",
                    seed: int = 0) -> list[list[Turn]]:
    """``num_conversations`` conversations, drawn in a seeded shuffle, each cut to
    ``max_turns`` turns whose messages are cut to ``max_message_tokens`` tokens; kept
    when at least ``min_turns`` turns fit ``max_prompt_len``. Deterministic."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    chosen: list[list[Turn]] = []
    for i in order:
        exchanges = [(truncate(tokenizer, user, max_message_tokens), truncate(tokenizer, answer, max_message_tokens))
                     for user, answer in conversations[i].exchanges[:max_turns]]
        turns = build_turns(tokenizer, len(chosen), exchanges, system_prompt=system_prompt, max_turns=max_turns,
                            max_tokens=max_tokens, max_prompt_len=max_prompt_len)
        if len(turns) >= min_turns:
            chosen.append(turns)
            if len(chosen) == num_conversations:
                return chosen
    raise ValueError(f"only {len(chosen)} conversations have {min_turns}+ turns within the limits; "
                     f"asked for {num_conversations}")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def ideal_hit_rate(prompts: list[list[list[int]]], block_size: int) -> float:
    """Cached / prompt tokens with an unbounded cache that every request can see: turn
    k > 0 reuses the full blocks it shares with turn k - 1 of its conversation, a first
    turn those it shares with an earlier first turn (the system prompt), as a prefix
    cache counts them (whole blocks, never the last prompt token)."""
    cached = total = 0
    firsts: list[list[int]] = []
    for conversation in prompts:
        for k, ids in enumerate(conversation):
            total += len(ids)
            if k:
                shared = common_prefix(ids, conversation[k - 1])
            else:
                shared = max((common_prefix(ids, f) for f in firsts), default=0)
                firsts.append(ids)
            cached += min(shared, len(ids) - 1) // block_size * block_size
    return cached / total if total else 0.0


def describe_workload(workload: list[list[Turn]]) -> dict:
    turns = [t for conversation in workload for t in conversation]
    lens = [t.prompt_len for t in turns]
    return {
        "conversations": len(workload), "turns": len(turns),
        "turns_per_conversation": {n: sum(1 for c in workload if len(c) == n)
                                   for n in sorted({len(c) for c in workload})},
        "prompt_tokens": sum(lens), "mean_prompt_len": statistics.fmean(lens) if lens else 0.0,
        "max_prompt_len": max(lens, default=0), "output_tokens": sum(t.max_tokens for t in turns),
    }


# --- the replay -------------------------------------------------------------------------


@dataclass
class TurnResult:
    conversation: int
    index: int
    prompt_len: int  # the server's count when it reported usage
    sent_at: float = 0.0  # seconds since the replay started
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    cached_tokens: int = 0
    ok: bool = False
    error: str = ""


Sender = Callable[[Turn, float], Awaitable[TurnResult]]


async def replay(workload: list[list[Turn]], send: Sender, concurrency: int) -> tuple[list[TurnResult], float]:
    """Plays every conversation turn by turn: ``concurrency`` workers each take the next
    conversation and send its turns one after the other, each once the previous answer
    came back (a failed turn is recorded and the conversation goes on: its history is
    the dataset's, not the model's). Returns (results in completion order, wall s)."""
    results: list[TurnResult] = []
    queue = iter(range(len(workload)))
    t0 = time.perf_counter()

    async def worker() -> None:
        for conversation in queue:  # shared iterator: each conversation is played once
            for turn in workload[conversation]:
                results.append(await send(turn, t0))

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(workload))))))
    return results, time.perf_counter() - t0


def chat_body(turn: Turn, model: str) -> dict:
    return {"model": model, "messages": turn.messages, "max_tokens": turn.max_tokens,
            "min_tokens": turn.max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def http_sender(client, base_url: str, model: str) -> Sender:
    """Streams one ``/v1/chat/completions``; TTFT is the first chunk with a choice (the
    gateway sends one per engine output, i.e. from the first token on)."""
    import httpx

    async def send(turn: Turn, t0: float) -> TurnResult:
        result = TurnResult(turn.conversation, turn.index, turn.prompt_len)
        start = time.perf_counter()
        result.sent_at = start - t0
        chunks = 0
        try:
            async with client.stream("POST", f"{base_url}/v1/chat/completions", json=chat_body(turn, model)) as reply:
                if reply.status_code != 200:
                    result.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode(errors='replace')[:300]}"
                    return result
                async for chunk in sse_chunks(reply):
                    if "error" in chunk:
                        result.error = str(chunk["error"])[:300]
                        return result
                    if chunk.get("choices"):
                        if chunks == 0:
                            result.ttft = time.perf_counter() - start
                        chunks += 1
                    usage = chunk.get("usage")
                    if usage:
                        result.output_tokens = int(usage.get("completion_tokens") or 0)
                        result.prompt_len = int(usage.get("prompt_tokens") or result.prompt_len)
                        result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                                                   or 0)
            result.e2e = time.perf_counter() - start
            result.ok = chunks > 0
            if not result.ok:
                result.error = "no output"
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    return send


# --- summary and table ------------------------------------------------------------------


@dataclass
class RowResult:
    """One row of the table: one configuration on the workload."""

    name: str
    routing: str  # the gateway's --routing ("-" for one executor: it routes nothing)
    executors: int
    blocks_per_executor: int
    threads_per_executor: int
    completed: int = 0
    failed: int = 0
    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    metric_hit_rate: float | None = None  # gateway's vllm:prefix_cache_hits / queries
    kvmanager_rpc_share: float | None = None  # of the gateway's step time
    executor_rpc_share: float | None = None
    preemptions: float | None = None
    requests_per_executor: dict[str, float] = field(default_factory=dict)
    decisions_by_policy: dict[str, float] = field(default_factory=dict)
    lookup_pools: int = 0
    lookup_calls: int = 0
    lookup_p50_ms: float | None = None
    lookup_p99_ms: float | None = None
    lookup_max_blocks: int = 0
    lookup_mean_blocks: float = 0.0
    startup_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "output_tok_s": self.output_tok_s,
                "total_tok_s": self.total_tok_s}


def finish_row(row: RowResult, results: list[TurnResult], wall: float) -> RowResult:
    from bench.report import percentile

    ok = [r for r in results if r.ok]
    row.completed, row.failed, row.wall_s = len(ok), len(results) - len(ok), wall
    row.prompt_tokens = sum(r.prompt_len for r in ok)
    row.cached_tokens = sum(r.cached_tokens for r in ok)
    row.output_tokens = sum(r.output_tokens for r in ok)
    ttft = [1000 * r.ttft for r in ok]
    row.ttft_p50_ms, row.ttft_p90_ms, row.ttft_p99_ms = (percentile(ttft, q) for q in (50, 90, 99))
    row.e2e_p50_ms = percentile([1000 * r.e2e for r in ok], 50)
    row.errors.extend(sorted({r.error for r in results if r.error})[:5])
    return row


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, fmt)


def _split(counts: dict[str, float]) -> str:
    return "/".join(f"{v:.0f}" for _, v in sorted(counts.items())) if counts else "-"


TABLE_COLUMNS = ("configuration", "executors x blocks", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "out tok/s",
                 "total tok/s", "kvm RPC % step", "LookupPrefix p50/p99 ms", "requests/executor", "failed")


def table_cells(row: RowResult) -> list[str]:
    lookup = "n/a" if row.lookup_p50_ms is None else f"{row.lookup_p50_ms:.2f}/{row.lookup_p99_ms:.2f}"
    return [row.name, f"{row.executors} x {row.blocks_per_executor}", _num(row.hit_rate, ".1%"),
            _num(row.ttft_p50_ms, ".0f"), _num(row.ttft_p99_ms, ".0f"), f"{row.output_tok_s:.1f}",
            f"{row.total_tok_s:.0f}", _num(row.kvmanager_rpc_share, ".2f", 100), lookup,
            _split(row.requests_per_executor), str(row.failed)]


def format_table(rows: list[RowResult]) -> str:
    """A plain-text table, columns aligned (text left, numbers right)."""
    cells = [list(TABLE_COLUMNS)] + [table_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(TABLE_COLUMNS))]
    lines = []
    for n, line in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[RowResult]) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(TABLE_COLUMNS) - 1)) + "|"]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def target_checks(rows: list[RowResult]) -> list[str]:
    """The issue's targets, said plainly for this run's rows."""
    by = {r.routing: r for r in rows}
    single = next((r for r in rows if r.executors == 1), None)
    kv, rr = by.get("kv"), by.get("round-robin")
    out = []
    if kv and single and kv.hit_rate is not None and single.hit_rate is not None:
        gap = single.hit_rate - kv.hit_rate
        out.append(f"kv hit rate {kv.hit_rate:.1%} vs single executor {single.hit_rate:.1%}: "
                   f"{abs(gap) * 100:.1f} points {'below' if gap >= 0 else 'above'} -> target (within 5 points) "
                   f"{'HOLDS' if gap <= 0.05 else 'MISSED'}")
    if kv and rr and kv.ttft_p99_ms and rr.ttft_p99_ms:
        ratio = rr.ttft_p99_ms / kv.ttft_p99_ms
        out.append(f"TTFT p99 round-robin / kv = {rr.ttft_p99_ms:.0f} / {kv.ttft_p99_ms:.0f} ms = {ratio:.2f}x "
                   f"-> target (>= 2x) {'HOLDS' if ratio >= 2 else 'MISSED'}")
    lookups = [r for r in rows if r.lookup_p50_ms is not None and r.executors > 1]
    if lookups:
        worst = max(lookups, key=lambda r: r.lookup_p50_ms)
        out.append(f"LookupPrefix on the workload's prompts (up to {worst.lookup_max_blocks} blocks, "
                   f"{worst.lookup_pools} pools): median up to {worst.lookup_p50_ms:.2f} ms "
                   f"(the 256-block target is bench.kvmanager_bench's)")
    return out


# --- services ---------------------------------------------------------------------------


@dataclass
class RowConfig:
    name: str
    slug: str
    routing: str  # gateway --routing
    executors: int
    blocks_per_executor: int
    threads_per_executor: int


def start_cluster(config: RowConfig, args, log_dir: Path) -> Cluster:
    """kvmanager, the row's executors and a gateway (bench/cluster.py), each executor with the row's
    threads; returns once the gateway has every executor up."""
    executor_flags = [["--model", str(args.model), "--dtype", args.dtype, "--num-blocks",
                       str(config.blocks_per_executor), "--block-size", str(args.block_size), "--max-model-len",
                       str(args.max_model_len), "--num-threads", str(config.threads_per_executor)]] * config.executors
    gateway_flags = ["--routing", config.routing, "--model", str(args.model), "--max-num-seqs", "64",
                     "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return start_cluster_of(executor_flags, gateway_flags, log_dir,
                            executor_env=service_env(config.threads_per_executor),
                            startup_timeout=args.startup_timeout, extra_flags=["--log-level", "warning"])


def metric_deltas(begin: str, end: str) -> dict:
    """What the gateway counted between two /metrics scrapes."""
    from bench.server_metrics import COUNTERS, STEP_TIME, parse_labeled, parse_prometheus, pick

    first, last = parse_prometheus(begin), parse_prometheus(end)
    counters = {}
    for key, names in COUNTERS.items():
        value = pick(last, names)
        if value is not None:
            counters[key] = value - (pick(first, names) or 0.0)

    def labeled(names, label):
        b = parse_labeled(begin, names, label)
        return {k: v - b.get(k, 0.0) for k, v in parse_labeled(end, names, label).items() if v - b.get(k, 0.0)}

    return {"counters": counters, "step_time": labeled(STEP_TIME, "phase"),
            "routed_by_executor": labeled(ROUTING_DECISIONS, "executor"),
            "routed_by_policy": labeled(ROUTING_DECISIONS, "policy")}


def apply_metrics(row: RowResult, deltas: dict) -> None:
    counters, phases = deltas["counters"], deltas["step_time"]
    if counters.get("prefix_cache_queries"):
        row.metric_hit_rate = counters.get("prefix_cache_hits", 0.0) / counters["prefix_cache_queries"]
    row.preemptions = counters.get("preemptions")
    if phases.get("step"):
        row.kvmanager_rpc_share = phases.get("kvmanager_rpc", 0.0) / phases["step"]
        row.executor_rpc_share = phases.get("executor_rpc", 0.0) / phases["step"]
    row.requests_per_executor = deltas["routed_by_executor"]
    row.decisions_by_policy = deltas["routed_by_policy"]


def time_lookup_prefix(address: str, prompts: list[list[int]], passes: int, block_size: int) -> dict:
    """``LookupPrefix`` of every prompt against every pool of the running kvmanager (what
    the gateway asks per request under ``--routing kv``), client-side round trip."""
    import grpc

    from bench.report import percentile
    from kvserve.v1 import kvmanager_pb2 as pb
    from kvserve.v1 import kvmanager_pb2_grpc

    samples = []
    with grpc.insecure_channel(address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        pools = [p.pool_id for p in stub.LookupPrefix(pb.LookupPrefixRequest(
            queries=[pb.PrefixQuery(token_ids=prompts[0])])).matches[0].pools]
        requests = [pb.LookupPrefixRequest(pool_ids=pools, queries=[pb.PrefixQuery(token_ids=ids)]) for ids in prompts]
        for request in requests[:10]:  # warm-up
            stub.LookupPrefix(request)
        for _ in range(passes):
            for request in requests:
                t0 = time.perf_counter()
                stub.LookupPrefix(request)
                samples.append((time.perf_counter() - t0) * 1e3)
    blocks = [len(ids) // block_size for ids in prompts]
    return {"pools": len(pools), "calls": len(samples), "p50_ms": percentile(samples, 50),
            "p99_ms": percentile(samples, 99), "max_blocks": max(blocks), "mean_blocks": statistics.fmean(blocks)}


async def measure(cluster: Cluster, workload: list[list[Turn]], concurrency: int,
                  progress: bool) -> tuple[list[TurnResult], float, dict]:
    import httpx

    from bench.server_metrics import scrape

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=30.0), limits=limits) as client:
        model = (await client.get(cluster.http_url + "/v1/models")).json()["data"][0]["id"]
        send = http_sender(client, cluster.http_url, model)
        # Distinct short prompts, one after the other: ties go round-robin under every
        # policy, so each executor pays its first-step costs here, outside the numbers.
        for i in range(2 * len(cluster.executors)):
            warm = Turn(-1, i, [{"role": "user", "content": WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)]}], 0, 4)
            result = await send(warm, time.perf_counter())
            if not result.ok:
                raise RuntimeError(f"warm-up request failed: {result.error}")
        begin = await scrape(client, cluster.http_url)
        total = sum(len(c) for c in workload)
        done = [0]

        async def counted(turn: Turn, t0: float) -> TurnResult:
            result = await send(turn, t0)
            done[0] += 1
            if progress:
                print(f"\r   {done[0]}/{total} turns", end="", file=sys.stderr, flush=True)
            return result

        results, wall = await replay(workload, counted, concurrency)
        if progress:
            print(file=sys.stderr)
        end = await scrape(client, cluster.http_url)
    return results, wall, metric_deltas(begin, end)


def run_row(config: RowConfig, workload: list[list[Turn]], prompts: list[list[int]], args,
            out_dir: Path, log=print) -> RowResult:
    row = RowResult(config.name, config.routing if config.executors > 1 else "-", config.executors,
                    config.blocks_per_executor, config.threads_per_executor)
    t0 = time.perf_counter()
    cluster = start_cluster(config, args, out_dir / "logs" / config.slug)
    row.startup_s = time.perf_counter() - t0
    try:
        results, wall, deltas = asyncio.run(measure(cluster, workload, args.concurrency, args.progress))
        finish_row(row, results, wall)
        apply_metrics(row, deltas)
        lookup = time_lookup_prefix(cluster.kvmanager.address, prompts, args.lookup_passes, args.block_size)
        row.lookup_pools, row.lookup_calls = lookup["pools"], lookup["calls"]
        row.lookup_p50_ms, row.lookup_p99_ms = lookup["p50_ms"], lookup["p99_ms"]
        row.lookup_max_blocks, row.lookup_mean_blocks = lookup["max_blocks"], lookup["mean_blocks"]
        (out_dir / f"turns-{config.slug}.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    finally:
        cluster.stop()
    return row


def row_configs(args) -> list[RowConfig]:
    n = args.executors
    per_executor = args.total_blocks // n  # rounded down: every row gets n * per_executor blocks
    single = RowConfig(f"single executor ({n}x KV)" if n > 1 else "single executor", "single", "kv", 1,
                       per_executor * n, args.baseline_threads or args.threads_per_executor)
    if n == 1:
        return [single]
    rows = [single] if args.baseline else []
    for policy in args.routing:
        rows.append(RowConfig(f"{policy}, {n} executors", policy, policy, n, per_executor,
                              args.threads_per_executor))
    return rows


def lscpu() -> tuple[str, str]:
    """(lscpu's output, its model name)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"lscpu failed: {exc}\n", "unknown"
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")),
                 "unknown")
    return text, model


def write_results(out_dir: Path, meta: dict, rows: list[RowResult]) -> None:
    (out_dir / "results.json").write_text(json.dumps({**meta, "rows": [r.to_json() for r in rows],
                                                      "targets": target_checks(rows)}, indent=2))
    w = meta["workload"]
    md = [f"# Routing benchmark, {meta['started']}", "", f"`{meta['command']}`", "",
          f"CPU: {meta['cpu_model']} ({os.cpu_count()} CPUs), load average at start {meta['load_average']}", "",
          f"Workload: {w['conversations']} ShareGPT conversations, {w['turns']} turns "
          f"(turns per conversation: {w['turns_per_conversation']}), {w['prompt_tokens']} prompt tokens "
          f"(mean {w['mean_prompt_len']:.0f}, max {w['max_prompt_len']}), {meta['args']['max_tokens']} output "
          f"tokens per turn, {meta['args']['concurrency']} conversations in flight; ideal hit rate "
          f"(unbounded cache, every request sees every prefix) {w['ideal_hit_rate']:.1%}.", "",
          markdown_table(rows), "", *[f"- {line}" for line in target_checks(rows)], ""]
    (out_dir / "results.md").write_text("\n".join(md))


def parse_args(argv: list[str] | None):
    from kvserve.paths import default_model_dir

    parser = argparse.ArgumentParser(prog="python -m bench.routing_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--executors", type=int, default=2, help="executors behind the gateway (1: only the "
                        "single-executor row)")
    parser.add_argument("--routing", default="kv,round-robin,least-loaded",
                        help="comma-separated gateway --routing policies, one row each (same requests)")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also the single big executor: one executor with all the blocks")
    parser.add_argument("--total-blocks", type=int, default=1024,
                        help="KV blocks over all executors of a row (each of N executors gets total/N, rounded down)")
    parser.add_argument("--threads-per-executor", type=int, default=1,
                        help="executor --num-threads and OMP_NUM_THREADS")
    parser.add_argument("--baseline-threads", type=int, default=None,
                        help="threads of the single big executor (default: --threads-per-executor; N times "
                        "that gives it the N executors' compute, but a multi-threaded executor on a small, "
                        "busy machine mostly waits for descheduled OpenMP threads)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-turns", type=int, default=4, help="turns per conversation at most")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per turn (ignore_eos)")
    parser.add_argument("--max-message-tokens", type=int, default=128,
                        help="each user turn and dataset answer is cut to this many tokens")
    parser.add_argument("--max-prompt-len", type=int, default=1536,
                        help="a conversation stops before a turn whose prompt + max_tokens exceeds this")
    parser.add_argument("--system-prompt-len", type=int, default=128, help="shared system prompt (tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--lookup-passes", type=int, default=3, help="LookupPrefix timings: passes over the prompts")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default: bench/results/routing-<timestamp>/")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty())
    args = parser.parse_args(argv)
    args.routing = [p.strip() for p in args.routing.split(",") if p.strip()]
    from gateway.routing import ROUTING_POLICIES

    bad = [p for p in args.routing if p not in ROUTING_POLICIES]
    if bad or args.executors < 1:
        parser.error(f"--routing: each of {', '.join(ROUTING_POLICIES)}; --executors >= 1")
    return args


def _stop_on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the finally blocks that stop the services


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A background job of a non-interactive shell ignores SIGINT; SIGTERM would end the
    # bench without stopping its services (they run in their own sessions).
    signal.signal(signal.SIGINT, _stop_on_signal)
    signal.signal(signal.SIGTERM, _stop_on_signal)
    from bench.workload import make_system_prompt

    started = time.strftime("%Y%m%d-%H%M%S")
    out_dir = args.out_dir or Path(__file__).resolve().parent / "results" / f"routing-{started}"
    out_dir.mkdir(parents=True, exist_ok=True)
    cpu_text, cpu_model = lscpu()
    (out_dir / "lscpu.txt").write_text(cpu_text)

    tokenizer = ModelChatTokenizer(args.model)
    system_prompt = make_system_prompt(tokenizer.model.tokenizer, args.system_prompt_len).strip()
    workload = select_workload(load_conversations(), tokenizer, num_conversations=args.conversations,
                               max_turns=args.max_turns, max_tokens=args.max_tokens,
                               max_message_tokens=args.max_message_tokens, max_prompt_len=args.max_prompt_len,
                               system_prompt=system_prompt, seed=args.seed)
    prompts = [[tokenizer.chat_ids(t.messages) for t in conversation] for conversation in workload]
    described = {**describe_workload(workload), "ideal_hit_rate": ideal_hit_rate(prompts, args.block_size)}
    meta = {"started": started, "command": "python -m bench.routing_bench " + " ".join(argv or sys.argv[1:]),
            "cpu_model": cpu_model, "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "workload": described}
    print(f"workload: {described['conversations']} conversations, {described['turns']} turns, "
          f"{described['prompt_tokens']} prompt tokens (mean {described['mean_prompt_len']:.0f}, max "
          f"{described['max_prompt_len']}), ideal hit rate {described['ideal_hit_rate']:.1%}; CPU {cpu_model}, "
          f"load {meta['load_average']}", file=sys.stderr)
    flat_prompts = [ids for conversation in prompts for ids in conversation]
    rows: list[RowResult] = []
    for config in row_configs(args):
        print(f"== {config.name}: {config.executors} executor(s) x {config.blocks_per_executor} blocks, "
              f"{config.threads_per_executor} thread(s) each", file=sys.stderr)
        try:
            row = run_row(config, workload, flat_prompts, args, out_dir)
        except Exception as exc:  # one broken row must not lose the others
            row = RowResult(config.name, config.routing, config.executors, config.blocks_per_executor,
                            config.threads_per_executor, failed=described["turns"],
                            errors=[f"{type(exc).__name__}: {exc}"[:2000]])
        print(f"   hit rate {_num(row.hit_rate, '.1%')}, TTFT p50 {_num(row.ttft_p50_ms, '.0f')} ms p99 "
              f"{_num(row.ttft_p99_ms, '.0f')} ms, {row.output_tok_s:.1f} out tok/s, {row.wall_s:.0f} s"
              + (f"; errors: {row.errors}" if row.errors else ""), file=sys.stderr)
        rows.append(row)
        write_results(out_dir, meta, rows)  # after every row: a crash keeps what was measured
    print(format_table(rows))
    for line in target_checks(rows):
        print(line)
    print(f"results: {out_dir}", file=sys.stderr)
    return 0 if all(r.failed == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
