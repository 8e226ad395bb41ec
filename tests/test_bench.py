"""The benchmark tool: ShareGPT loading, metrics parsing, reporting, the HF peer's bookkeeping."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from bench import report
from bench.client import RequestResult, usage_of
from bench.cpu_usage import CLIENT, CpuMeter, cpu_line
from bench.peers.transformers_peer import batch_kv_slots, left_padded
from bench.server_metrics import MetricsSampler, ServerMetrics, parse_prometheus, sample_from
from bench.sweep import KV_CACHE_DTYPES, QUANTIZATION_MODES, SEED_TABLE, check_applied, plan_budget, plan_configs
from bench.workload import (BenchRequest, first_exchange, iter_records, load_pairs, load_tokenizer,
                            make_system_prompt, parse_sharegpt, sample_requests, sharegpt_path)
from kvserve.cpus import usable_cpus


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The real ShareGPT file's pairs, through a fresh cache (so the parse path runs too)."""
    return load_pairs(cache=tmp_path_factory.mktemp("bench-cache") / "pairs.json")


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def test_iter_records_drops_a_truncated_tail():
    text = '[{"a": 1}, {"a": 2},\n {"a": 3, "b": "cut off he'
    assert [r["a"] for r in iter_records(text)] == [1, 2]
    assert [r["a"] for r in iter_records('[ {"a": 1} , {"a": 2} ]')] == [1, 2]


def test_first_exchange_takes_the_first_human_turn_and_its_answer():
    record = {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "Q"},
                                {"from": "gpt", "value": "A"}, {"from": "human", "value": "Q2"}]}
    assert first_exchange(record) == ("Q", "A")
    assert first_exchange({"conversations": [{"from": "human", "value": "alone"}]}) is None


def test_real_sharegpt_file_has_17671_complete_conversations(tmp_path):
    records, pairs = parse_sharegpt(sharegpt_path())
    assert records == 17671
    assert 17000 < len(pairs) <= records
    cached = load_pairs(cache=tmp_path / "c.json")
    assert len(cached) == len(pairs) and json.loads((tmp_path / "c.json").read_text())["records"] == records
    assert load_pairs(cache=tmp_path / "c.json")[:3] == cached[:3]  # the cache round-trips


def test_sampling_is_seeded_and_filtered_like_vllm(pairs, tokenizer):
    a = sample_requests(tokenizer, 50, seed=1, max_input_len=256, max_output_len=128, pairs=pairs)
    b = sample_requests(tokenizer, 50, seed=1, max_input_len=256, max_output_len=128, pairs=pairs)
    c = sample_requests(tokenizer, 50, seed=2, max_input_len=256, max_output_len=128, pairs=pairs)
    assert a == b and a != c and len(a) == 50
    assert all(4 <= r.prompt_len <= 256 and 4 <= r.output_len <= 128 for r in a)
    for r in a[:5]:
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False).ids) == r.prompt_len


def test_system_prompt_is_shared_and_counted(pairs, tokenizer):
    system = make_system_prompt(tokenizer, 64)
    assert 64 <= len(tokenizer.encode(system, add_special_tokens=False).ids) <= 66
    plain = sample_requests(tokenizer, 10, seed=3, pairs=pairs)
    with_system = sample_requests(tokenizer, 10, seed=3, system_prompt=system, pairs=pairs)
    system_len = len(tokenizer.encode(system, add_special_tokens=False).ids)
    for p, s in zip(plain, with_system):
        assert s.prompt.startswith(system) and s.prompt_len == p.prompt_len + system_len
    assert make_system_prompt(tokenizer, 0) == ""


