"""Peer: OpenVINO GenAI's ``ContinuousBatchingPipeline`` (paged KV cache, prefix caching), in-process.

Set-up (once, cached under ``~/.cache/kvserve/peers/``): a venv of its own (``openvino-venv``:
``openvino-genai``, ``optimum-intel[openvino]``, ``nncf``, with the CPU ``torch`` pinned first so
nothing pulls a CUDA build), then ``optimum-cli export openvino`` of the HF-format directory kvserve
serves, once with fp16 weights and once with int8 weights (nncf weight compression).

Running: ``openvino_runner.py`` is executed by that venv's python with the requests as JSON; it
drives the pipeline with ``concurrency`` requests in flight and returns per-request TTFT and
token-gap timestamps read from each request's ``GenerationHandle`` after every ``step()``. No
HTTP: its rows say "in-process", which spares it the HTTP and tokenization round trips the
other systems pay.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from bench.peers.common import (PeerCrashed, PeerUnavailable, ensure_venv, label, nice_prefix, peers_dir,
                                run_logged, setup_allowed)

VENV_FIRST = ["torch==2.13.0"]
VENV_PACKAGES = ["openvino-genai", "optimum-intel[openvino]", "nncf"]
# optimum-intel requires torchvision, but PyPI's torchvision fails to load beside the CPU torch
# ("operator torchvision::nms does not exist") and then breaks ``import transformers`` models;
# exporting a text model never needs it.
VENV_REMOVE = ["torchvision"]
RUNNER = Path(__file__).with_name("openvino_runner.py")
STRUCTURED_RUNNER = Path(__file__).with_name("openvino_structured_runner.py")
# int4 in groups of 32 inputs with a scale and a zero point, as kvserve's int4 and llama.cpp's Q4_1
# (nncf's default group of 128 does not divide this model's 576 inputs, and its export fails);
# every projection in int4 (ratio 1.0), the embedding and head in nncf's int8 backup precision.
EXPORT_ARGS = {"int4": ["--group-size", "32", "--ratio", "1.0"]}
WEIGHT_FORMATS = {"fp16": "FP16", "int8": "INT8 (weights only)", "fp32": "FP32", "int4": "INT4 (weights only)"}
WEIGHT_BITS = {"fp16": 16, "int8": 8, "fp32": 32, "int4": 4}


def venv_path() -> Path:
    return peers_dir() / "openvino-venv"


def setup_venv(log=print) -> tuple[Path, float | None]:
    """(the venv's python, install seconds or None when it was there)."""
    python = venv_path() / "bin" / "python"
    stamp = venv_path() / ".kvserve-peer-installed"
    cached = python.exists() and stamp.exists()
    started = time.perf_counter()
    python = ensure_venv(venv_path(), VENV_PACKAGES, peers_dir() / "openvino-venv-install.log", first=VENV_FIRST,
                         remove=VENV_REMOVE, log=log)
    return python, None if cached else time.perf_counter() - started


def exported_dir(model_dir: Path, weight_format: str) -> Path:
    return peers_dir() / "openvino-models" / f"{Path(model_dir).name}-{weight_format}"


def export(python: Path, model_dir: Path, weight_format: str, log=print) -> tuple[Path, float | None]:
    """(the OpenVINO IR folder of ``model_dir`` with ``weight_format`` weights, seconds or None when cached)."""
    out = exported_dir(model_dir, weight_format)
    done = out / ".kvserve-exported"
    if done.exists():
        return out, None
    if not setup_allowed():
        raise PeerUnavailable(f"{out} is not exported yet and peer set-up is off here")
    log_path = peers_dir() / "openvino-models" / f"export-{weight_format}.log"
    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    cli = python.parent / "optimum-cli"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run_logged([*nice_prefix(), str(cli), "export", "openvino", "--model", str(model_dir),
                "--task", "text-generation-with-past", "--weight-format", weight_format,
                *EXPORT_ARGS.get(weight_format, []), str(out)],
               log_path, env=env, timeout=3600)
    if not (out / "openvino_model.xml").exists():
        raise PeerUnavailable(f"optimum-cli export made no openvino_model.xml in {out} (log: {log_path})")
    if not (out / "openvino_tokenizer.xml").exists():
        raise PeerUnavailable(f"optimum-cli export made no openvino_tokenizer.xml in {out} "
                              f"(openvino-tokenizers missing? log: {log_path})")
    done.write_text("ok\n")
    elapsed = time.perf_counter() - started
    log(f"   exported {weight_format} OpenVINO IR to {out} in {elapsed:.0f} s")
    return out, elapsed


def to_results(payload: dict):
    """The runner's per-request dicts as bench.client.RequestResult."""
    from bench.client import RequestResult

    results = []
    for item in payload["results"]:
        result = RequestResult(item["prompt_len"], item["expected_output_len"])
        for key in ("sent_at", "ttft", "e2e", "itl", "output_tokens", "ok", "error"):
            setattr(result, key, item[key])
        results.append(result)
    return results


def run_one(python: Path, ir_dir: Path, weight_format: str, requests, *, concurrency: int, threads: int,
            kv_tokens: int, kv_note: str, max_num_batched_tokens: int, log_dir: Path, precision: str | None = None):
    from bench.report import row_from_results

    log_dir.mkdir(parents=True, exist_ok=True)
    job_path = log_dir / f"openvino-{weight_format}-job.json"
    out_path = log_dir / f"openvino-{weight_format}-result.json"
    log_path = log_dir / f"openvino-{weight_format}.log"
    block = 32  # the CPU plugin's KV block size; the budget is given in blocks where the API allows
    job = {"model_dir": str(ir_dir), "concurrency": concurrency, "threads": threads,
           "num_kv_blocks": -(-kv_tokens // block), "cache_size_gb": 1,
           "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max(concurrency, 1), "warmup": 2,
           "inference_precision": precision,
           "requests": [{"prompt": r.prompt, "prompt_len": r.prompt_len, "output_len": r.output_len}
                        for r in requests]}
    job_path.write_text(json.dumps(job))
    out_path.unlink(missing_ok=True)
    run_logged([str(python), str(RUNNER), str(job_path), str(out_path)], log_path,
               env={**os.environ, "OMP_NUM_THREADS": str(threads)}, timeout=3 * 3600)
    payload = json.loads(out_path.read_text())
    row = row_from_results(f"OpenVINO GenAI CB {weight_format.upper()}", to_results(payload), payload["wall_s"])
    facts = payload.get("facts", {})
    precision = facts.get("INFERENCE_PRECISION_HINT", "?")
    for key, value in label("OpenVINO GenAI ContinuousBatchingPipeline",
                            weights=f"{WEIGHT_FORMATS.get(weight_format, weight_format)} IR, compute {precision}",
                            weight_bits=WEIGHT_BITS.get(weight_format),
                            threads=threads, kv_budget=f"{kv_note}, {facts.get('KV_CACHE_PRECISION', '?')} K/V",
                            transport="in-process").items():
        setattr(row, key, value)
    if payload.get("cpu_s") is not None:  # the pipeline and its driving loop: one process, no client
        row.cpu_s = {"openvino (in-process)": payload["cpu_s"]}
    row.kv_usage_peak = payload["cache"].get("kv_usage_peak")
    row.kv_usage_mean = payload["cache"].get("kv_usage_mean")
    row.profile = {"openvino": facts}
    row.notes.append(f"in-process (no HTTP); openvino {facts.get('openvino', '?')}, genai "
                     f"{facts.get('openvino_genai', '?')}, KV cache precision {facts.get('KV_CACHE_PRECISION', '?')}, "
                     f"pipeline loaded in {facts.get('load_s', 0):.1f} s")
    return row


def run_peer(requests, *, model_dir: Path, variants: list[str], concurrency: int, threads: int, kv_tokens: int,
             kv_note: str, max_num_batched_tokens: int, log_dir: Path, precision: str | None = None,
             log=print) -> tuple[list, list[str], dict]:
    """(rows, skip reasons, set-up facts) for each weight format in ``variants`` (``fp16``, ``int8``);
    ``precision``: the CPU plugin's INFERENCE_PRECISION_HINT, None for its default (bf16 where the CPU has it;
    a format whose run dies there with SIGFPE runs again in f32, and its row says so)."""
    facts: dict = {}
    started = time.perf_counter()
    try:
        python, install_s = setup_venv(log)
        facts["install_s"] = install_s
    except PeerUnavailable as exc:
        return [], [f"OpenVINO GenAI skipped: {exc}"], facts
    base_s = time.perf_counter() - started
    rows, skipped = [], []
    for weight_format in variants:
        variant_started = time.perf_counter()
        try:
            ir_dir, export_s = export(python, model_dir, weight_format, log)
            facts[f"export_{weight_format}_s"] = export_s
            setup_s = base_s + time.perf_counter() - variant_started
            facts[f"setup_{weight_format}_s"] = setup_s
            log(f"== peer: OpenVINO GenAI ContinuousBatchingPipeline, {weight_format} weights, {threads} threads, "
                f"{concurrency} in flight, KV {kv_tokens} tokens (set-up {setup_s:.0f} s)")
            run = functools.partial(run_one, python, ir_dir, weight_format, requests, concurrency=concurrency,
                                    threads=threads, kv_tokens=kv_tokens, kv_note=kv_note,
                                    max_num_batched_tokens=max_num_batched_tokens, log_dir=log_dir)
            try:
                rows.append(run(precision=precision))
            except PeerCrashed as exc:
                # OpenVINO 2026.4 dies with SIGFPE compiling an fp16 or fp32 IR in bf16 on some AMX
                # Xeons, before the first request; in f32 it runs, which beats a row with no numbers.
                if precision is not None or exc.signal_name != "SIGFPE":
                    raise
                log(f"   OpenVINO GenAI {weight_format} died with {exc.signal_name} in the CPU plugin's default "
                    f"precision: running it in f32")
                row = run(precision="f32")
                row.notes.append(f"run in f32: in the CPU plugin's default precision it died with {exc.signal_name}")
                rows.append(row)
        except PeerUnavailable as exc:
            skipped.append(f"OpenVINO GenAI {weight_format} skipped: {exc}")
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            skipped.append(f"OpenVINO GenAI {weight_format} failed: {type(exc).__name__}: {exc}"[:800])
    return rows, skipped, facts


def run_structured(python: Path, job: dict, log_dir: Path, name: str, log=print) -> dict:
    """``openvino_structured_runner.py`` on ``job`` (its ``mode``: probe or measure) in the venv's
    python; returns its JSON. ``job["inference_precision"]`` None is the CPU plugin's default, and a
    run that dies there with SIGFPE (bf16 on some CPUs) runs again in f32, its facts saying why."""
    log_dir.mkdir(parents=True, exist_ok=True)
    job_path, out_path = log_dir / f"{name}-job.json", log_dir / f"{name}-result.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(job.get("threads") or os.cpu_count() or 1)}

    def once(job: dict) -> dict:
        job_path.write_text(json.dumps(job))
        out_path.unlink(missing_ok=True)
        run_logged([str(python), str(STRUCTURED_RUNNER), str(job_path), str(out_path)], log_dir / f"{name}.log",
                   env=env, timeout=3 * 3600)
        return json.loads(out_path.read_text())

    try:
        return once(job)
    except PeerCrashed as exc:
        if job.get("inference_precision") or exc.signal_name != "SIGFPE":
            raise
        log(f"   OpenVINO GenAI ({name}) died with {exc.signal_name} in the CPU plugin's default precision: "
            f"running it in f32")
        payload = once({**job, "inference_precision": "f32"})
        payload.setdefault("facts", {})["fallback"] = (f"run in f32: in the CPU plugin's default precision it "
                                                       f"died with {exc.signal_name}")
        return payload
