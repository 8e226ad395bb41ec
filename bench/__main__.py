"""``python -m bench`` (``kvserve bench``): benchmark kvserve on ShareGPT.

Three modes:
  python -m bench --base-url http://127.0.0.1:8000 ...   measure a running server
  python -m bench --sweep seed-table ...                 start the four seed-table
      configurations and kvserve's defaults (prompt lookup on) in turn at one KV budget,
      plus the peers, and print the tables (--kvserve-quantization int8,int4: the defaults
      row again per weight quantization)
  python -m bench --executors N --routing kv,round-robin ...   routing across N
      executors on multi-turn conversations (bench/routing_bench.py)
Both write ``results.json``, ``table.md`` and ``bench.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path

from kvserve.cpus import thread_counts_to_try, usable_cpus
from kvserve.paths import default_model_dir

from bench import report
from bench.peers import LLAMA_SERVER_WEIGHTS, OPENVINO_WEIGHTS, parse_list, parse_peers
from bench.peers.common import write_lscpu
from bench.sweep import CONFIGS, KV_CACHE_DTYPES, QUANTIZATION_MODES, threads_label
from bench.targets import best_against_best_lines, representative_rows, round_lines, target_lines
from bench.workload import describe, load_tokenizer, make_system_prompt, sample_requests

# The measured default workload (docs/benchmarks.md): scaled down from the seed's
# (ShareGPT, ~512 in / ~256 out, concurrency 32) to fit a 2-core CPU in 15 minutes.
DEFAULTS = dict(num_prompts=64, max_input_len=512, max_output_len=384, system_prompt_len=128, concurrency=32)


def kvserve_quantizations(text: str) -> list[str]:
    """``--kvserve-quantization``'s modes, for argparse: an unknown one is a usage error naming the known ones."""
    try:
        return parse_list(text, QUANTIZATION_MODES, "kvserve quantization")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_slugs(text: str) -> set[str]:
    """``--configs``' rows, for argparse: an unknown one is a usage error naming the known ones."""
    try:
        return set(parse_list(text, tuple(c.slug for c in CONFIGS), "kvserve row"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def thread_counts(text: str) -> list[int | None]:
    """``1,2`` or ``auto,2``: thread counts to run rows at (None: the executor's ``--num-threads auto``)."""
    counts: list[int | None] = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part == "auto":
            counts.append(None)
        elif part.isdigit() and int(part) >= 1:
            counts.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"thread counts are 'auto' or whole numbers >= 1, got {part!r}")
    if not counts:
        raise argparse.ArgumentTypeError("give at least one thread count")
    return list(dict.fromkeys(counts))


DEFAULT_THREADS = ",".join(str(n) for n in thread_counts_to_try(usable_cpus()))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("what to measure")
    target.add_argument("--sweep", choices=["seed-table"], help="start the stack per configuration")
    target.add_argument("--base-url", help="a running gateway's HTTP address, e.g. http://127.0.0.1:8000")
    target.add_argument("--grpc-address", default="", help="send requests over gRPC to this gateway instead")
    target.add_argument("--name", default="kvserve", help="row name when measuring a running server")
    target.add_argument("--configs", type=config_slugs, default="baseline,continuous,paged,prefix,defaults",
                        help="kvserve rows to run (comma-separated): the seed table's baseline, continuous, "
                             "paged, prefix (prompt lookup off in each), and defaults (kvserve as `kvserve up` "
                             "runs it: prefix caching, prompt lookup)")
    target.add_argument("--kvserve-quantization", type=kvserve_quantizations, default="none",
                        help=f"executor weight quantizations ({', '.join(QUANTIZATION_MODES)}; comma-separated): "
                             "the defaults row (the prefix-caching row where --configs leaves defaults out) "
                             "runs once more per mode other than none, its executor started with "
                             "--quantization MODE (docs/quantization.md)")
    target.add_argument("--peers", default="transformers",
                        help="peer rows for the sweep (comma-separated): transformers, llama-server "
                             "(llama.cpp, built once), openvino "
                             "(OpenVINO GenAI, installed once), or none")
    target.add_argument("--peer-dtype", default="auto",
                        help="dtype of the transformers peer (auto: as the executor's --dtype auto)")
    target.add_argument("--peer-threads", type=thread_counts, default=None,
                        help="compute threads of llama-server and OpenVINO, comma-separated: each peer row "
                             "runs once per count (default: the numbers of --executor-threads)")
    target.add_argument("--llama-server-weights", default="bf16,q4_1",
                        help="llama-server rows: bf16 (converted from --model-dir), q4_1 (the shipped GGUF)")
    target.add_argument("--openvino-weights", default="fp16,int8",
                        help="OpenVINO rows: weight formats of the optimum-intel export (fp16, int8, fp32, int4)")
    target.add_argument("--openvino-precision", choices=["bf16", "f16", "f32"], default=None,
                        help="OpenVINO's INFERENCE_PRECISION_HINT for every row (default: the CPU plugin's, bf16 "
                             "where the CPU has it; OpenVINO 2026.4 dies with SIGFPE compiling an fp16 or fp32 IR "
                             "in bf16 on some AMX Xeons: such a row then runs in f32 and says so)")
    work = p.add_argument_group("workload (ShareGPT V3)")
    work.add_argument("--model-dir", type=Path, default=None, help="tokenizer and model (default: embedded)")
    work.add_argument("--num-prompts", type=int, default=DEFAULTS["num_prompts"])
    work.add_argument("--max-input-len", type=int, default=DEFAULTS["max_input_len"],
                      help="drop user turns longer than this (tokens)")
    work.add_argument("--max-output-len", type=int, default=DEFAULTS["max_output_len"],
                      help="drop reference answers longer than this (tokens)")
    work.add_argument("--system-prompt-len", type=int, default=DEFAULTS["system_prompt_len"],
                      help="shared system prompt in front of every request (tokens; 0 = none)")
    work.add_argument("--seed", type=int, default=0)
    load = p.add_argument_group("load")
    load.add_argument("--rounds", type=positive_int, default=1,
                      help="run every row N times, kvserve and the peers taking turns going first; the tables "
                           "show each row's median round, the targets' ratios are taken within each round "
                           "(--sweep)")
    load.add_argument("--concurrency", type=int, default=None,
                      help=f"closed loop of N clients (default {DEFAULTS['concurrency']} unless --request-rate)")
    load.add_argument("--request-rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    engine = p.add_argument_group("engine limits (sweep)")
    engine.add_argument("--baseline-seqs", type=int, default=12,
                        help="the KV budget holds this many max_model_len reservations")
    engine.add_argument("--num-blocks", type=int, default=None, help="override the computed KV budget")
    engine.add_argument("--max-model-len", type=int, default=None, help="default: longest request, rounded up")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                        help="the executor's --dtype, every kvserve row (auto: bfloat16 where the CPU runs it "
                             "natively, else float32)")
    engine.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="the executor's K/V cache, every kvserve row: auto (as the executor resolves it: "
                             "--dtype's, bfloat16 where --dtype auto computes a bf16 checkpoint in float32), "
                             "bfloat16, or int8 (a float32 scale per token and head; OpenVINO's CPU plugin keeps "
                             "u8 by default)")
    engine.add_argument("--executor-threads", type=thread_counts, default=DEFAULT_THREADS,
                        help="executor --num-threads, comma-separated: every kvserve row runs once per value "
                             "(auto: the executor's own probe). Default: 1, 2, 4, ... and every usable CPU, "
                             "so each system's best count is found on this machine (the best-against-best "
                             "table takes each system's fastest row)")
    engine.add_argument("--executor-args", default="", help="more executor flags for every row (one string)")
    engine.add_argument("--gateway-args", default="", help="more gateway flags for every row (one string)")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("bench/results"))
    out.add_argument("--from-json", type=Path, help="re-render table and plot from a results.json")
    out.add_argument("--metrics-interval", type=float, default=0.25, help="seconds between /metrics scrapes")
    out.add_argument("--no-progress", action="store_true")
    return p


