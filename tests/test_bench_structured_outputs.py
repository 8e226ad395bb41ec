"""bench.structured_outputs' pieces that decide its numbers (no server), and its OpenVINO peer's
pieces on a fake pipeline; the one test of the real pipeline skips where the OpenVINO venv and
IR are not set up (nothing is installed under pytest)."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from bench.peers import openvino_peer
from bench.peers.common import PeerUnavailable
from bench.structured_outputs import (OpenVINO, executor_log_facts, keep_accepted, main, openvino_requests,
                                      openvino_rounds, openvino_system, parse_threads, plain_body, schema_body,
                                      validity)
from bench.structured_schemas import SCHEMAS


def test_both_rows_ask_for_the_same_prompt_and_the_unconstrained_one_for_a_fixed_length():
    name, prompt, schema = SCHEMAS[0]
    constrained, plain = schema_body(name, prompt, schema, 256), plain_body(prompt, 37)
    assert constrained["messages"] == plain["messages"] and constrained["temperature"] == plain["temperature"] == 0
    assert constrained["response_format"]["json_schema"]["schema"] == schema
    assert "response_format" not in plain
    assert plain["max_tokens"] == plain["min_tokens"] == 37 and plain["ignore_eos"]


def test_validity_counts_replies_that_parse_and_validate():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    replies = [{"text": '{"a": 1}'}, {"text": '{"a": "x"}'}, {"text": '{"a": 1'}, {"text": '{"a": 2}'}]
    assert validity(replies, [schema] * 4) == 0.5


def test_peers_and_openvino_threads_are_checked_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        main(["--peers", "llama-server,vllm"])
    assert "unknown peer 'vllm'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--peers", "openvino", "--openvino-threads", "1,0"])
    assert "positive integer" in capsys.readouterr().err
    assert parse_threads("1,2,1") == [1, 2] and parse_threads(" 2 ") == [2]
    with pytest.raises(ValueError):
        parse_threads("")


def test_a_schema_any_system_refuses_is_left_out_for_every_system():
    workload = [SCHEMAS[i % 3] for i in range(6)]
    names = [SCHEMAS[i][0] for i in range(3)]
    kept, refused = keep_accepted(workload, {"llama-server": {names[1]: "HTTP error"},
                                             "openvino": {names[2]: "RuntimeError: no"}})
    assert refused == sorted(names[1:]) and [item[0] for item in kept] == [names[0], names[0]]
    assert keep_accepted(workload, {}) == (workload, [])


class _Tokenizer:
    """The gateway tokenizer's interface: one id a character, a visible chat template."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != 0)  # 0: a special token, skipped as the gateway does


def test_openvino_gets_the_gateways_chat_prompt_ids_and_its_rows_are_measured_as_kvservess():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    workload = [("a", "give a", schema), ("b", "give b", schema)]
    requests = openvino_requests(_Tokenizer(), workload)
    assert requests[0]["input_ids"] == [ord(c) for c in "<user>give a<assistant>"]
    assert json.loads(requests[1]["schema"]) == schema and requests[1]["name"] == "b"

    def row(texts, wall):
        return {"wall_s": wall, "results": [{"ttft_s": 0.1 * (i + 1), "latency_s": 1.0, "finish_reason": "stop",
                                             "token_ids": [ord(c) for c in text] + [0]}
                                            for i, text in enumerate(texts)]}

    payload = {"rounds": [{"json_schema": row(['{"a": 1}', '{"a": "x"}'], 2.0),
                           "unconstrained": row(["x" * 8, "y" * 10], 1.0)}]}
    (only,) = openvino_rounds(payload, _Tokenizer(), workload)
    constrained = only["json_schema"]
    assert constrained["output_tokens"] == 9 + 11 and constrained["output_tok_s"] == 10.0  # EOS counts
    assert constrained["results"][0]["text"] == '{"a": 1}' and only["valid"] == 0.5
    assert only["unconstrained"]["output_tok_s"] == 20.0 and only["ratio"] == 0.5
    assert constrained["ttft_p50_ms"] == pytest.approx(150.0)
    assert "in-process" in openvino_system("fp16", 1) and "2 threads" in openvino_system("fp16", 2)


def test_executor_log_facts(tmp_path):
    log = tmp_path / "executor-1.log"
    log.write_text("\n".join([
        "not json",
        json.dumps({"event": "model_loaded", "dtype": "float32"}),
        json.dumps({"event": "kv_cache_allocated", "bytes": 2**30, "kv_cache_dtype": "auto"}),
        json.dumps({"event": "executor_ready", "torch_threads": 2})]))
    assert executor_log_facts(log) == {"dtype": "float32", "torch_threads": 2, "kv": "1.0 GiB, auto K/V"}
    assert executor_log_facts(tmp_path / "missing.log") == {}


class _Handle:
    def __init__(self, pipe, config, refuse: bool):
        self.pipe, self.pending, self.refuse = pipe, 0, refuse
        self.left = config.max_new_tokens
        if config.structured_output_config is not None:  # a "grammar" that completes after 3 tokens
            self.left = min(self.left, 3)
        self.finished = False

    def can_read(self):
        return self.pending > 0

    def read(self):
        out, self.pending = self.pending, 0
        return {0: types.SimpleNamespace(generated_ids=[7] * out, finish_reason="GenerationFinishReason.NONE")}

    def get_status(self):
        status = self.pipe.genai.GenerationStatus
        return status.RUNNING if self.left or self.pending else status.FINISHED


