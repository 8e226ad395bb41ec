"""Many tenants on one KV cache (issue 36): a noisy neighbour, a pinned system prompt, and the
timing side channel.

    python -m bench.tenants_bench                       # part 1: kvmanager only, a few seconds
    python -m bench.tenants_bench --side-channel        # part 1, then part 2 (the model; minutes)
    python -m bench.tenants_bench --synthetic           # part 1 without ShareGPT and the tokenizer

Part 1, the noisy neighbour. A real kvmanager process (``--admin-key``), no model: the hit rate is
purely kvmanager's policy. This process drives it over gRPC as a gateway does: Allocate a
prompt, Allocate its answer's tokens with the prompt reported written, Free with everything but
the last answer token reported written (its KV is never computed). A quiet tenant plays
``--conversations`` multi-turn chats behind one shared system prompt (``--system-tokens``), in
rounds (round k sends turn k of every chat; turn k's prompt is the system prompt, the turns before
it and their answers, and user turn k). After every quiet request a noisy tenant sends
``--noisy-ratio`` (10) requests, every prompt unique. Token ids are real: ShareGPT's user turns and
reference answers (cut to ``--max-message-tokens``) through the model's tokenizer, without a chat
template (raw concatenation); the noisy prompts are first user turns of other ShareGPT
conversations, each opened by a unique ``[noisy N]`` tag. ``--synthetic``: the same shapes with
seeded random lengths and token ids (no ShareGPT, no tokenizer; what the test uses).

Scenarios, each on its own pool (``--num-blocks`` x ``--block-size``) of the one kvmanager, with
tenant names suffixed by the scenario (policies are per kvmanager):
  alone       the quiet tenant only
  governed    quiet and noisy as two tenants: weighted fair eviction (weights 1:1), LRU within one;
              ``--noisy-quota B`` adds SetTenantPolicy(noisy, quota_blocks=B)
  ungoverned  quiet and noisy in ONE tenant: plain LRU, as a server without tenants
  pinned      as governed, with the quiet tenant's system prompt pinned first (PinPrefix)
  ungoverned-pinned  as ungoverned, with the system prompt pinned for that one tenant
Quiet hit rate: the quiet requests' ``num_cached_tokens`` / prompt tokens (from each Allocate, so
it is the quiet tenant's even where both share a tenant); system-prompt hit rate: the share of
quiet requests after the first whose cached tokens cover every full block of the system prompt.
Targets (issue 36): the governed quiet hit rate drops at most 10 % against alone; the pinned
system prompt hits on 100 % of requests.

Part 2, ``--side-channel``: kvmanager + executor + gateway with the default model, the gateway
with ``--tenants victim,attacker`` (header ``X-Kvserve-Tenant``). ``--trials`` trials; each has
three conditions in a seeded random order, on fresh random prompts of ``--prompt-words`` words:
"other tenant cached it" (victim sends P, then attacker sends P: measured), "nobody cached it"
(attacker sends a fresh P': measured), "same tenant cached it" (attacker sends Q twice: the second
measured). max_tokens 1, streamed ``/v1/completions``; TTFT is the first chunk with a choice.
Reported: median TTFT per condition, cached_tokens per condition, and the ROC AUC of telling a
condition from "nobody" by a lower TTFT (0.5: no signal; the same-tenant AUC is the control that
shows the measurement sees a hit).

Writes ``--out``/results.json (default ``bench/results/tenants-<UTC timestamp>``, gitignored) and
lscpu.txt; part 2 also logs/.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import string
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.peers.common import lscpu_text, write_lscpu

ADMIN_KEY = "bench-admin"
TARGET_DROP = 0.10  # the quiet tenant's hit rate drops at most this much against alone
SCENARIOS = ("alone", "governed", "ungoverned", "pinned", "ungoverned-pinned")


# --- part 1: the workload -------------------------------------------------------------------


@dataclass
class Workload:
    source: str  # "sharegpt" (real tokenized turns) or "synthetic"
    system: list[int]
    chats: list[list[tuple[list[int], list[int]]]]  # per chat: (user turn ids, answer ids) per turn
    noisy: list[tuple[list[int], list[int]]]  # per noisy request: (prompt ids, answer ids)

    def quiet_requests(self) -> list[tuple[int, int, list[int], list[int]]]:
        """(chat, turn, prompt, answer) in the order sent: round k is turn k of every chat."""
        out = []
        for k in range(max(len(c) for c in self.chats)):
            for i, chat in enumerate(self.chats):
                if k < len(chat):
                    prompt = list(self.system)
                    for user, answer in chat[:k]:
                        prompt += user + answer
                    out.append((i, k, prompt + chat[k][0], chat[k][1]))
        return out

    def describe(self, block_size: int) -> dict:
        quiet = self.quiet_requests()
        last = {}
        for i, _, prompt, answer in quiet:
            last[i] = len(prompt) + len(answer)
        working = sum(-(-n // block_size) for n in last.values()) - (len(last) - 1) * (len(self.system) // block_size)
        return {"source": self.source, "system_tokens": len(self.system), "conversations": len(self.chats),
                "quiet_requests": len(quiet), "quiet_prompt_tokens": sum(len(p) for _, _, p, _ in quiet),
                "mean_quiet_prompt": statistics.fmean(len(p) for _, _, p, _ in quiet),
                "quiet_working_set_blocks": working,
                "noisy_requests": len(self.noisy), "noisy_prompt_tokens": sum(len(p) for p, _ in self.noisy),
                "mean_noisy_prompt": statistics.fmean(len(p) for p, _ in self.noisy) if self.noisy else 0.0,
                "noisy_blocks_written": sum((len(p) + len(a) - 1) // block_size for p, a in self.noisy)}


def synthetic_workload(*, conversations: int, turns: int, system_tokens: int, max_message_tokens: int,
                       noisy_ratio: int, max_noisy_tokens: int, seed: int) -> Workload:
    """Seeded lengths (uniform from a quarter of the cap to the cap) and random token ids; every
    noisy prompt opens with its own index, so no two share a block."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, 49_000) for _ in range(n)]

    def length(cap: int) -> int:
        return rng.randint(max(1, cap // 4), cap)

    system = ids(system_tokens)
    chats = [[(ids(length(max_message_tokens)), ids(length(max_message_tokens))) for _ in range(turns)]
             for _ in range(conversations)]
    noisy = [([50_000 + n] + ids(length(max_noisy_tokens) - 1), ids(length(max_message_tokens)))
             for n in range(noisy_ratio * conversations * turns)]
    return Workload("synthetic", system, chats, noisy)


def sharegpt_workload(*, conversations: int, turns: int, system_tokens: int, max_message_tokens: int,
                      noisy_ratio: int, max_noisy_tokens: int, seed: int, model: Path) -> Workload:
    """Real token ids: ShareGPT conversations with ``turns``+ exchanges for the quiet chats (a
    seeded draw), first exchanges of the other conversations for the noisy prompts."""
    from bench.routing_bench import load_conversations
    from bench.workload import load_tokenizer, make_system_prompt

    tokenizer = load_tokenizer(model)
    encode = lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]  # noqa: E731
    everything = load_conversations(min_turns=1)
    order = list(range(len(everything)))
    random.Random(seed).shuffle(order)
    quiet = [i for i in order if len(everything[i].exchanges) >= turns][:conversations]
    if len(quiet) < conversations:
        raise ValueError(f"only {len(quiet)} ShareGPT conversations have {turns}+ turns")
    taken = set(quiet)
    needed = noisy_ratio * conversations * turns
    others = [i for i in order if i not in taken][:needed]
    if len(others) < needed:
        raise ValueError(f"only {len(others)} other ShareGPT conversations for {needed} noisy requests")
    system = encode([make_system_prompt(tokenizer, system_tokens)])[0][:system_tokens]
    cut = max_message_tokens
    chats = []
    for i in quiet:
        texts = [t for exchange in everything[i].exchanges[:turns] for t in exchange]
        encoded = encode(texts)
        chats.append([(encoded[2 * k][:cut], encoded[2 * k + 1][:cut]) for k in range(turns)])
    prompts = encode([f"[noisy {n}] " + everything[i].exchanges[0][0] for n, i in enumerate(others)])
    answers = encode([everything[i].exchanges[0][1] for i in others])
    noisy = [(p[:max_noisy_tokens], a[:cut] or [0]) for p, a in zip(prompts, answers)]
    return Workload("sharegpt", system, chats, noisy)


# --- part 1: driving kvmanager --------------------------------------------------------------


class Driver:
    """One pool of a kvmanager, driven as a gateway drives it, one request at a time."""

    def __init__(self, stub, pool_id: str, block_size: int) -> None:
        from kvserve.v1 import kvmanager_pb2 as pb

        self.pb, self.stub, self.pool_id, self.block_size = pb, stub, pool_id, block_size
        self.session = stub.OpenSession(pb.OpenSessionRequest(pool_id=pool_id, ttl_ms=3_600_000,
                                                              client_name="tenants-bench")).session_id
        self.next_seq = 0

    def run(self, prompt: list[int], answer: list[int], tenant: str) -> int:
        """Prefill ``prompt``, decode ``answer`` (one step: the tokens are known), free; returns
        the prompt's cached tokens."""
        pb = self.pb
        self.next_seq += 1
        seq = self.next_seq
        first = self.stub.Allocate(pb.AllocateRequest(pool_id=self.pool_id, session_id=self.session, sequences=[
            pb.SequenceAllocation(seq_id=seq, token_ids=prompt, num_new_tokens=len(prompt),
                                  enable_prefix_caching=True, tenant=tenant)])).results[0]
        if first.status != pb.ALLOCATION_STATUS_OK:
            raise RuntimeError(f"NO_ROOM for a {len(prompt)}-token prompt: the pool is too small")
        decoded = self.stub.Allocate(pb.AllocateRequest(
            pool_id=self.pool_id, session_id=self.session, written_seq_ids=[seq], written_num_tokens=[len(prompt)],
            sequences=[pb.SequenceAllocation(seq_id=seq, token_ids=answer, num_new_tokens=len(answer))])).results[0]
        written = len(prompt)
        if decoded.status == pb.ALLOCATION_STATUS_OK:
            written += len(answer) - 1  # the last sampled token's KV is never computed
        self.stub.Free(pb.FreeRequest(pool_id=self.pool_id, session_id=self.session, seq_ids=[seq],
                                      written_seq_ids=[seq], written_num_tokens=[written]))
        return first.num_cached_tokens

    def tenants(self) -> dict[str, dict]:
        from google.protobuf.json_format import MessageToDict

        stats = self.stub.GetStats(self.pb.GetStatsRequest(pool_id=self.pool_id))
        return {t.tenant: MessageToDict(t, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
                for t in stats.tenants}


@dataclass
class ScenarioResult:
    scenario: str
    quiet_tenant: str
    noisy_tenant: str | None
    quiet_hit_rate: float
    system_prompt_hit_rate: float  # quiet requests after the first whose hit covers the system prompt's blocks
    system_prompt_misses: int
    noisy_hit_rate: float | None
    quiet_evictions_suffered: int | None  # None: quiet shares its tenant with noisy
    pinned: bool
    pin_blocks_held: int | None = None
    drop_vs_alone: float | None = None
    quiet_by_round: list[float] = field(default_factory=list)
    tenant_stats: dict = field(default_factory=dict)
    wall_s: float = 0.0


def run_scenario(stub, scenario: str, workload: Workload, args) -> ScenarioResult:
    pb = __import__("kvserve.v1.kvmanager_pb2", fromlist=["x"])
    admin = (("kvserve-admin-key", ADMIN_KEY),)
    pool_id = f"pool-{scenario}"
    stub.RegisterPool(pb.RegisterPoolRequest(pool_id=pool_id, num_blocks=args.num_blocks, block_size=args.block_size,
                                             enable_prefix_caching=True, model_fingerprint="tenants-bench"))
    quiet = f"quiet-{scenario}"
    noisy = None if scenario == "alone" else quiet if scenario.startswith("ungoverned") else f"noisy-{scenario}"
    if noisy and noisy != quiet and args.noisy_quota:
        stub.SetTenantPolicy(pb.SetTenantPolicyRequest(tenant=noisy, weight=1.0, quota_blocks=args.noisy_quota),
                             metadata=admin)
    pin_id = None
    if scenario.endswith("pinned"):
        pin_id = stub.PinPrefix(pb.PinPrefixRequest(pool_ids=[pool_id], tenant=quiet, token_ids=workload.system),
                                metadata=admin).pin_id
    driver = Driver(stub, pool_id, args.block_size)
    system_blocks = len(workload.system) // args.block_size * args.block_size
    quiet_hits = quiet_total = noisy_hits = noisy_total = 0
    system_hits = system_seen = 0
    rounds: dict[int, list[int]] = {}
    noisy_iter = iter(workload.noisy)
    t0 = time.perf_counter()
    for n, (_, turn, prompt, answer) in enumerate(workload.quiet_requests()):
        cached = driver.run(prompt, answer, quiet)
        quiet_hits, quiet_total = quiet_hits + cached, quiet_total + len(prompt)
        r = rounds.setdefault(turn, [0, 0])
        r[0], r[1] = r[0] + cached, r[1] + len(prompt)
        if n:  # the first request computes the system prompt
            system_seen += 1
            system_hits += cached >= system_blocks
        if noisy:
            for _ in range(args.noisy_ratio):
                noisy_prompt, noisy_answer = next(noisy_iter)
                noisy_hits += driver.run(noisy_prompt, noisy_answer, noisy)
                noisy_total += len(noisy_prompt)
    wall = time.perf_counter() - t0
    tenants = driver.tenants()
    held = None
    if pin_id is not None:
        held = stub.GetPin(pb.GetPinRequest(pin_id=pin_id), metadata=admin).pools[0].num_blocks_held
    suffered = None if noisy == quiet else int(tenants.get(quiet, {}).get("num_evictions_suffered", 0))
    return ScenarioResult(
        scenario=scenario, quiet_tenant=quiet, noisy_tenant=noisy, quiet_hit_rate=quiet_hits / quiet_total,
        system_prompt_hit_rate=system_hits / system_seen if system_seen else 1.0,
        system_prompt_misses=system_seen - system_hits,
        noisy_hit_rate=noisy_hits / noisy_total if noisy_total else None, quiet_evictions_suffered=suffered,
        pinned=pin_id is not None, pin_blocks_held=held,
        quiet_by_round=[h / t for _, (h, t) in sorted(rounds.items())], tenant_stats=tenants, wall_s=wall)


def noisy_neighbour(args) -> dict:
    """Part 1: every scenario on one kvmanager process; returns results.json's ``noisy_neighbour``."""
    import grpc

    from kvserve.config import without_flag_env
    from kvserve.launcher import start_healthy
    from kvserve.ports import free_port
    from kvserve.v1 import kvmanager_pb2_grpc

    shape = dict(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                 max_message_tokens=args.max_message_tokens, noisy_ratio=args.noisy_ratio,
                 max_noisy_tokens=args.max_noisy_tokens, seed=args.seed)
    workload = synthetic_workload(**shape) if args.synthetic else sharegpt_workload(**shape, model=args.model)
    described = workload.describe(args.block_size)
    print(f"workload: {json.dumps(described)}", file=sys.stderr, flush=True)
    log = args.out / "kvmanager.log"
    args.out.mkdir(parents=True, exist_ok=True)
    service = start_healthy("kvmanager", ["--admin-key", ADMIN_KEY, "--shutdown-grace", "1", "--log-level", "warning"],
                            timeout=60, port=free_port(), log_path=log, env=without_flag_env())
    results = []
    try:
        with grpc.insecure_channel(service.address) as channel:
            stub = kvmanager_pb2_grpc.KVManagerStub(channel)
            for scenario in args.scenarios:
                results.append(run_scenario(stub, scenario, workload, args))
                print(f"  {scenario}: quiet hit rate {results[-1].quiet_hit_rate:.1%} "
                      f"({results[-1].wall_s:.1f} s)", file=sys.stderr, flush=True)
    finally:
        service.stop(signal.SIGTERM)
    alone = next((r for r in results if r.scenario == "alone"), None)
    for r in results:
        if alone and alone.quiet_hit_rate:
            r.drop_vs_alone = 1 - r.quiet_hit_rate / alone.quiet_hit_rate
    return {"pool": {"num_blocks": args.num_blocks, "block_size": args.block_size,
                     "noisy_quota_blocks": args.noisy_quota, "noisy_ratio": args.noisy_ratio},
            "workload": described, "scenarios": [asdict(r) for r in results], "targets": targets(results)}


def targets(results: list[ScenarioResult]) -> list[dict]:
    by = {r.scenario: r for r in results}
    out = []
    if "governed" in by and by["governed"].drop_vs_alone is not None:
        drop = by["governed"].drop_vs_alone
        out.append({"target": "governed: quiet hit rate drops <= 10 % vs alone", "value": drop,
                    "met": drop <= TARGET_DROP})
    if "ungoverned" in by and by["ungoverned"].drop_vs_alone is not None:
        out.append({"target": "ungoverned (reported, no target): quiet hit rate drop vs alone",
                    "value": by["ungoverned"].drop_vs_alone, "met": None})
    for name in ("pinned", "ungoverned-pinned"):
        if name in by:
            rate = by[name].system_prompt_hit_rate
            out.append({"target": f"{name}: system prompt hit on 100 % of requests", "value": rate,
                        "met": by[name].system_prompt_misses == 0})
    return out


def pct(value, spec: str = ".1%") -> str:
    return "—" if value is None else format(value, spec)


def format_part1(part: dict) -> str:
    w, p = part["workload"], part["pool"]
    lines = [f"Noisy neighbour: pool {p['num_blocks']} blocks x {p['block_size']} tokens; {w['source']} workload: "
             f"{w['conversations']} quiet chats, {w['quiet_requests']} quiet requests (mean prompt "
             f"{w['mean_quiet_prompt']:.0f} tokens, working set {w['quiet_working_set_blocks']} blocks), "
             f"system prompt {w['system_tokens']} tokens; {w['noisy_requests']} noisy requests "
             f"({p['noisy_ratio']}x, unique, mean prompt {w['mean_noisy_prompt']:.0f} tokens)"
             + (f"; noisy quota {p['noisy_quota_blocks']} blocks" if p["noisy_quota_blocks"] else ""),
             "",
             "| scenario | quiet hit rate | drop vs alone | system-prompt hit rate | noisy hit rate "
             "| evictions suffered by quiet |",
             "|---|---|---|---|---|---|"]
    for r in part["scenarios"]:
        name = r["scenario"] + (" (pinned)" if r["pinned"] and "pinned" not in r["scenario"] else "")
        suffered = "— (one tenant)" if r["quiet_evictions_suffered"] is None else str(r["quiet_evictions_suffered"])
        lines.append(f"| {name} | {pct(r['quiet_hit_rate'])} | {pct(r['drop_vs_alone'])} | "
                     f"{pct(r['system_prompt_hit_rate'])} ({r['system_prompt_misses']} misses) | "
                     f"{pct(r['noisy_hit_rate'])} | {suffered} |")
    lines.append("")
    for t in part["targets"]:
        verdict = "reported" if t["met"] is None else "met" if t["met"] else "MISSED"
        lines.append(f"target {t['target']}: {pct(t['value'])} — {verdict}")
    return "\n".join(lines)


# --- part 2: the timing side channel ----------------------------------------------------------


CONDITIONS = ("other", "nobody", "same")
LABELS = {"other": "other tenant cached it", "nobody": "nobody cached it", "same": "same tenant cached it"}


def random_prompt(rng: random.Random, words: int) -> str:
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))
                    for _ in range(words)) + "."