def emit(rows: list[report.Row], meta: dict, out_dir: Path, references: list[report.Row]) -> None:
    """Terminal table, ratios, details, targets; results.json (every round's rows), table.md, bench.png.
    ``references``: the baseline row of each executor thread count (none outside the sweep)."""
    shown = representative_rows(rows)
    lines = []
    best = best_against_best_lines(shown, meta)
    if best:
        lines += [*best, ""]
    lines += report.table_lines(shown)
    if any(r.system for r in shown):
        lines += ["", "side by side (same requests; threads, KV budget, weights and transport per row):",
                  *report.system_lines(shown)]
    for baseline in references:
        same_threads = [r for r in shown if r.system == baseline.system and r.threads == baseline.threads]
        lines += ["", *report.ratio_lines(same_threads, baseline)]
    lines += ["", *report.detail_lines(shown)]
    profile = report.profile_lines(shown)
    if profile:
        lines += ["", "where the engine's time goes (gateway step counters):", *profile]
    cpu = report.cpu_lines(shown, meta.get("machine", {}).get("usable_cpus") or usable_cpus())
    if cpu:
        lines += ["", "CPU seconds over the run, per process (the benchmark client's included):", *cpu]
    for extra in (round_lines(rows), target_lines(rows, meta.get("concurrency"))):
        if extra:
            lines += ["", *extra]
    for row in shown:
        for note in row.notes + row.errors:
            lines.append(f"- {row.name}: {note}")
    for note in dict.fromkeys(meta.get("notes", [])):
        lines.append(f"- {note}")
    text = "\n".join(lines)
    print("\n" + text)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / "results.json", rows, meta)
    (out_dir / "table.md").write_text(text + "\n")
    workload = meta.get("workload", {})
    title = (f"kvserve on ShareGPT: {workload.get('num_prompts')} prompts, mean in "
             f"{workload.get('mean_input_len', 0):.0f} / out {workload.get('mean_output_len', 0):.0f} tokens, "
             f"concurrency {meta.get('concurrency')}")
    report.write_plot(out_dir / "bench.png", shown, title)
    print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'table.md'}, {out_dir / 'bench.png'}")


