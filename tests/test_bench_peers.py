"""bench/peers: argument parsing, CPU-flag logic, metrics parsing, row formatting, the OpenVINO
runner's loop on a fake pipeline. Fast: nothing is built, installed or downloaded."""
from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import types

import pytest

from bench import report
from bench.client import RequestResult
from bench.peers import KNOWN_PEERS, parse_list, parse_peers
from bench.peers import common, llama_server, openvino_peer, openvino_runner

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
flags\t\t: fpu sse2
"""


def test_parse_peers():
    assert parse_peers("llama-server,openvino") == ["llama-server", "openvino"]
    assert parse_peers(" openvino , llama-server,openvino ") == ["openvino", "llama-server"]
    assert parse_peers("none") == [] and parse_peers("") == []
    assert set(parse_peers(",".join(KNOWN_PEERS))) == set(KNOWN_PEERS)
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        parse_peers("llama-server,vllm")
    assert parse_list("Q4_1,bf16", ("bf16", "q4_1"), "w") == ["q4_1", "bf16"]


def test_cli_rejects_an_unknown_peer(capsys):
    from bench.__main__ import build_parser, main

    with pytest.raises(SystemExit):
        main(["--sweep", "seed-table", "--peers", "vllm"])
    assert "unknown peer" in capsys.readouterr().err
    args = build_parser().parse_args(["--sweep", "seed-table", "--peers", "llama-server,openvino", "--concurrency",
                                      "1", "--openvino-weights", "int8", "--peer-threads", "2"])
    assert (args.peers, args.concurrency, args.openvino_weights, args.peer_threads) == \
        ("llama-server,openvino", 1, "int8", [2])


def test_cpu_flags_and_amx_workaround():
    flags = common.cpu_flags(CPUINFO)
    assert {"amx_tile", "avx512_bf16"} <= flags and "fpu" in flags
    assert common.amx_workaround_flags(flags) == ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    assert common.amx_workaround_flags({"avx512f", "avx512_bf16"}) == []
    assert common.cpu_flags("processor : 0\n") == set()
    # the cache key follows the feature set, not its order
    assert common.cpu_flags_hash({"a", "b"}) == common.cpu_flags_hash({"b", "a"}) != common.cpu_flags_hash({"a"})


def test_cmake_command_is_native_and_drops_amx_only_where_present(tmp_path):
    amx = llama_server.cmake_configure_command(tmp_path / "src", tmp_path / "b", {"amx_tile", "avx512f"}, "Ninja")
    plain = llama_server.cmake_configure_command(tmp_path / "src", tmp_path / "b", {"avx512f"})
    for cmd in (amx, plain):
        assert "-DGGML_NATIVE=ON" in cmd and "-DCMAKE_BUILD_TYPE=Release" in cmd
        assert "-DLLAMA_USE_PREBUILT_UI=OFF" in cmd  # nothing fetched at build time
    assert "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in amx and amx[1:3] == ["-G", "Ninja"]
    assert not any("amx" in part for part in plain)
    assert llama_server.install_root({"x"}).name == f"{llama_server.SDIST_VERSION}-{common.cpu_flags_hash({'x'})}"


def test_unpack_vendor_keeps_only_llama_cpp(tmp_path):
    sdist = tmp_path / "llama_cpp_python-0.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("llama_cpp_python-0.0.0/vendor/llama.cpp/CMakeLists.txt",
                     "llama_cpp_python-0.0.0/vendor/llama.cpp/gguf-py/gguf/__init__.py",
                     "llama_cpp_python-0.0.0/llama_cpp/__init__.py"):
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    dest = tmp_path / "src"
    llama_server._unpack_vendor(sdist, dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == \
        ["CMakeLists.txt", "gguf-py/gguf/__init__.py"]


def test_nothing_is_built_under_pytest(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert not common.setup_allowed()
    with pytest.raises(common.PeerUnavailable, match="set-up is off"):
        llama_server.setup(log=lambda *_: None)
    rows, reasons, _ = llama_server.run_peer([], model_dir=tmp_path, variants=["bf16", "q4_1"], concurrency=2,
                                             threads=1, kv_tokens=64, kv_note="", log_dir=tmp_path, log=lambda *_: None)
    assert rows == [] and len(reasons) == 1 and reasons[0].startswith("llama-server skipped")
    rows, reasons, _ = openvino_peer.run_peer([], model_dir=tmp_path, variants=["fp16"], concurrency=2, threads=1,
                                              kv_tokens=64, kv_note="", max_num_batched_tokens=64, log_dir=tmp_path,
                                              log=lambda *_: None)
    assert rows == [] and reasons[0].startswith("OpenVINO GenAI skipped")
    assert not (tmp_path / "peers" / "openvino-venv").exists()


def test_run_logged_turns_failures_into_reasons(tmp_path):
    log = tmp_path / "x.log"
    with pytest.raises(common.PeerUnavailable, match="exited with 3"):
        common.run_logged([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log)
    assert "boom" in log.read_text()
    with pytest.raises(common.PeerUnavailable, match="not found"):
        common.run_logged(["/nonexistent/cmake"], log)
    # a signal says which: OpenVINO's CPU plugin dies with SIGFPE on some CPUs
    with pytest.raises(common.PeerUnavailable, match=r"exited with -8 \(SIGFPE\)"):
        common.run_logged([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGFPE)"], log)


def test_prometheus_parser_reads_llamacpp_metrics():
    text = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1234
llamacpp:prompt_tokens_cached_total 4096
llamacpp:n_busy_slots_per_decode 7.5
llamacpp:requests_processing 0
vllm:num_requests_running 3
llamacpp:broken notanumber
"""
    values = llama_server.parse_prometheus(text)
    assert values == {"prompt_tokens_total": 1234.0, "prompt_tokens_cached_total": 4096.0,
                      "n_busy_slots_per_decode": 7.5, "requests_processing": 0.0}