def roc_auc(positives: list[float], negatives: list[float]) -> float | None:
    """P(a positive's TTFT < a negative's), ties half: the AUC of "lower TTFT means cached"."""
    if not positives or not negatives:
        return None
    wins = sum((p < n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def stream_completion(client, url: str, model: str, prompt: str, tenant: str) -> dict:
    from bench.client import sse_event

    out = {"tenant": tenant, "ttft_s": None, "prompt_tokens": 0, "cached_tokens": 0, "error": ""}
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, headers={"X-Kvserve-Tenant": tenant}) as reply:
        if reply.status_code != 200:
            out["error"] = f"HTTP {reply.status_code}: {reply.read().decode(errors='replace')[:300]}"
            return out
        for chunk in filter(None, map(sse_event, reply.iter_lines())):
            if chunk.get("choices") and out["ttft_s"] is None:
                out["ttft_s"] = time.perf_counter() - start
            if usage := chunk.get("usage"):
                out["prompt_tokens"] = usage.get("prompt_tokens", 0)
                out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    out["error"] = out["error"] or ("" if out["ttft_s"] is not None else "no output")
    return out


def start_stack(args, log_dir: Path):
    """kvmanager, one executor, a gateway with ``--tenants victim,attacker`` (bench/cluster.py);
    returns once the gateway has the executor up."""
    from bench.cluster import service_env, start_cluster

    executor = ["--model", str(args.model), "--dtype", args.dtype, "--num-blocks", str(args.executor_blocks),
                "--block-size", "16", "--max-model-len", "2048", "--num-threads", str(args.num_threads)]
    gateway = ["--model", str(args.model), "--tenants", "victim,attacker", "--unavailable-timeout", "300"]
    return start_cluster([executor], gateway, log_dir, executor_env=service_env(args.num_threads))


def side_channel(args) -> dict:
    """Part 2; returns results.json's ``side_channel``."""
    import httpx

    rng = random.Random(args.seed + 1)
    t0 = time.perf_counter()
    stack = start_stack(args, args.out / "logs")
    startup = time.perf_counter() - t0
    records = []
    try:
        with httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0)) as client:
            url = stack.http_url
            model = client.get(url + "/v1/models").json()["data"][0]["id"]
            for _ in range(2):  # warm-up: both tenants, a prompt of the measured size
                for tenant in ("victim", "attacker"):
                    stream_completion(client, url, model, random_prompt(rng, args.prompt_words), tenant)
            for trial in range(args.trials):
                order = list(CONDITIONS)
                rng.shuffle(order)
                for condition in order:
                    prompt = random_prompt(rng, args.prompt_words)
                    if condition == "other":
                        primer = stream_completion(client, url, model, prompt, "victim")
                    elif condition == "same":
                        primer = stream_completion(client, url, model, prompt, "attacker")
                    else:
                        primer = None
                    measured = stream_completion(client, url, model, prompt, "attacker")
                    if primer and primer["error"] or measured["error"]:
                        error = (primer or {}).get("error") or measured["error"]
                        raise RuntimeError(f"trial {trial} {condition}: {error}")
                    records.append({"trial": trial, "condition": condition, **measured,
                                    "primer_ttft_s": primer["ttft_s"] if primer else None})
                print(f"  trial {trial + 1}/{args.trials}: " + ", ".join(
                    f"{r['condition']} {1000 * r['ttft_s']:.0f} ms" for r in records[-3:]), file=sys.stderr, flush=True)
    finally:
        stack.stop()
    ttft = {c: [r["ttft_s"] for r in records if r["condition"] == c] for c in CONDITIONS}
    cached = {c: [r["cached_tokens"] for r in records if r["condition"] == c] for c in CONDITIONS}
    prompt_tokens = [r["prompt_tokens"] for r in records]
    return {"trials": args.trials, "prompt_words": args.prompt_words, "startup_s": startup,
            "prompt_tokens": {"min": min(prompt_tokens), "mean": statistics.fmean(prompt_tokens),
                              "max": max(prompt_tokens)},
            "conditions": {c: {"label": LABELS[c], "median_ttft_ms": 1000 * statistics.median(ttft[c]),
                               "p10_ttft_ms": 1000 * sorted(ttft[c])[len(ttft[c]) // 10],
                               "p90_ttft_ms": 1000 * sorted(ttft[c])[(9 * len(ttft[c])) // 10],
                               "mean_cached_tokens": statistics.fmean(cached[c])} for c in CONDITIONS},
            "auc_other_vs_nobody": roc_auc(ttft["other"], ttft["nobody"]),
            "auc_same_vs_nobody": roc_auc(ttft["same"], ttft["nobody"]),
            "records": records}


def format_part2(part: dict) -> str:
    pt = part["prompt_tokens"]
    lines = [f"Side channel: {part['trials']} trials, prompts of {pt['min']}-{pt['max']} tokens "
             f"(mean {pt['mean']:.0f}), max_tokens 1, attacker's TTFT",
             "", "| condition | median TTFT (ms) | p10 | p90 | mean cached tokens |", "|---|---|---|---|---|"]
    for c, v in part["conditions"].items():
        lines.append(f"| {v['label']} | {v['median_ttft_ms']:.0f} | {v['p10_ttft_ms']:.0f} | {v['p90_ttft_ms']:.0f} "
                     f"| {v['mean_cached_tokens']:.0f} |")
    lines += ["", f"ROC AUC other-tenant-cached vs nobody: {pct(part['auc_other_vs_nobody'], '.2f')} "
                  "(0.5 = no signal)",
              f"ROC AUC same-tenant-cached vs nobody (control): {pct(part['auc_same_vs_nobody'], '.2f')} "
              "(1 = the measurement sees a hit)"]
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from kvserve.paths import default_model_dir

    parser = argparse.ArgumentParser(prog="python -m bench.tenants_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    part1 = parser.add_argument_group("part 1: noisy neighbour (kvmanager only)")
    part1.add_argument("--num-blocks", type=int, default=2048, help="pool blocks, the null block included")
    part1.add_argument("--block-size", type=int, default=16)
    part1.add_argument("--conversations", type=int, default=16, help="the quiet tenant's chats")
    part1.add_argument("--turns", type=int, default=6, help="turns per quiet chat")
    part1.add_argument("--system-tokens", type=int, default=256, help="the quiet chats' shared system prompt")
    part1.add_argument("--max-message-tokens", type=int, default=128, help="a user turn's or answer's tokens at most")
    part1.add_argument("--noisy-ratio", type=int, default=10, help="noisy requests per quiet request")
    part1.add_argument("--max-noisy-tokens", type=int, default=512, help="a noisy prompt's tokens at most")
    part1.add_argument("--noisy-quota", type=int, default=0, help="governed rows: the noisy tenant's quota in "
                       "blocks (0: none)")
    part1.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    part1.add_argument("--synthetic", action="store_true", help="random token ids and lengths (no ShareGPT, "
                       "no tokenizer)")
    part2 = parser.add_argument_group("part 2: timing side channel (the model)")
    part2.add_argument("--side-channel", action="store_true", help="run part 2 too")
    part2.add_argument("--trials", type=int, default=16)
    part2.add_argument("--prompt-words", type=int, default=120, help="random words per prompt (~3 tokens each)")
    part2.add_argument("--executor-blocks", type=int, default=512)
    part2.add_argument("--num-threads", type=int, default=2)
    part2.add_argument("--dtype", default="auto")
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/tenants-<UTC timestamp>")
    args = parser.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not args.scenarios or set(args.scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios: a comma list of {', '.join(SCENARIOS)}")
    if min(args.conversations, args.turns, args.noisy_ratio, args.max_message_tokens, args.max_noisy_tokens) < 1:
        parser.error("--conversations, --turns, --noisy-ratio and the token caps must be at least 1")
    args.out = args.out or Path("bench/results") / time.strftime("tenants-%Y%m%d-%H%M%S", time.gmtime())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"command": "python -m bench.tenants_bench " + " ".join(sys.argv[1:] if argv is None else argv),
               "lscpu_summary": write_lscpu(args.out), "lscpu": lscpu_text()}
    started = time.perf_counter()
    results["noisy_neighbour"] = noisy_neighbour(args)
    save = lambda: (args.out / "results.json").write_text(json.dumps(results, indent=1))  # noqa: E731
    save()
    print("\n" + format_part1(results["noisy_neighbour"]))
    if args.side_channel:
        results["side_channel"] = side_channel(args)
        save()
        print("\n" + format_part2(results["side_channel"]))
    results["wall_s"] = time.perf_counter() - started
    save()
    print(f"\nwrote {args.out / 'results.json'} ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