def run_sweep(args, requests, meta) -> tuple[list[report.Row], report.Row | None]:
    """The seed-table rows and the peers' rows, ``--rounds`` times; every row carries its round."""
    from bench.sweep import (plan_budget, plan_configs, probe_auto_threads, resolve_auto_dtype,
                             resolve_auto_kv_cache_dtype)

    # The flag as asked decides the rows' precision class; the resolved name is what runs.
    args.dtype_flag, args.dtype = args.dtype, resolve_auto_dtype(args.dtype, args.model_dir)
    configs = plan_configs(args.configs, args.kvserve_quantization, args.executor_threads)
    budget = plan_budget(requests, block_size=args.block_size, baseline_seqs=args.baseline_seqs,
                         max_model_len=args.max_model_len, num_blocks=args.num_blocks,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         dtype=args.dtype)
    budget.kv_cache_dtype = args.kv_cache_dtype = resolve_auto_kv_cache_dtype(args.kv_cache_dtype, args.dtype_flag,
                                                                              args.dtype, args.model_dir)
    budget.extra_executor_args = shlex.split(args.executor_args)
    budget.extra_gateway_args = shlex.split(args.gateway_args)
    meta["budget"] = vars(budget)
    meta["rounds"] = args.rounds
    meta["executor_auto_threads"] = {
        mode: probe_auto_threads(args.model_dir, args.dtype, mode, args.kv_cache_dtype)
        for mode in dict.fromkeys(["none", *args.kvserve_quantization])}
    print(f"KV budget: {budget.num_blocks} blocks (one of them the null block) x {budget.block_size} tokens = "
          f"{(budget.num_blocks - 1) * budget.block_size} usable slots = {args.baseline_seqs} x max_model_len "
          f"{budget.max_model_len}; max_num_seqs {budget.max_num_seqs}")
    rows: list[report.Row] = []
    for round_index in range(args.rounds):
        if args.rounds > 1:
            print(f"== round {round_index + 1} of {args.rounds}")
        parts = [lambda: run_kvserve_rows(args, requests, meta, budget, configs),
                 lambda: run_other_rows(args, requests, meta, budget)]
        if round_index % 2:  # kvserve and the peers take turns going first: neither always meets the same hour
            parts.reverse()
        for part in parts:
            for row in part():
                row.round_index = round_index
                rows.append(row)
    return rows, baselines(representative_rows(rows))


def baselines(rows: list[report.Row]) -> list[report.Row]:
    """The seed table's baseline row of each executor thread count, each the reference of the rows
    that ran on the same count."""
    from bench.sweep import SEED_TABLE

    return [r for r in rows if r.system == "kvserve" and r.name.startswith(SEED_TABLE[0].name) and r.completed]