PROMETHEUS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:prefix_cache_queries_total{model_name="m"} 1000.0
vllm:prefix_cache_hits_total{model_name="m"} 600.0
vllm:num_preemptions_total{model_name="m"} 2.0
kvserve:kv_stored_tokens 970
kvserve:kv_allocated_slots 1000
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_count{model_name="m"} 9.0
weird_metric NaN
"""


def test_parse_prometheus_reads_vllm_and_kvserve_names():
    values = parse_prometheus(PROMETHEUS)
    assert values["vllm:num_requests_running"] == 7.0
    assert values["vllm:time_to_first_token_seconds_count"] == 9.0
    assert "weird_metric" not in values
    sample = sample_from(values, 1.5)
    assert (sample.running, sample.waiting, sample.kv_usage) == (7.0, 3.0, 0.5)
    assert (sample.kv_stored, sample.kv_allocated) == (970, 1000)
    assert sample_from({"vllm:kv_cache_usage_perc": 50.0}, 0).kv_usage == 0.5  # percent form


def test_server_metrics_peaks_and_time_weighted_utilization():
    metrics = ServerMetrics(available=True, counters={"prefix_cache_queries": 100, "prefix_cache_hits": 80})
    for t, running, stored, allocated in ((0, 0, 0, 0), (1, 4, 90, 100), (2, 9, 380, 400)):
        metrics.samples.append(sample_from({"vllm:num_requests_running": running, "kvserve:kv_stored_tokens": stored,
                                            "kvserve:kv_allocated_slots": allocated,
                                            "vllm:kv_cache_usage_perc": allocated / 1000}, t))
    assert metrics.peak_running() == 9
    assert metrics.kv_utilization() == pytest.approx(470 / 500)
    assert metrics.prefix_hit_rate() == 0.8
    assert metrics.mean_kv_usage() == pytest.approx(0.25)


def _result(sent, ttft, e2e, tokens, ok=True):
    return RequestResult(10, tokens, sent_at=sent, ttft=ttft, e2e=e2e, itl=[0.01] * (tokens - 1),
                         output_tokens=tokens, ok=ok)


def test_row_from_results_computes_throughput_percentiles_and_concurrency():
    results = [_result(0, 0.1, 1.0, 10), _result(0, 0.2, 2.0, 20), _result(0.5, 0.1, 0.5, 5),
               RequestResult(10, 5, error="HTTP 500: boom")]
    row = report.row_from_results("x", results, wall_s=2.0)
    assert (row.completed, row.failed, row.output_tokens) == (3, 1, 35)
    assert row.output_throughput == 17.5
    assert row.ttft_ms["p99"] == pytest.approx(199, abs=1)
    assert row.max_concurrency == 3 and row.errors == ["HTTP 500: boom"]
    # TPOT per request: (E2E - TTFT) / (tokens - 1) = 0.9 / 9, 1.8 / 19, 0.4 / 4 s; ITL stays the chunk gaps.
    assert row.tpot_ms["mean"] == pytest.approx(1000 * (0.1 + 1.8 / 19 + 0.1) / 3)
    assert row.itl_ms["mean"] == pytest.approx(10.0)


def test_internal_fragmentation_counts_last_block_slots():
    assert report.internal_fragmentation([16, 32], 16) == 0.0
    assert report.internal_fragmentation([17], 16) == pytest.approx(15 / 32)


def test_usage_of_reads_cached_tokens():
    chunk = {"usage": {"prompt_tokens": 80, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 64}}}
    assert usage_of(chunk) == (9, 64, 80) and usage_of({"choices": []}) is None


def test_table_json_and_plot_are_written(tmp_path):
    base = report.row_from_results("baseline (static)", [_result(0, 1.0, 3.0, 10)], 3.0)
    fast = report.row_from_results("+ prefix", [_result(0, 0.1, 1.0, 10)], 1.0)
    fast.kv_utilization, fast.kv_usage_series = 0.97, [(0, 0.1), (0.5, 0.6), (1.0, 0.2)]
    lines = report.table_lines([base, fast])
    assert lines[0] == "| " + " | ".join(report.TABLE_COLUMNS) + " |"
    assert "| + prefix | 1 | 10.0 | 100 ms | 97.0% |" in lines
    assert report.ratio_lines([fast], base) == ["+ prefix: throughput 3.00x baseline, TTFT P99 90% lower"]
    report.write_json(tmp_path / "r.json", [base, fast], {"k": 1})
    rows, meta = report.load_json(tmp_path / "r.json")
    assert meta == {"k": 1} and rows[1].kv_utilization == 0.97
    report.write_plot(tmp_path / "p.png", [base, fast], "title")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("close_before_body", [False, True])
def test_a_request_whose_pooled_connection_the_server_closed_is_retried_once_and_timed_from_the_first_send(
        close_before_body):
    """llama-server now and then closes a kept-alive connection as the next request arrives on it,
    after reading the request or before: the client retries once on a new connection, and the lost
    time stays in that request's TTFT."""
    import aiohttp

    from bench.client import send_http

    answered = []

    async def handler(reader, writer):
        if close_before_body and not answered:  # reset before the request is read
            answered.append("closed")
            await asyncio.sleep(0.2)
            writer.transport.abort()
            return
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        if not answered:  # the first request: closed without a byte of response
            answered.append("closed")
            await asyncio.sleep(0.2)
            writer.close()
            return
        answered.append("answered")
        events = [{"choices": [{"text": " hi"}]}, {"choices": [{"text": "!"}]},
                  {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 3}}]
        payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload.encode())
        await writer.drain()
        writer.close()

    async def run():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession() as session:
            result = await send_http(session, f"http://127.0.0.1:{port}", "m", BenchRequest("p", 3, 2), 0.0)
        server.close()
        return result

    result = asyncio.run(run())
    assert answered == ["closed", "answered"]
    assert result.ok and not result.error and result.output_tokens == 2
    assert result.ttft >= 0.2 and result.e2e >= result.ttft  # timed from the first send


