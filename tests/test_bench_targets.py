"""The bench's targets section and ``--rounds``: which rows are compared, per round, and the verdicts."""
from __future__ import annotations

import pytest

from bench import report, targets
from bench.report import Row
from bench.workload import BenchRequest

OPENVINO = "OpenVINO GenAI ContinuousBatchingPipeline"
LLAMA_SERVER = "llama.cpp llama-server"


def row(name, system, bits, tput, *, p99=1000.0, itl=50.0, tpot=None, round_index=0, **fields) -> Row:
    return Row(name=name, system=system, weight_bits=bits, completed=8, output_throughput=tput,
               ttft_ms={"p99": p99}, itl_ms={"mean": itl}, tpot_ms={"mean": tpot} if tpot else {},
               round_index=round_index, **fields)


def lines_of(rows, concurrency=32):
    return targets.target_lines(rows, concurrency)[1:]


def test_best_against_best_per_precision():
    """kvserve's fastest row of a precision against each peer family's fastest row of it: slower
    rows of either side (other thread counts, other configurations) are not the ones compared."""
    rows = [row("prefix · 2 threads", "kvserve", 16, 220.0, p99=3800.0, threads=2),
            row("prefix · 1 thread", "kvserve", 16, 140.0, p99=2000.0, threads=1),
            row("prefix, int8 weights", "kvserve", 8, 300.0),
            row("paged", "kvserve", 16, 150.0),
            row("OpenVINO GenAI CB FP16 · 1 thread", OPENVINO, 16, 100.0, p99=9000.0, threads=1),
            row("OpenVINO GenAI CB FP16 · 2 threads", OPENVINO, 16, 120.0, p99=15000.0, threads=2),
            row("OpenVINO GenAI CB INT8", OPENVINO, 8, 210.0, p99=900.0),
            row("OpenVINO GenAI CB INT4", OPENVINO, 4, 190.0),  # no 4-bit kvserve row: no check
            row("llama.cpp llama-server BF16", LLAMA_SERVER, 16, 40.0, p99=100.0)]
    assert lines_of(rows) == [
        "- 16-bit: output throughput >= 1.5x OpenVINO GenAI's best: 1.83x: met",
        "- 16-bit: TTFT P99 <= 0.8x OpenVINO GenAI's best row's: 3800 ms vs 15000 ms: met",
        # llama-server: 5x, and its TTFT is not a target
        "- 16-bit: output throughput >= 5x llama.cpp llama-server's best: 5.50x: met",
        "- 8-bit: output throughput >= 1.5x OpenVINO GenAI's best: 1.43x: missed",
        "- 8-bit: TTFT P99 <= 0.8x OpenVINO GenAI's best row's: 1000 ms vs 900 ms: missed",
    ]


def test_the_best_against_best_table_shows_each_systems_fastest_row_and_the_auto_choice():
    rows = [row("prefix · 1 thread", "kvserve", 16, 140.0, threads=1, weights="bf16"),
            row("prefix · 2 threads", "kvserve", 16, 220.0, threads=2, weights="bf16"),
            row("OpenVINO GenAI CB FP16 · 2 threads", OPENVINO, 16, 120.0, threads=2),
            row("OpenVINO GenAI CB FP16 · 1 thread", OPENVINO, 16, 130.0, threads=1),
            row("OpenVINO GenAI CB INT8 · 1 thread", OPENVINO, 8, 90.0, threads=1),
            row("transformers", "transformers", 16, 10.0, threads=2)]
    meta = {"executor_auto_threads": {"none": {"chosen": 2, "decode_step_ms_by_threads": {"1": 40.0, "2": 25.0}},
                                      "int8": {"error": "TimeoutExpired: 600 s"}},
            "lscpu": {"Model name": "AMD EPYC", "CPU(s)": "2", "Hypervisor vendor": "KVM"}}
    lines = targets.best_against_best_lines(rows, meta)
    assert lines[1] == "machine: AMD EPYC, 2 CPUs, KVM guest (lscpu.txt beside results.json)"
    table = [line for line in lines if line.startswith("| ") and "precision" not in line]
    assert [line.split(" | ")[:4] for line in table] == [
        ["| 16-bit", "kvserve", "prefix · 2 threads", "2"],
        ["| 16-bit", "OpenVINO GenAI", "OpenVINO GenAI CB FP16 · 1 thread", "1"],
        ["| 16-bit", "transformers", "transformers", "2"],
        ["| 8-bit", "OpenVINO GenAI", "OpenVINO GenAI CB INT8 · 1 thread", "1"],
    ]
    assert "- kvserve's --num-threads auto picks 2 here (unquantized weights; probe step by threads: 1: 40.0 ms, " \
           "2: 25.0 ms)" in lines
    assert any("int8 weights) failed: TimeoutExpired" in line for line in lines)
    assert targets.best_against_best_lines([row("x", "", None, 1.0)], {}) == []