def run_kvserve_rows(args, requests, meta, budget, configs) -> list[report.Row]:
    from bench.sweep import run_seed_table, weight_bits, weights_description

    rows, details = run_seed_table(requests, budget, args.model_dir, args.out, concurrency=args.concurrency,
                                   request_rate=args.request_rate, seed=args.seed, configs=configs,
                                   progress=not args.no_progress, metrics_interval=args.metrics_interval)
    meta.setdefault("runs", []).extend(details)
    usable = (budget.num_blocks - 1) * budget.block_size
    for row, config in zip(rows, configs):  # what every kvserve row ran with, for the side-by-side table
        row.system, row.threads, row.transport = "kvserve", config.threads, "HTTP"
        row.weights = weights_description(args.dtype, config.quantization)
        row.weight_bits = weight_bits(args.dtype_flag, config.quantization)
        row.kv_budget = (f"{usable} tokens ({budget.num_blocks - 1} blocks x {budget.block_size}, "
                         f"{args.baseline_seqs} x max_model_len {budget.max_model_len}), {budget.kv_description()}")
    return rows


def run_other_rows(args, requests, meta, budget) -> list[report.Row]:
    rows: list[report.Row] = []
    peers = set(parse_peers(args.peers))
    if "transformers" in peers:
        from bench.peers.transformers_peer import run_transformers_peer
        from bench.sweep import resolve_auto_dtype

        dtype = resolve_auto_dtype(args.peer_dtype, args.model_dir)
        print(f"== peer: transformers static batching ({dtype})")
        rows.append(run_transformers_peer(args.model_dir, requests, args.concurrency or len(requests),
                                          dtype=dtype, progress=not args.no_progress))
        import torch

        rows[-1].system, rows[-1].weights, rows[-1].threads = "transformers", dtype, torch.get_num_threads()
        rows[-1].weight_bits = 32 if args.peer_dtype == "float32" else 16
        rows[-1].kv_budget, rows[-1].transport = "padded batch, no budget", "in-process"
    rows += run_cpu_peers(args, requests, budget, meta, [p for p in parse_peers(args.peers)
                                                         if p in ("llama-server", "openvino")])
    return rows


def peer_thread_counts(args) -> list[int]:
    """The peers' thread counts: --peer-threads, else the numbers among --executor-threads, else
    every usable CPU."""
    counts = [n for n in (args.peer_threads or args.executor_threads) if n is not None]
    return counts or [usable_cpus()]


def run_cpu_peers(args, requests, budget, meta, peers: list[str]) -> list[report.Row]:
    """llama-server and OpenVINO GenAI rows on the same requests, with the KV budget kvserve's rows
    got (in tokens), once per peer thread count (named after it when there are several); a peer
    that cannot be set up is skipped with its reason printed and kept in the results' notes."""
    if not peers:
        return []
    counts = peer_thread_counts(args)
    rows = []
    for threads in counts:
        found = run_cpu_peers_on(args, requests, budget, meta, peers, threads)
        if len(counts) > 1:
            for row in found:
                row.name = f"{row.name} · {threads_label(threads)}"
        rows += found
    return rows