def _fake_genai(refuse: str):
    genai = types.ModuleType("openvino_genai")
    genai.SchedulerConfig = lambda: types.SimpleNamespace(num_kv_blocks=0)
    genai.GenerationConfig = lambda: types.SimpleNamespace(structured_output_config=None, min_new_tokens=0,
                                                           ignore_eos=False, apply_chat_template=True)
    genai.StructuredOutputConfig = lambda json_schema: types.SimpleNamespace(json_schema=json_schema)
    genai.GenerationStatus = types.SimpleNamespace(RUNNING="RUNNING", FINISHED="FINISHED")
    genai.pipelines, genai.peak_in_flight = 0, 0

    class Pipeline:
        def __init__(self, model_dir, scheduler, device, properties):
            genai.pipelines += 1
            genai.properties, self.genai, self.handles = properties, genai, []

        def add_request(self, request_id, input_ids, config):
            assert config.apply_chat_template is False and config.do_sample is False
            if config.structured_output_config is None:
                assert config.ignore_eos and config.min_new_tokens == config.max_new_tokens
            elif refuse in config.structured_output_config.json_schema:
                raise RuntimeError("xgrammar: unsupported keyword")
            handle = _Handle(self, config, False)
            self.handles.append(handle)
            return handle

        def step(self):
            live = [h for h in self.handles if h.left]
            genai.peak_in_flight = max(genai.peak_in_flight, len(live))
            for h in live:
                h.left -= 1
                h.pending += 1

    genai.ContinuousBatchingPipeline = Pipeline
    return genai


def test_openvino_runner_probes_and_measures_on_a_fake_pipeline(monkeypatch):
    from bench.peers import openvino_structured_runner as runner

    genai = _fake_genai(refuse="prefixItems")
    monkeypatch.setitem(sys.modules, "openvino_genai", genai)
    monkeypatch.setitem(sys.modules, "openvino", None)  # facts are optional
    monkeypatch.setattr(runner, "prompt_tensor", lambda ids: ids)
    requests = [{"name": f"s{i}", "input_ids": [1, 2, i], "schema": json.dumps({"type": "object"})}
                for i in range(5)]
    requests[3]["schema"] = json.dumps({"type": "array", "prefixItems": []})
    job = {"model_dir": "x", "threads": 2, "max_num_batched_tokens": 2048, "max_num_seqs": 8, "cache_size_gb": 1,
           "requests": requests, "concurrency": 2, "max_tokens": 16, "rounds": 2}
    probed = runner.probe({**job, "mode": "probe"})
    assert list(probed["refused"]) == ["s3"] and "unsupported keyword" in probed["refused"]["s3"]
    assert genai.properties == {"INFERENCE_NUM_THREADS": 2}
    del requests[3]
    measured = runner.measure({**job, "mode": "measure"})
    assert len(measured["rounds"]) == 2 and genai.peak_in_flight == 2
    for round_ in measured["rounds"]:
        constrained, plain = round_["json_schema"]["results"], round_["unconstrained"]["results"]
        assert [len(r["token_ids"]) for r in constrained] == [3] * 4  # the grammar ended them
        assert [len(r["token_ids"]) for r in plain] == [3] * 4  # the same lengths, unconstrained
        assert all(r["ttft_s"] is not None and r["latency_s"] >= r["ttft_s"] and not r["error"]
                   for r in constrained + plain)


_CRASHING_RUNNER = """
import json, os, signal, sys
job = json.load(open(sys.argv[1]))
if job["inference_precision"] != "f32":
    os.kill(os.getpid(), signal.SIGFPE)
json.dump({"refused": {}, "facts": {"INFERENCE_PRECISION_HINT": "f32", "threads": os.environ["OMP_NUM_THREADS"]}},
          open(sys.argv[2], "w"))
"""


def test_an_openvino_run_dying_with_sigfpe_runs_again_in_f32(tmp_path, monkeypatch):
    runner = tmp_path / "runner.py"
    runner.write_text(_CRASHING_RUNNER)
    monkeypatch.setattr(openvino_peer, "STRUCTURED_RUNNER", runner)
    job = {"mode": "probe", "threads": 1, "inference_precision": None}
    payload = openvino_peer.run_structured(Path(sys.executable), job, tmp_path, "probe", log=lambda *a: None)
    assert payload["facts"]["threads"] == "1" and "SIGFPE" in payload["facts"]["fallback"]
    with pytest.raises(PeerUnavailable, match="SIGFPE"):  # asked for a precision, the bench runs that one only
        openvino_peer.run_structured(Path(sys.executable), {**job, "inference_precision": "bf16"}, tmp_path, "probe")


def test_real_openvino_pipeline_takes_a_schema_and_constrains_its_reply(tmp_path, default_model_dir):
    """The cached OpenVINO venv and fp16 IR (``python -m bench.structured_outputs --peers openvino``
    sets them up once); skipped where they are not there."""
    args = types.SimpleNamespace(openvino_weights="fp16", openvino_precision=None, concurrency=2, max_tokens=48,
                                 rounds=1, openvino_threads=[1], out=tmp_path)
    try:
        openvino = OpenVINO(args, default_model_dir)
    except PeerUnavailable as exc:
        pytest.skip(f"OpenVINO GenAI not set up here: {exc}")
    from gateway.detokenizer import ModelTokenizer

    tokenizer = ModelTokenizer(default_model_dir)
    workload = [SCHEMAS[0], SCHEMAS[-1]]
    requests = openvino_requests(tokenizer, workload)
    assert openvino.refused(requests) == {}
    (round_,) = openvino_rounds(openvino.measure(requests, 1), tokenizer, workload)
    assert round_["valid"] > 0 and round_["unconstrained"]["output_tokens"] == round_["json_schema"]["output_tokens"]
    json.loads(round_["json_schema"]["results"][0]["text"])