def test_ratios_are_taken_within_each_round():
    """Round 1 is a slow hour for kvserve, round 2 a slow one for the peer: each ratio pairs rows of
    the same round, and a target that holds in one round of two says so."""
    rows = [row("prefix, int4 weights", "kvserve", 4, 290.0, round_index=0),
            row("OpenVINO GenAI CB INT4", OPENVINO, 4, 150.0, round_index=0),
            row("OpenVINO GenAI CB INT4", OPENVINO, 4, 200.0, round_index=1),
            row("prefix, int4 weights", "kvserve", 4, 260.0, round_index=1)]
    assert lines_of(rows)[0] == "- 4-bit: output throughput >= 1.5x OpenVINO GenAI's best: 1.93x / 1.30x: " \
                                "met in 1 of 2 rounds"
    assert targets.target_lines(rows, 32)[0].endswith("2 rounds, each value within one round):")


def test_single_stream_time_per_token_against_the_fastest_peer_of_the_precision():
    """Per output token (TPOT), not per chunk: kvserve's 8-bit chunks carry two tokens (accepted
    drafts), a 16 ms gap for two 8 ms tokens. Rows without TPOT (older results) use the ITL mean."""
    rows = [row("prefix", "kvserve", 16, 30.0, itl=33.0), row("prefix, int4 weights", "kvserve", 4, 57.0, itl=10.0),
            row("prefix, int8 weights", "kvserve", 8, 60.0, itl=16.0, tpot=8.0),
            row("OpenVINO GenAI CB FP16", OPENVINO, 16, 25.0, itl=36.0),
            row("OpenVINO GenAI CB INT8", OPENVINO, 8, 45.0, itl=12.0, tpot=12.5),
            row("llama.cpp llama-server BF16", LLAMA_SERVER, 16, 24.0, itl=32.0),
            row("llama.cpp llama-server Q4_1", LLAMA_SERVER, 4, 70.0, itl=13.0)]
    itl = [line for line in lines_of(rows, concurrency=1) if "TPOT" in line]
    assert itl == ["- 16-bit: single-stream time per output token (TPOT) <= 0.8x the best peer's: 33 ms vs 32 ms "
                   "(llama.cpp llama-server BF16): missed",
                   "- 8-bit: single-stream time per output token (TPOT) <= 0.8x the best peer's: 8 ms vs 12 ms "
                   "(OpenVINO GenAI CB INT8): met",
                   "- 4-bit: single-stream time per output token (TPOT) <= 0.8x the best peer's: 10 ms vs 13 ms "
                   "(llama.cpp llama-server Q4_1): met"]
    assert not [line for line in lines_of(rows, concurrency=32) if "TPOT" in line]  # only a single stream's
    # ... and one stream's throughput is its ITL's inverse: the throughput targets are for a loaded server
    assert not [line for line in lines_of(rows, concurrency=1) if "throughput" in line]
    assert [line for line in lines_of(rows, concurrency=32) if "throughput" in line]


def test_failed_rows_and_rows_without_a_precision_are_left_out():
    ours = row("prefix", "kvserve", 16, 200.0)
    broken = row("OpenVINO GenAI CB FP16", OPENVINO, 16, 0.0)
    broken.completed = 0
    unknown = row("transformers", "transformers", 16, 10.0)  # not a peer with a target
    old = row("OpenVINO GenAI CB INT8", OPENVINO, None, 100.0)  # a results.json from before weight_bits
    assert lines_of([ours, broken, unknown, old]) == []
    failed_ours = row("prefix", "kvserve", 16, 200.0, failed=3)
    assert lines_of([failed_ours, row("OpenVINO GenAI CB FP16", OPENVINO, 16, 100.0)]) == []


