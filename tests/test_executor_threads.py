"""``--num-threads auto``: the executor times its own decode step at each candidate thread count
and keeps the fastest (executor/threads.py)."""
from __future__ import annotations

import pytest
import torch

from executor.__main__ import build_parser
from executor.runner import ModelRunner, RunnerOptions
from executor.thread_probe_cache import ProbeKey, ThreadProbeCache
from executor.threads import (
    ThreadProbe, choose_thread_count, decode_probe_step, loading_thread_count, parse_num_threads, probe_runner_threads,
    probe_thread_counts,
)
from kvserve.cpus import cgroup_cpu_limit, cpu_model_name, thread_counts_to_try, usable_cpus


def test_candidates_are_one_the_powers_of_two_and_every_cpu():
    assert thread_counts_to_try(1) == [1]
    assert thread_counts_to_try(2) == [1, 2]
    assert thread_counts_to_try(6) == [1, 2, 4, 6]
    assert thread_counts_to_try(16) == [1, 2, 4, 8, 16]


def test_auto_loads_the_model_on_half_the_cpus_leaving_room_for_what_starts_beside_it():
    assert [loading_thread_count(cpus) for cpus in (1, 2, 3, 16)] == [1, 1, 1, 8]


def test_the_fastest_count_wins_and_a_near_tie_goes_to_fewer_threads():
    assert choose_thread_count({1: 0.020, 2: 0.012}) == 2  # the AMX Xeon's kind of gap
    assert choose_thread_count({1: 0.020, 2: 0.0195}) == 1  # within 5 %: the core stays free
    assert choose_thread_count({1: 0.020, 2: 0.025, 4: 0.030}) == 1
    assert choose_thread_count({1: 0.040, 2: 0.021, 4: 0.020}) == 2


def test_the_probe_times_every_count_in_turn_and_leaves_the_choice_set():
    cost = {1: 3.0, 2: 1.0, 4: 1.5}  # a fake step's seconds per thread count, on a fake clock
    now, current, calls = [0.0], [1], []

    def set_threads(count: int) -> None:
        current[0] = count

    def step() -> None:
        calls.append(current[0])
        now[0] += cost[current[0]]

    probe = probe_thread_counts(step, [1, 2, 4], rounds=3, budget_s=100.0, set_threads=set_threads,
                                clock=lambda: now[0])
    assert probe.chosen == 2 and current[0] == 2
    assert probe.seconds == {1: 3.0, 2: 1.0, 4: 1.5}
    # One untimed warm-up, then rounds in turn: every count, then only those within twice the
    # fastest's time (1 thread, 3x slower, is not tried again).
    assert calls == [1] + [1, 2, 4] + [2, 4] + [2, 4]
    assert probe.summary() == {"1": 3000.0, "2": 1000.0, "4": 1500.0}


def test_no_probe_round_starts_after_the_budget():
    calls = []
    probe = probe_thread_counts(lambda: calls.append(1), [1, 2], rounds=5, budget_s=0.0,
                                set_threads=lambda count: None, clock=lambda: float(len(calls)))
    assert len(calls) == 3  # a warm-up, then the first round only: one timed run of each count
    assert probe.chosen in (1, 2)