def test_a_request_whose_body_could_not_be_written_is_retried_once(monkeypatch):
    """aiohttp reports a pooled connection closed before the request's body went out as ClientOSError
    (llama-server at 32 streams): retried like a disconnect; any other error is not."""
    import types

    import aiohttp

    from bench import client

    calls = []
    errors = {"p": ["ClientOSError: [Errno None] Can not write request body", ""], "bad": ["HTTP 400: bad"]}

    async def once(session, base_url, model, request, t0):
        calls.append(request.prompt)
        result = client.RequestResult(request.prompt_len, request.output_len)
        result.error = errors[request.prompt].pop(0)
        result.ok = not result.error
        return result

    monkeypatch.setattr(client, "_send_http_once", once)
    pooled = types.SimpleNamespace(timeout=aiohttp.ClientTimeout(total=5))
    result = asyncio.run(client.send_http(pooled, "http://x", "m", BenchRequest("p", 3, 2), 0.0))
    assert calls == ["p", "p"] and result.ok and not result.error
    calls.clear()
    result = asyncio.run(client.send_http(pooled, "http://x", "m", BenchRequest("bad", 3, 2), 0.0))
    assert calls == ["bad"] and result.error == "HTTP 400: bad"


def test_hf_peer_padding_and_kv_bookkeeping():
    ids, mask = left_padded([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    stored, allocated = batch_kv_slots([3, 1], [2, 1])
    # step 0: 2x3 slots hold 3+1; step 1: 2x4 slots hold (3+1)+(1+1)
    assert (stored, allocated) == (4 + 6, 6 + 8)


def test_budget_fits_baseline_seqs_full_reservations():
    requests = [BenchRequest("p", 100, 50), BenchRequest("q", 300, 190)]
    budget = plan_budget(requests, block_size=16, baseline_seqs=12)
    assert budget.max_model_len == 512 and budget.num_blocks == 12 * 32 + 1
    assert "--num-blocks" in budget.executor_args() and "--max-num-seqs" in budget.gateway_args()
    assert "--kv-cache-dtype" not in budget.executor_args() and budget.kv_description() == "bfloat16 K/V"
    budget.kv_cache_dtype = "int8"  # bench --kv-cache-dtype int8: every kvserve row's executor, and its label
    assert budget.executor_args()[-2:] == ["--kv-cache-dtype", "int8"] and budget.kv_description().startswith("int8")
    assert SEED_TABLE[0].gateway_args() == ["--batching", "static", "--kv-allocation", "reserve",
                                            "--no-enable-prefix-caching", "--speculative-decoding", "off"]
    info = {"batching": "continuous", "kv_allocation": "reserve", "enable_prefix_caching": False}
    assert check_applied(SEED_TABLE[1], info) == []
    assert check_applied(SEED_TABLE[0], info) == ["asked batching='static', gateway reports 'continuous'"]


def test_kvserve_quantization_option_parses_and_rejects_an_unknown_mode(capsys):
    from bench.__main__ import build_parser, main
    from executor.quantization import QUANTIZATION_MODES as EXECUTOR_MODES

    from executor.attention import KV_CACHE_DTYPES as EXECUTOR_KV_CACHE_DTYPES

    assert QUANTIZATION_MODES == EXECUTOR_MODES  # bench's copy, kept to spare the CLI importing torch
    assert KV_CACHE_DTYPES == EXECUTOR_KV_CACHE_DTYPES
    parser = build_parser()
    assert parser.parse_args([]).kvserve_quantization == []
    assert parser.parse_args(["--kvserve-quantization", "none,int8,int4"]).kvserve_quantization == ["int8", "int4"]
    assert parser.parse_args(["--kvserve-quantization", " INT4 "]).kvserve_quantization == ["int4"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--sweep", "seed-table", "--kvserve-quantization", "int8,int3"])
    assert exit_info.value.code == 2
    assert ("argument --kvserve-quantization: unknown kvserve quantization 'int3' (known: none, int8, int4)"
            in capsys.readouterr().err)


def test_sweep_plans_the_prefix_caching_row_once_per_quantization(tmp_path, monkeypatch):
    """``--configs paged --kvserve-quantization int8,int4``: the paged row, then the prefix-caching row
    with an int8 and an int4 executor. start_stack only records what it was asked to start."""
    from bench import sweep
    from bench.__main__ import build_parser, run_sweep

    assert plan_configs({c.slug for c in SEED_TABLE}, []) == SEED_TABLE  # the seed table as it was
    asked = []

    def record_and_refuse(stack_config):
        asked.append(stack_config)
        raise RuntimeError("no stack under test")

    monkeypatch.setattr(sweep, "start_stack", record_and_refuse)
    args = build_parser().parse_args(["--sweep", "seed-table", "--configs", "paged", "--peers", "none",
                                      "--kvserve-quantization", "none,int8,int4", "--executor-threads", "1",
                                      "--dtype", "bfloat16", "--concurrency", "1", "--no-progress", "--out",
                                      str(tmp_path), "--gateway-args", "--speculative-decoding prompt-lookup"])
    args.model_dir = tmp_path
    rows, _ = run_sweep(args, [BenchRequest("p", 100, 50)], {})
    prefix = SEED_TABLE[3]
    assert [r.name for r in rows] == [SEED_TABLE[2].name, f"{prefix.name}, int8 weights",
                                      f"{prefix.name}, int4 weights"]
    assert [s.log_dir.name for s in asked] == ["paged", "prefix-int8", "prefix-int4"]
    first = asked[0].executor_args
    assert "--quantization" not in first and "--num-blocks" in first and first[-2:] == ["--num-threads", "1"]
    budget_args = first[:-2]
    assert [s.executor_args for s in asked[1:]] == [[*budget_args, "--quantization", "int8", "--num-threads", "1"],
                                                    [*budget_args, "--quantization", "int4", "--num-threads", "1"]]
    # the row's flags first, then --gateway-args, which win
    assert all(s.gateway_args[:len(prefix.gateway_args())] == prefix.gateway_args() for s in asked[1:])
    assert all(s.gateway_args[-2:] == ["--speculative-decoding", "prompt-lookup"] for s in asked)
    assert [r.weights for r in rows] == ["safetensors loaded in bfloat16",
                                         "safetensors loaded in bfloat16, int8 weights (per channel) x int8 "
                                         "activations (per token, groups of 32); LM head int8",
                                         "safetensors loaded in bfloat16, int4 weights (groups of 32); LM head int8"]
    assert all(r.failed == 1 and "no stack under test" in r.errors[0] for r in rows)
    # The running executor's dtype says whether the quantization was applied.
    int4 = plan_configs(set(), ["int4"])[0]
    assert check_applied(int4, {"dtype": "bfloat16+int4"}) == [] and check_applied(prefix, {"dtype": "bfloat16"}) == []
    assert check_applied(int4, {"dtype": "bfloat16"}) == \
        ["asked quantization='int4', executor reports dtype 'bfloat16'"]
    # ... and whether the int8 KV cache was (--kv-cache-dtype, every row)
    assert check_applied(int4, {"dtype": "bfloat16+int4+kv-int8"}, "int8") == []
    assert check_applied(prefix, {"dtype": "bfloat16+kv-int8"}, "int8") == []
    assert check_applied(prefix, {"dtype": "bfloat16"}, "int8") == \
        ["asked kv_cache_dtype='int8', executor reports dtype 'bfloat16'"]
    assert check_applied(prefix, {"dtype": "bfloat16+kv-int8"}) == \
        ["asked kv_cache_dtype='auto', executor reports dtype 'bfloat16+kv-int8'"]


def test_the_default_sweep_runs_kvserve_as_it_runs_by_default_for_each_precision(tmp_path, monkeypatch, capsys):
    """``make bench``'s kvserve rows: the seed table with prompt lookup off, then kvserve's defaults
    (prompt lookup on, the gateway's default) once per precision: the rows the best-against-best
    table compares with the peers in their own defaults."""
    from bench import sweep
    from bench.__main__ import build_parser, main, run_sweep
    from gateway.__main__ import build_parser as gateway_parser

    asked = []

    def record_and_refuse(stack_config):
        asked.append(stack_config)
        raise RuntimeError("no stack under test")

    monkeypatch.setattr(sweep, "start_stack", record_and_refuse)
    args = build_parser().parse_args(["--sweep", "seed-table", "--peers", "none", "--kvserve-quantization",
                                      "none,int8,int4", "--executor-threads", "1", "--dtype", "bfloat16",
                                      "--concurrency", "1", "--no-progress", "--out", str(tmp_path)])
    args.model_dir = tmp_path
    rows, _ = run_sweep(args, [BenchRequest("p", 100, 50)], {})
    assert [s.log_dir.name for s in asked] == ["baseline", "continuous", "paged", "prefix", "defaults",
                                               "defaults-int8", "defaults-int4"]
    drafting = [gateway_parser().parse_args(s.gateway_args).speculative_decoding for s in asked]
    assert drafting == ["off"] * 4 + ["prompt-lookup"] * 3
    assert gateway_parser().parse_args([]).speculative_decoding == "prompt-lookup"  # what "defaults" stands for
    assert [r.weight_bits for r in rows[-3:]] == [16, 8, 4] and all(r.system == "kvserve" for r in rows)
    # without the defaults row, the quantized rows are the prefix-caching row's, as before
    assert [c.slug for c in plan_configs({"prefix"}, ["int8"])] == ["prefix", "prefix-int8"]
    with pytest.raises(SystemExit):
        main(["--sweep", "seed-table", "--configs", "prefix,fastest"])
    assert "unknown kvserve row 'fastest' (known: baseline, continuous, paged, prefix, defaults)" in \
        capsys.readouterr().err


def test_sampler_tolerates_an_unreachable_server():
    async def sample_nothing():
        sampler = MetricsSampler("http://127.0.0.1:9", interval=0.01)
        await sampler.start()
        return await sampler.stop()

    metrics = asyncio.run(sample_nothing())
    assert not metrics.available and metrics.samples == []


def test_sweep_end_to_end_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    """Two seed-table rows and the transformers peer on a few prompts, each against a real stack."""
    from bench.__main__ import main

    out = tmp_path / "results"
    code = main(["--sweep", "seed-table", "--configs", "baseline,prefix", "--peers", "transformers",
                 "--model-dir", str(tiny_model_dir), "--num-prompts", "6", "--max-input-len", "48",
                 "--max-output-len", "24", "--system-prompt-len", "40", "--concurrency", "4",
                 "--baseline-seqs", "2", "--dtype", "float32", "--peer-dtype", "float32", "--metrics-interval", "0.05",
                 "--executor-threads", "1", "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    rows, meta = report.load_json(out / "results.json")
    assert code == 0, printed
    assert [r.name for r in rows][:2] == [SEED_TABLE[0].name, SEED_TABLE[3].name]
    baseline, prefix, peer = rows[0], rows[1], rows[2]
    for row in (baseline, prefix, peer):
        assert row.completed == 6 and row.failed == 0, row.errors
        assert row.output_tokens == meta["workload"]["total_output_tokens"]
    # The budget holds two reservations, so steps average two sequences at most. Asserted on the
    # steps: a client sees a next batch's first token before the last one's end (the gateway writes
    # a step's outputs after the next step's Execute), and the running gauge counts an admission
    # whose reservation is then refused.
    assert 0 < baseline.profile["mean_seqs_per_step"] <= 2
    assert prefix.kv_utilization is not None and 0 < prefix.kv_utilization <= 1
    assert prefix.internal_fragmentation == pytest.approx(1 - prefix.kv_utilization)
    assert baseline.internal_fragmentation is None and baseline.unused_kv_slots is not None
    assert prefix.profile["steps"] > 0 and "executor_forward" in prefix.profile["step_time_by_phase_s"]
    assert prefix.prefix_cache_hit_rate and prefix.prefix_cache_hit_rate > 0
    assert prefix.cached_prompt_tokens > 0
    assert all(run["model_info"]["batching"] == run["config"]["batching"] for run in meta["runs"])
    assert "throughput" in printed and (out / "bench.png").exists() and (out / "table.md").exists()
    assert meta["executor_auto_threads"]["none"]["chosen"] in range(1, usable_cpus() + 1)
    assert "best against best" in printed and "--num-threads auto picks" in printed
    # Every kvserve row says what CPU each of its three services and the client used over its run,
    # no more in all than the machine's CPUs offer in that time (give or take a few 10 ms ticks a process).
    cpu_section = printed.split("CPU seconds over the run, per process", 1)[1]
    for row in (baseline, prefix):
        assert set(row.cpu_s) == {"kvmanager", "executor", "gateway", "client"}, row.cpu_s
        assert row.cpu_s["executor"] > 0 and row.cpu_s["gateway"] > 0 and row.cpu_s["kvmanager"] >= 0
        assert sum(row.cpu_s.values()) <= usable_cpus() * row.duration_s + 0.05 * len(row.cpu_s)
        assert f"executor {row.cpu_s['executor']:.2f} s" in cpu_section.split(f"- {row.name}: ", 1)[1].split("\n")[0]
    assert list(peer.cpu_s) == ["transformers (in-process)"] and peer.cpu_s["transformers (in-process)"] > 0


def test_the_cpu_meter_counts_each_process_over_the_run_and_leaves_out_one_that_is_gone():
    # Spins for 0.4 s of CPU once told to, then sleeps: what it used before the meter started is not counted.
    busy = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                             "end = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
                             "print('done', flush=True)\ntime.sleep(60)"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        meter = CpuMeter({"busy": busy.pid, "gone": gone.pid, "no such": 2**22 + 1})
        meter.start()
        busy.stdin.write("go\n")
        busy.stdin.flush()
        assert busy.stdout.readline() == "done\n"
        cpu_s = meter.stop()
    finally:
        busy.kill()
        busy.wait()
    assert set(cpu_s) == {"busy", CLIENT}
    assert 0.3 <= cpu_s["busy"] <= 1.0 and 0.0 <= cpu_s[CLIENT] < cpu_s["busy"]
    assert cpu_line({"client": 0.25, "executor": 14.1}, 8.0, 2) == (
        "executor 14.10 s, client 0.25 s (of 2 CPUs x 8.0 s = 16.0 CPU s)")


def test_matmul_bench_prompt_mode_times_every_kernel_on_a_tiny_model(tiny_model_dir, cpu_ops, capsys):
    """``python -m bench.matmul_bench --prompt``: one row of timings per row count, a cell per kernel
    (oneDNN, and int8 / int4 with the SiLU separate and from the sums); where the CPU has no AMX bf16
    tiles it says so instead."""
    from bench.matmul_bench import main

    assert main(["--model", str(tiny_model_dir), "--prompt", "--rows", "5,33", "--rounds", "1"]) == 0
    printed = capsys.readouterr().out
    if not cpu_ops.has_prompt_linear():
        assert "no AMX bf16 tiles" in printed
        return
    lines = printed.splitlines()
    header = next(line for line in lines if line.startswith("| rows |"))
    assert header.count("SiLU from the sums") == 2 and "oneDNN bf16" in header
    rows = [line for line in lines if line.startswith(("| 5 |", "| 33 |"))]
    assert len(rows) == 2 and all(row.count(" ms (") == 5 for row in rows), printed


def test_matmul_bench_layer_ops_times_both_implementations_in_the_executors_dtype(tiny_model_dir, cpu_ops,
                                                                                   capsys):
    """``python -m bench.matmul_bench --layer-ops``: a row per row count, compiled beside torch for each
    op, in the dtype ``--dtype auto`` gives the executor on this CPU (float32 where bf16 is emulated:
    timing bf16 there measured a path the executor does not run)."""
    from bench.matmul_bench import main
    from executor.devices import cpu_packs_bf16

    assert main(["--model", str(tiny_model_dir), "--layer-ops", "--rows", "1,3", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"in {'bfloat16' if cpu_packs_bf16() else 'float32'}," in lines[0]
    rows = [line for line in lines if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 2 and all(row.count(" (") == 6 for row in rows), lines


def test_every_row_runs_once_per_thread_count_and_the_peers_too(tmp_path, monkeypatch):
    """``--executor-threads 1,2,auto``: the seed table once per count, each row named after its count
    and started with it; ``--peer-threads 1,2``: each peer row once per count; each count's rows are
    compared with that count's baseline."""
    from bench import sweep
    import bench.__main__ as cli

    asked, peer_counts = [], []

    def record_and_refuse(stack_config):
        asked.append(stack_config)
        raise RuntimeError("no stack under test")

    def peers_on(args, requests, budget, meta, peers, threads):
        peer_counts.append(threads)
        return [report.Row(name="OpenVINO GenAI CB FP16", system="OpenVINO GenAI", threads=threads)]

    monkeypatch.setattr(sweep, "start_stack", record_and_refuse)
    monkeypatch.setattr(sweep, "probe_auto_threads", lambda *a: {"chosen": 2})
    monkeypatch.setattr(cli, "run_cpu_peers_on", peers_on)
    args = cli.build_parser().parse_args(["--sweep", "seed-table", "--configs", "baseline,prefix", "--peers", "openvino",
                                          "--executor-threads", "1,2,auto", "--peer-threads", "1,2",
                                          "--dtype", "bfloat16", "--concurrency", "4", "--no-progress", "--out", str(tmp_path)])
    args.model_dir = tmp_path
    meta = {}
    rows, references = cli.run_sweep(args, [BenchRequest("p", 100, 50)], meta)
    base, prefix = SEED_TABLE[0].name, SEED_TABLE[3].name
    assert [r.name for r in rows] == [f"{base} · 1 thread", f"{prefix} · 1 thread", f"{base} · 2 threads",
                                      f"{prefix} · 2 threads", f"{base} · auto threads", f"{prefix} · auto threads",
                                      "OpenVINO GenAI CB FP16 · 1 thread", "OpenVINO GenAI CB FP16 · 2 threads"]
    assert [r.threads for r in rows] == [1, 1, 2, 2, None, None, 1, 2]
    assert [s.executor_args[-2:] for s in asked] == [["--num-threads", n] for n in ("1", "1", "2", "2", "auto", "auto")]
    assert len({s.log_dir for s in asked}) == 6  # every row keeps its own logs
    assert peer_counts == [1, 2]
    assert meta["executor_auto_threads"] == {"none": {"chosen": 2}}
    assert references == []  # every row failed to start here: no baseline to compare with
    for row in rows[:6]:
        row.completed = 4
    assert [r.threads for r in cli.baselines(rows)] == [1, 2, None]
    assert cli.peer_thread_counts(cli.build_parser().parse_args(["--executor-threads", "auto,2"])) == [2]
    assert cli.peer_thread_counts(cli.build_parser().parse_args(["--executor-threads", "auto"])) == [usable_cpus()]


@pytest.mark.parametrize("text", ["0", "two", ",", "1,-1"])
def test_thread_count_lists_refuse_what_is_not_a_count(text, capsys):
    from bench.__main__ import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--executor-threads", text])
    assert "thread count" in capsys.readouterr().err


def test_executor_bench_writes_every_slot_its_decode_steps_read():
    """A decode step over unwritten pool pages reads the kernel's zero page, not memory: the step
    times would be those of a cache that is not there."""
    from bench.executor_bench import BLOCK, DECODE_CASES, decode_batch, write_contexts

    written = set()

    def execute(seqs):
        for seq in seqs:
            assert seq.start_position == 0 and not seq.sample
            written.update(seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(seq.token_ids)))

    write_contexts(execute)
    for batch, ctx in DECODE_CASES:
        for seq in decode_batch(batch, ctx):
            read = {seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq.start_position)}
            assert read <= written, (batch, ctx)


def test_amx_tile_rate_probe_multiplies_and_the_bench_prints_both_rates(tiny_model_dir, cpu_ops, tmp_path, capsys):
    """``python -m bench.amx_tile_rate``: the probe's tile multiplies give every sum (so its rate is of
    real work), and the bench prints the probe's and the prompt kernel's TFLOP/s and their ratio;
    without AMX bf16 tiles it says so."""
    import shutil

    from bench.amx_tile_rate import TileProbe, build_probe, main

    if cpu_ops.has_prompt_linear():
        if shutil.which("g++") is None:
            pytest.skip("no g++ to build the probe")
        probe = TileProbe(build_probe(tmp_path / "cache"), depth=96, blocks=3)
        assert not probe.sums_correct()
        probe()
        assert probe.sums_correct()
    assert main(["--model", str(tiny_model_dir), "--rows", "33", "--rounds", "1", "--cache", str(tmp_path / "cache")]) == 0
    printed = capsys.readouterr().out
    if not cpu_ops.has_prompt_linear():
        assert "no AMX bf16 tiles" in printed
        return
    rates = [float(line.split()[-2]) for line in printed.splitlines() if line.endswith("TFLOP/s")]
    assert len(rates) == 2 and all(rate > 0 for rate in rates), printed
    assert "kernel / probe:" in printed
