"""bench/prefill_vs_openvino.py: the turn-taking prefill comparison, with OpenVINO faked (nothing is
installed under pytest) and kvserve's side real."""
from __future__ import annotations

import json
import random
import sys

import pytest

from bench import prefill_vs_openvino as pvo
from bench.peers import openvino_peer

# Answers as the OpenVINO worker does, "taking" 1 ms a prompt token, so the test can read back
# which tokens it was sent.
_FAKE_OPENVINO_WORKER = """
import json, os, signal, sys
if sys.argv[1].endswith("fp16") and sys.argv[4] != "f32":  # as OpenVINO 2026.4 on some AMX Xeons
    os.kill(os.getpid(), signal.SIGFPE)
print(json.dumps({"ready": True, "argv": sys.argv[1:]}), flush=True)
for line in sys.stdin:
    ids = json.loads(line)
    print(json.dumps({"ms": float(len(ids)), "first_token": ids[-1]}), flush=True)
"""


def _round(kvserve, openvino, probe=(1.0, 1.0), first=True):
    return pvo.Round(kvserve, openvino, probe, first)


def test_rounds_with_a_slow_probe_are_counted_as_contended():
    rounds = [_round(100, 200), _round(300, 250, probe=(1.0, 2.5)), _round(120, 180, probe=(1.4, 1.2)),
              _round(310, 400, probe=(3.0, 2.9))]
    assert pvo.contended(rounds) == [False, True, False, True]
    summary = pvo.summarize_rounds(rounds)
    assert summary["all"]["rounds"] == 4 and summary["all"]["kvserve_faster"] == 3
    assert summary["quiet"] == {"rounds": 2, "kvserve_ms": 110, "openvino_ms": 190, "ratio": pytest.approx(110 / 190),
                                "kvserve_faster": 2}
    assert summary["contended"]["kvserve_ms"] == 305 and summary["contended"]["kvserve_faster"] == 1
    assert "contended" not in pvo.summarize_rounds(rounds[:1] + rounds[2:3])


def test_the_cached_prefix_is_a_multiple_of_the_block_size(capsys):
    with pytest.raises(SystemExit):
        pvo.main(["--cached", "100"])
    assert "--cached must be a non-negative multiple of 16" in capsys.readouterr().err


def test_a_prefill_after_the_cached_prefix_picks_what_the_whole_prompt_does(default_model_dir):
    """What the bench times is a real prefix-cache hit: the prompt's tokens after the prefix's
    blocks give the first token a prefill of prefix + prompt from scratch gives."""
    pytest.importorskip("torch")
    worker = pvo.KvserveWorker(default_model_dir, "none", "auto", max_model_len=256)
    rng = random.Random(3)
    prefix = [rng.randrange(100, 40000) for _ in range(32)]
    prompt = [rng.randrange(100, 40000) for _ in range(40)]
    worker.prefix(prefix)
    after_prefix = worker.prefill(prompt)
    assert after_prefix["ms"] > 0 and worker.prefix_len == 32
    worker.prefix_len = 0  # the same blocks, written again from position 0
    whole = worker.prefill(prefix + prompt)
    assert after_prefix["first_token"] == whole["first_token"]
    with pytest.raises(ValueError, match="whole blocks"):
        worker.prefix(prefix[:20])


def test_both_systems_take_turns_on_the_same_tokens(tmp_path, monkeypatch, tiny_model_dir, capsys):
    fake = tmp_path / "fake_openvino_worker.py"
    fake.write_text(_FAKE_OPENVINO_WORKER)
    monkeypatch.setattr(pvo, "OPENVINO_WORKER", fake)
    monkeypatch.setattr(openvino_peer, "setup_venv", lambda log: (sys.executable, None))
    monkeypatch.setattr(openvino_peer, "export", lambda python, model_dir, fmt, log: (tmp_path / f"ir-{fmt}", None))
    out = tmp_path / "prefill.json"
    code = pvo.main(["--model", str(tiny_model_dir), "--quantization", "none", "--tokens", "24", "--cached", "16",
                     "--rounds", "3", "--warmup", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    # OpenVINO got the FP16 IR (after dying with SIGFPE in its default precision, in f32, and the
    # report says so) and, every round, the prefix and the prompt (16 + 24 tokens).
    assert result["facts"]["openvino"]["argv"][0].endswith("ir-fp16")
    assert result["facts"]["openvino"]["argv"][3] == "f32" and "SIGFPE" in result["facts"]["openvino_note"]
    assert [r["openvino_ms"] for r in result["rounds"]] == [40.0, 40.0, 40.0]
    assert all(r["kvserve_ms"] > 0 and all(p > 0 for p in r["probe_ms"]) for r in result["rounds"])
    assert [r["kvserve_first"] for r in result["rounds"]] == [False, True, False]  # after one warm-up round
    assert result["summary"]["all"]["rounds"] == 3
    assert "| all | 3 |" in printed
    assert (tmp_path / "prefill-vs-openvino-logs" / "kvserve-worker.log").exists()


def test_a_peer_that_cannot_start_is_one_line_and_leaves_no_worker(tmp_path, monkeypatch, tiny_model_dir, capsys):
    fake = tmp_path / "fake_openvino_worker.py"
    fake.write_text("import sys; print('no such IR', file=sys.stderr); sys.exit(3)")
    monkeypatch.setattr(pvo, "OPENVINO_WORKER", fake)
    monkeypatch.setattr(openvino_peer, "setup_venv", lambda log: (sys.executable, None))
    monkeypatch.setattr(openvino_peer, "export", lambda python, model_dir, fmt, log: (tmp_path / fmt, None))
    closed = []
    monkeypatch.setattr(pvo.LineWorker, "close", lambda self: closed.append(self.name) or self.proc.kill())
    assert pvo.main(["--model", str(tiny_model_dir), "--quantization", "none", "--out", str(tmp_path / "x.json")]) == 1
    err = capsys.readouterr().err
    assert "cannot run: openvino worker exited with 3" in err and "no such IR" in err
    assert closed == ["kvserve"] and not (tmp_path / "x.json").exists()


def test_a_worker_that_stops_answering_is_killed_and_named(tmp_path, monkeypatch):
    """A wedged peer (say, a compile that never ends) stops the bench with its name, not forever."""
    monkeypatch.setattr(pvo, "READY_TIMEOUT_S", 0.5)
    hung = tmp_path / "hung.py"
    hung.write_text("import time\nwhile True: time.sleep(1)\n")
    worker = pvo.LineWorker("openvino", [sys.executable, str(hung)], tmp_path / "hung.log")
    with pytest.raises(pvo.WorkerExited, match="openvino worker gave no answer within 0.5 s"):
        worker.ready()
    assert worker.proc.poll() is not None
    worker.close()