def test_a_cgroup_quota_caps_the_usable_cpus(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")
    assert cgroup_cpu_limit(cpu_max) == 2
    assert usable_cpus(cpu_max) <= 2
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpu_limit(cpu_max) is None
    assert cgroup_cpu_limit(tmp_path / "absent") is None
    cpu_max.write_text("garbage\n")
    assert cgroup_cpu_limit(cpu_max) is None


@pytest.mark.parametrize("text, expected", [("auto", None), ("AUTO", None), ("2", 2), ("1", 1)])
def test_num_threads_flag(text, expected):
    assert parse_num_threads(text) == expected
    assert build_parser().parse_args(["--num-threads", text]).num_threads == expected


def test_num_threads_defaults_to_auto():
    assert build_parser().parse_args([]).num_threads is None


@pytest.mark.parametrize("text", ["0", "-2", "two", ""])
def test_a_bad_num_threads_is_a_usage_error_naming_the_choices(text, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--num-threads", text])
    assert exc.value.code == 2
    assert "auto" in capsys.readouterr().err


@pytest.mark.parametrize("num_blocks", [64, 3])
def test_the_probe_runs_real_decode_steps_and_keeps_a_candidate(tiny_model_dir, num_blocks):
    runner = ModelRunner(RunnerOptions(tiny_model_dir, dtype="float32", num_blocks=num_blocks))
    before = torch.get_num_threads()
    try:
        probe = probe_runner_threads(runner, cpus=2)
        assert probe is not None and probe.chosen in (1, 2)
        assert set(probe.seconds) == {1, 2} and all(s > 0 for s in probe.seconds.values())
        assert torch.get_num_threads() == probe.chosen
    finally:
        torch.set_num_threads(before)


def test_the_probe_step_never_writes_the_null_block(tiny_model_dir):
    runner = ModelRunner(RunnerOptions(tiny_model_dir, dtype="float32", num_blocks=40))
    parts = [part for key_value in runner.kv_caches for part in key_value]  # [num_blocks, ...] each
    for part in parts:
        part.zero_()
    decode_probe_step(runner)()
    assert any(bool(part[1:].abs().sum()) for part in parts)
    assert not any(bool(part[0].abs().sum()) for part in parts)


def test_an_executor_started_with_auto_probes_once_and_a_restart_reuses_the_choice(start_service, tiny_model_dir,
                                                                                    tmp_path):
    import json

    cache = tmp_path / "probes" / "thread-probes.json"
    args = ("--model", str(tiny_model_dir), "--dtype", "float32", "--num-blocks", "64", "--num-threads", "auto",
            "--thread-probe-cache", str(cache), "--step-socket", "off")

    def events_of(executor) -> dict[str, dict]:
        return {e["event"]: e for e in map(json.loads, filter(lambda line: line.startswith("{"),
                                                                executor.logs().splitlines()))}

    first = start_service("executor", *args)
    events = events_of(first)
    probed, ready = events["threads_probed"], events["executor_ready"]
    assert set(probed["decode_step_ms_by_threads"]) <= {str(n) for n in range(1, 65)}
    assert ready["torch_threads"] == probed["chosen"]
    assert str(probed["chosen"]) in probed["decode_step_ms_by_threads"]
    first.stop()

    events = events_of(start_service("executor", *args))
    assert "threads_probed" not in events
    assert events["threads_from_probe_cache"]["chosen"] == probed["chosen"]
    assert events["executor_ready"]["torch_threads"] == probed["chosen"]


def key(**changes) -> ProbeKey:
    fields = dict(cpu="Some CPU (family 6 model 143 stepping 8)", cpus=2, torch="2.13.0", model_fingerprint="abc",
                  precision="bfloat16", attention_backend="cpu")
    return ProbeKey(**{**fields, **changes})


def counting_probe(chosen: int, calls: list):
    def probe() -> ThreadProbe:
        calls.append(chosen)
        return ThreadProbe({1: 0.02, 2: 0.01}, chosen)
    return probe


def test_the_cache_probes_once_per_key_and_keeps_each_answer(tmp_path):
    cache, calls = ThreadProbeCache(tmp_path / "thread-probes.json"), []
    assert cache.chosen_or_probe(key(), counting_probe(2, calls)) == (2, True)
    assert cache.chosen_or_probe(key(), counting_probe(1, calls)) == (2, False)
    assert ThreadProbeCache(tmp_path / "thread-probes.json").chosen_or_probe(key(), counting_probe(1, calls)) == (2, False)
    for other in (key(cpus=4), key(cpu="AMD EPYC (family 25 model 1 stepping 1)"), key(precision="bfloat16+int8"),
                  key(model_fingerprint="def"), key(torch="2.14.0")):
        assert cache.chosen_or_probe(other, counting_probe(1, calls)) == (1, True)
    assert calls == [2, 1, 1, 1, 1, 1]
    assert cache.chosen_or_probe(key(), counting_probe(1, calls)) == (2, False)


@pytest.mark.parametrize("content", ["{not json", '{"version": 99, "entries": {}}', '["a list"]',
                                     '{"version": 1, "entries": {"%s": {"chosen": "two"}}}'])
def test_an_unreadable_or_foreign_cache_file_is_probed_over_and_rewritten(tmp_path, content):
    path = tmp_path / "thread-probes.json"
    path.write_text(content.replace("%s", key().text().replace('"', '\\"')))
    calls = []
    assert ThreadProbeCache(path).chosen_or_probe(key(), counting_probe(2, calls)) == (2, True)
    assert ThreadProbeCache(path).chosen_or_probe(key(), counting_probe(1, calls)) == (2, False)
    assert calls == [2]


def test_a_cache_that_cannot_be_written_only_costs_the_saving(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache, calls = ThreadProbeCache(blocker / "thread-probes.json"), []
    assert cache.chosen_or_probe(key(), counting_probe(2, calls)) == (2, True)
    assert cache.chosen_or_probe(key(), counting_probe(2, calls)) == (2, True)
    assert calls == [2, 2]


def test_replicas_sharing_the_file_probe_one_at_a_time_and_the_others_take_its_answer(tmp_path):
    import threading
    import time

    path, calls, running, overlaps = tmp_path / "thread-probes.json", [], [0], []

    def slow_probe() -> ThreadProbe:
        running[0] += 1
        overlaps.append(running[0])
        time.sleep(0.2)
        calls.append(1)
        running[0] -= 1
        return ThreadProbe({1: 0.02, 2: 0.01}, 2)

    answers = []
    threads = [threading.Thread(target=lambda: answers.append(ThreadProbeCache(path).chosen_or_probe(key(), slow_probe)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and overlaps == [1]
    assert sorted(answers) == [(2, False)] * 3 + [(2, True)]


def test_the_cpu_name_says_its_family_and_model(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"
                       "model name\t: AMD EPYC\nstepping\t: 2\n\nprocessor\t: 1\nmodel name\t: other\n")
    assert cpu_model_name(cpuinfo) == "AMD EPYC (family 23 model 1 stepping 2)"
    assert cpu_model_name(tmp_path / "missing")  # the platform's string, never empty


def test_a_file_system_without_locks_costs_only_the_lock(tmp_path, monkeypatch):
    import fcntl

    def no_locks(*_):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    calls = []
    assert ThreadProbeCache(tmp_path / "thread-probes.json").chosen_or_probe(key(), counting_probe(2, calls)) == (2, True)
    assert ThreadProbeCache(tmp_path / "thread-probes.json").chosen_or_probe(key(), counting_probe(1, calls)) == (2, False)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_probe_command_answers_for_quantized_weights(tiny_model_dir, quantization):
    # What the benchmarks record beside their rows. Its one-thread steps of 16 rows take the AMX
    # tiles where the CPU has them; a bad tile configuration there once killed it with SIGSEGV.
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "executor.threads", "--model", str(tiny_model_dir),
                           "--quantization", quantization], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["chosen"] in thread_counts_to_try(usable_cpus())
    assert set(answer["decode_step_ms_by_threads"]) == {str(n) for n in thread_counts_to_try(usable_cpus())}