def test_split_and_memory_targets_per_kvserve_row():
    phases = {"step": 62.0, "scheduler": 0.7, "kvmanager_rpc": 0.6, "executor_rpc": 60.5, "executor_total": 58.4,
              "executor_forward": 50.0}
    paged = row("prefix", "kvserve", 16, 200.0, profile={"step_time_by_phase_s": phases},
                kv_utilization=0.967, internal_fragmentation=0.033)
    reserve = row("baseline", "kvserve", 16, 50.0, kv_utilization=0.4)  # no fragmentation figure: not paged
    assert targets.split_fraction(paged) == pytest.approx((0.7 + 0.6 + 2.1) / 62.0)
    assert targets.split_fraction(reserve) is None
    assert lines_of([paged, reserve]) == [
        "- prefix: split (scheduler + both RPCs) <= 5% of a step: 5.48%: missed",
        "- prefix: KV utilization > 96%, internal fragmentation < 4%: 96.7%, 3.3%: met",
    ]


def test_tables_show_each_rows_median_round_and_list_every_round():
    rows = [row("prefix", "kvserve", 16, tput, round_index=i) for i, tput in enumerate((210.0, 250.0, 190.0))]
    rows += [row("OpenVINO GenAI CB FP16", OPENVINO, 16, tput, round_index=i) for i, tput in enumerate((120.0, 110.0))]
    shown = targets.representative_rows(rows)
    assert [(r.name, r.output_throughput) for r in shown] == [("prefix", 210.0), ("OpenVINO GenAI CB FP16", 110.0)]
    assert targets.round_lines(rows) == [
        "output tok/s in each of 3 rounds (the tables above show each row's median round):",
        "- prefix: 210.0 / 250.0 / 190.0 (median 210.0)",
        "- OpenVINO GenAI CB FP16: 120.0 / 110.0 (median 115.0)",
    ]
    assert targets.round_lines(rows[:1]) == []


def test_rounds_alternate_who_goes_first_and_the_report_keeps_every_round(tmp_path, monkeypatch, capsys):
    import bench.__main__ as cli

    order = []

    def kvserve_rows(args, requests, meta, budget, configs):
        order.append("kvserve")
        return [row("+ prefix caching (shared system prompt)", "kvserve", 16, 200.0 + len(order))]

    def other_rows(args, requests, meta, budget):
        order.append("peers")
        return [row("OpenVINO GenAI CB FP16", OPENVINO, 16, 100.0)]

    monkeypatch.setattr(cli, "run_kvserve_rows", kvserve_rows)
    monkeypatch.setattr(cli, "run_other_rows", other_rows)
    args = cli.build_parser().parse_args(["--sweep", "seed-table", "--configs", "prefix", "--peers", "openvino",
                                          "--rounds", "3", "--concurrency", "32", "--dtype", "bfloat16", "--out",
                                          str(tmp_path)])
    args.model_dir = tmp_path
    meta = {"concurrency": 32}
    monkeypatch.setattr("bench.sweep.probe_auto_threads", lambda *a: {"chosen": 1})
    rows, references = cli.run_sweep(args, [BenchRequest("p", 100, 50)], meta)
    assert order == ["kvserve", "peers", "peers", "kvserve", "kvserve", "peers"]
    assert [r.round_index for r in rows] == [0, 0, 1, 1, 2, 2] and references == [] and meta["rounds"] == 3
    cli.emit(rows, meta, tmp_path, references)
    printed = capsys.readouterr().out
    assert "- 16-bit: output throughput >= 1.5x OpenVINO GenAI's best: 2.01x / 2.04x / 2.05x: met" in printed
    saved, _ = report.load_json(tmp_path / "results.json")
    assert len(saved) == 6 and {r.round_index for r in saved} == {0, 1, 2}


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "seed-table", "--rounds", "0"], "must be at least 1"),
    (["--base-url", "http://127.0.0.1:9", "--rounds", "2"], "--rounds runs the sweep's rows again"),
])
def test_rounds_option_refuses_what_it_cannot_do(argv, message, capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