def run_cpu_peers_on(args, requests, budget, meta, peers: list[str], threads: int) -> list[report.Row]:
    """The peers' rows with ``threads`` compute threads each."""
    kv_tokens = (budget.num_blocks - 1) * budget.block_size
    concurrency = args.concurrency or budget.max_num_seqs
    log_dir = args.out / "logs"
    rows: list[report.Row] = []
    setup = meta.setdefault("peer_setup", {}).setdefault(str(threads), {})
    skipped: list[str] = []
    if "llama-server" in peers:
        from bench.peers.llama_server import run_peer as run_llama_server

        print(f"== peer: llama.cpp llama-server ({args.llama_server_weights})")
        found, reasons, facts = run_llama_server(
            requests, model_dir=args.model_dir, variants=parse_list(args.llama_server_weights, LLAMA_SERVER_WEIGHTS,
                                                                    "llama-server weights"),
            concurrency=concurrency, threads=threads, kv_tokens=kv_tokens,
            kv_note=f"{kv_tokens} tokens (-c, --kv-unified, f16 K/V)", log_dir=log_dir,
            progress=not args.no_progress, request_rate=args.request_rate, seed=args.seed)
        rows += found
        skipped += reasons
        setup["llama-server"] = facts
    if "openvino" in peers:
        from bench.peers.openvino_peer import run_peer as run_openvino

        print(f"== peer: OpenVINO GenAI ContinuousBatchingPipeline ({args.openvino_weights})")
        if args.request_rate:
            found, reasons, facts = [], ["OpenVINO GenAI skipped: its in-process runner drives a closed loop "
                                         "only (give --concurrency, not --request-rate)"], {}
        else:
            found, reasons, facts = run_openvino(
                requests, model_dir=args.model_dir, variants=parse_list(args.openvino_weights, OPENVINO_WEIGHTS,
                                                                        "OpenVINO weights"),
                concurrency=concurrency, threads=threads, kv_tokens=kv_tokens,
                kv_note=f"{-(-kv_tokens // 32) * 32} tokens ({-(-kv_tokens // 32)} blocks x 32)",
                max_num_batched_tokens=budget.max_num_batched_tokens, log_dir=log_dir,
                precision=args.openvino_precision)
        rows += found
        skipped += reasons
        setup["openvino"] = facts
    for row in rows:
        print(f"   {row.name}: {row.completed} done, {row.failed} failed, {row.output_throughput:.1f} output tok/s, "
              f"TTFT P99 {row.ttft_ms.get('p99') or float('nan'):.0f} ms, {row.duration_s:.0f} s")
    for reason in skipped:
        print(f"   {reason}")
    meta.setdefault("notes", []).extend(skipped)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg == "--executors" or arg.startswith("--executors=") for arg in argv):
        from bench import routing_bench  # a workload of its own: multi-turn conversations

        return routing_bench.main(argv)
    args = build_parser().parse_args(argv)
    try:
        parse_peers(args.peers)
        parse_list(args.llama_server_weights, LLAMA_SERVER_WEIGHTS, "llama-server weights")
        parse_list(args.openvino_weights, OPENVINO_WEIGHTS, "OpenVINO weights")
    except ValueError as exc:
        build_parser().error(str(exc))
    if args.from_json:
        rows, meta = report.load_json(args.from_json)
        emit(rows, meta, args.out, baselines(representative_rows(rows)))
        return 0
    if not args.sweep and not args.base_url:
        build_parser().error("give --base-url (a running server) or --sweep seed-table")
    if args.rounds > 1 and not args.sweep:
        build_parser().error("--rounds runs the sweep's rows again: give --sweep seed-table")
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = DEFAULTS["concurrency"]
    args.model_dir = args.model_dir or default_model_dir()
    started = time.perf_counter()
    tokenizer = load_tokenizer(args.model_dir)
    system_prompt = make_system_prompt(tokenizer, args.system_prompt_len)
    requests = sample_requests(tokenizer, args.num_prompts, seed=args.seed, max_input_len=args.max_input_len,
                               max_output_len=args.max_output_len, system_prompt=system_prompt)
    from bench.sweep import machine_description

    meta = {"command": "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv),
            "workload": describe(requests), "concurrency": args.concurrency, "request_rate": args.request_rate,
            "seed": args.seed, "system_prompt_len": args.system_prompt_len, "machine": machine_description(),
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "lscpu": write_lscpu(args.out)}
    w = meta["workload"]
    print(f"workload: {w['num_prompts']} ShareGPT prompts, mean input {w['mean_input_len']:.0f} tokens "
          f"(system prompt {args.system_prompt_len}), mean output {w['mean_output_len']:.0f} tokens "
          f"({w['total_output_tokens']} in all); loaded in {time.perf_counter() - started:.1f} s")
    if args.sweep:
        rows, references = run_sweep(args, requests, meta)
    else:
        from bench.runner import measure_async, model_info_async

        if args.grpc_address:
            meta["model_info"] = asyncio.run(model_info_async(args.grpc_address))
        kv_allocation = meta.get("model_info", {}).get("kv_allocation", "")
        rows = [asyncio.run(measure_async(args.name, requests, base_url=args.base_url.rstrip("/"),
                                          grpc_address=args.grpc_address, concurrency=args.concurrency,
                                          request_rate=args.request_rate, seed=args.seed,
                                          metrics_interval=args.metrics_interval, progress=not args.no_progress,
                                          kv_allocation=kv_allocation))]
        references = []
    meta["wall_s"] = time.perf_counter() - started
    emit(rows, meta, args.out, references)
    return 0 if all(r.completed for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