def test_gguf_precision_and_server_command(tmp_path):
    assert llama_server.gguf_precision(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert llama_server.gguf_precision(tmp_path / "SmolLM2-135M-Instruct-0.3.36-bf16.gguf") == "BF16"
    cmd = llama_server.server_command(tmp_path / "llama-server", tmp_path / "m.gguf", port=1, threads=3, parallel=16,
                                      ctx=9408, alias="m")
    joined = " ".join(cmd)
    for part in ("-t 3", "-tb 3", "-np 16", "-c 9408", "--kv-unified", "--cont-batching", "--metrics"):
        assert part in joined


def test_lscpu_summary_and_file(tmp_path):
    text = "Architecture:  x86_64\nCPU(s):  2\nModel name:  AMD EPYC 9R14\nFlags:  fpu\n"
    assert common.lscpu_summary(text) == {"Architecture": "x86_64", "CPU(s)": "2", "Model name": "AMD EPYC 9R14"}
    summary = common.write_lscpu(tmp_path)
    assert (tmp_path / "lscpu.txt").read_text().strip() and isinstance(summary, dict)


def test_system_table_says_how_each_row_ran():
    results = [RequestResult(10, 4, sent_at=0.0, ttft=0.1, e2e=0.4, itl=[0.1, 0.1, 0.1], output_tokens=4, ok=True)]
    row = report.row_from_results("OpenVINO GenAI CB INT8", results, 1.0)
    row.weights, row.threads, row.kv_budget, row.transport = "INT8 (weights only) IR", 1, "9408 tokens", "in-process"
    lines = report.system_lines([row])
    assert lines[0].startswith("| system | weights | threads | KV budget | transport")
    assert ("| OpenVINO GenAI CB INT8 | INT8 (weights only) IR | 1 | 9408 tokens | in-process | 1/0 | 4.0 | "
            "100 ms | 100 ms | 100 ms | 100 ms | 400 ms |") == lines[2]
    bare = report.system_lines([report.Row(name="x")])[2]
    assert bare.startswith("| x | n/a | n/a | n/a | n/a | 0/0 | 0.0 |")


class _FakeHandle:
    def __init__(self, pipe, output_len):
        self.pipe, self.left, self.pending = pipe, output_len, 0

    def can_read(self):
        return self.pending > 0

    def read(self):
        out, self.pending = self.pending, 0
        return {0: types.SimpleNamespace(generated_ids=[7] * out)}

    def get_status(self):
        return self.pipe.genai.GenerationStatus.RUNNING if self.left or self.pending else \
            self.pipe.genai.GenerationStatus.FINISHED


def _fake_genai():
    genai = types.ModuleType("openvino_genai")
    genai.SchedulerConfig = lambda: types.SimpleNamespace(num_kv_blocks=0)
    genai.GenerationConfig = lambda: types.SimpleNamespace(apply_chat_template=True)
    genai.GenerationStatus = types.SimpleNamespace(RUNNING="RUNNING", FINISHED="FINISHED")
    genai.peak_in_flight = 0

    class Pipeline:
        def __init__(self, model_dir, scheduler, device, properties):
            genai.scheduler, genai.properties = scheduler, properties
            self.genai, self.handles = genai, []

        def add_request(self, request_id, prompt, config):
            assert config.ignore_eos and config.min_new_tokens == config.max_new_tokens
            assert config.apply_chat_template is False
            handle = _FakeHandle(self, config.max_new_tokens)
            self.handles.append(handle)
            return handle

        def step(self):
            live = [h for h in self.handles if h.left]
            genai.peak_in_flight = max(genai.peak_in_flight, len(live))
            for h in live:  # one token per running request per step
                h.left -= 1
                h.pending += 1

        def get_metrics(self):
            return types.SimpleNamespace(cache_usage=50.0)

    genai.ContinuousBatchingPipeline = Pipeline
    return genai


def test_openvino_runner_closed_loop_on_a_fake_pipeline(tmp_path, monkeypatch):
    genai = _fake_genai()
    monkeypatch.setitem(sys.modules, "openvino_genai", genai)
    monkeypatch.setitem(sys.modules, "openvino", None)  # facts are optional
    job = {"model_dir": "x", "concurrency": 2, "threads": 3, "num_kv_blocks": 10, "max_num_batched_tokens": 256,
           "max_num_seqs": 2, "warmup": 1,
           "requests": [{"prompt": f"p{i}", "prompt_len": 5, "output_len": n} for i, n in enumerate([3, 1, 4])]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert openvino_runner.main(["runner", str(tmp_path / "job.json"), str(tmp_path / "out.json")]) == 0
    payload = json.loads((tmp_path / "out.json").read_text())
    assert genai.scheduler.enable_prefix_caching and genai.scheduler.num_kv_blocks == 10
    assert genai.properties == {"INFERENCE_NUM_THREADS": 3}
    job["inference_precision"] = "f32"  # --openvino-precision: given to the pipeline and reported as given
    (tmp_path / "job.json").write_text(json.dumps(job))
    assert openvino_runner.main(["runner", str(tmp_path / "job.json"), str(tmp_path / "out2.json")]) == 0
    assert genai.properties == {"INFERENCE_NUM_THREADS": 3, "INFERENCE_PRECISION_HINT": "f32"}
    assert json.loads((tmp_path / "out2.json").read_text())["facts"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert genai.peak_in_flight == 2  # the closed loop keeps `concurrency` requests in flight
    results = openvino_peer.to_results(payload)
    assert [r.output_tokens for r in results] == [3, 1, 4] and all(r.ok for r in results)
    assert [len(r.itl) for r in results] == [2, 0, 3]
    assert all(r.ttft > 0 and r.e2e >= r.ttft for r in results)
    assert results[2].sent_at >= results[1].sent_at  # the third waits for a free place
    assert payload["cache"]["kv_usage_peak"] == pytest.approx(0.5)
    assert 0 <= payload["cpu_s"] <= payload["wall_s"] * os.cpu_count() + 0.05  # the measured loop's CPU seconds
    row = report.row_from_results("ov", results, payload["wall_s"])
    assert row.completed == 3 and row.output_tokens == 8


_CRASHING_RUNNER = """
import json, os, signal, sys
job = json.load(open(sys.argv[1]))
if job["model_dir"].endswith("int8"):
    os.kill(os.getpid(), signal.SIGSEGV)
if job["inference_precision"] != "f32":
    os.kill(os.getpid(), signal.SIGFPE)
results = [{"prompt_len": r["prompt_len"], "expected_output_len": r["output_len"], "sent_at": 0.0, "ttft": 0.1,
            "e2e": 0.2, "itl": [0.1], "output_tokens": r["output_len"], "ok": True, "error": None}
           for r in job["requests"]]
json.dump({"results": results, "wall_s": 1.0, "cache": {}, "facts": {"INFERENCE_PRECISION_HINT": "f32"}},
          open(sys.argv[2], "w"))
"""


def test_openvino_row_that_dies_with_sigfpe_runs_again_in_f32(tmp_path, monkeypatch):
    """OpenVINO 2026.4 dies with SIGFPE compiling an fp16 IR in bf16 on some AMX Xeons: `make bench`
    gives that row in f32, saying so, instead of no numbers; any other crash stays a failure."""
    runner = tmp_path / "runner.py"
    runner.write_text(_CRASHING_RUNNER)
    monkeypatch.setattr(openvino_peer, "RUNNER", runner)
    monkeypatch.setattr(openvino_peer, "setup_venv", lambda log: (sys.executable, None))
    monkeypatch.setattr(openvino_peer, "export", lambda python, model_dir, fmt, log: (tmp_path / fmt, None))
    requests = [types.SimpleNamespace(prompt="p", prompt_len=5, output_len=2)]
    kwargs = dict(model_dir=tmp_path, concurrency=1, threads=1, kv_tokens=64, kv_note="64 tokens",
                  max_num_batched_tokens=256, log_dir=tmp_path / "logs", log=lambda *a: None)
    rows, skipped, _ = openvino_peer.run_peer(requests, variants=["fp16", "int8"], **kwargs)
    assert len(rows) == 1 and "compute f32" in rows[0].weights
    assert any("died with SIGFPE" in note for note in rows[0].notes)
    assert len(skipped) == 1 and "int8 skipped" in skipped[0] and "SIGSEGV" in skipped[0]
    # asked for a precision, the bench runs that one only
    rows, skipped, _ = openvino_peer.run_peer(requests, variants=["fp16"], precision="bf16", **kwargs)
    assert rows == [] and "SIGFPE" in skipped[0]


def test_system_lines_name_each_rows_system():
    def row(name, system, tput, p99):
        return report.Row(name=name, system=system, completed=4, output_throughput=tput, ttft_ms={"p99": p99})

    ours = row("+ prefix caching", "kvserve", 100.0, 500.0)
    peer = row("llama.cpp llama-server Q4_1", "llama.cpp llama-server", 50.0, 900.0)
    shown = report.system_lines([ours, peer])
    assert shown[2].startswith("| kvserve: + prefix caching |") and shown[3].startswith("| llama.cpp llama-server Q4_1 |")
