"""Structured outputs on OpenVINO GenAI's ``ContinuousBatchingPipeline``, in-process.

Executed by the OpenVINO peer's own venv python (never imported by kvserve or its tests, so it
uses nothing but the standard library, numpy and ``openvino_genai``), driven by
bench/structured_outputs.py:

    python openvino_structured_runner.py job.json result.json

``job.json``: the pipeline's set-up as openvino_runner.py's ``open_pipeline`` takes it
(``model_dir``, ``threads``, ``inference_precision``, ``max_num_batched_tokens``,
``max_num_seqs``, ``cache_size_gb``), ``mode``, ``requests``: [{"name", "input_ids" (the chat
prompt as the gateway tokenizes it), "schema" (JSON text)}], and for ``measure``
``concurrency``, ``max_tokens``, ``rounds``.

``mode: probe``: each schema once, one request at a time, one new token, with
``StructuredOutputConfig(json_schema=...)`` (OpenVINO compiles it with xgrammar); a schema whose
request raises is refused, with its message. Writes {"refused": {name: message}, "facts"}.

``mode: measure``: on one pipeline, every request once constrained and once not (two tokens: the
prompts go into the prefix cache, every schema is compiled, both paths have run), then ``rounds`` times row ``json_schema``
(greedy, constrained, up to ``max_tokens``, ends when the grammar completes) and row
``unconstrained`` (the same prompts, no constraint, ``min_new_tokens = max_new_tokens`` = the
constrained reply's length, ``ignore_eos``). ``concurrency`` requests in flight (a closed loop:
when one finishes the next is added); one thread drives ``pipe.step()`` and reads every
request's ``GenerationHandle`` after each step. Writes {"rounds": [{"json_schema": row,
"unconstrained": row}], "facts"}, a row being {"wall_s", "results": [{"ttft_s", "latency_s",
"token_ids", "finish_reason", "error"}]}; the bench decodes and validates the replies.
"""
from __future__ import annotations

import json
import sys
import time

try:
    from openvino_runner import open_pipeline  # beside this file: the served peer's set-up
except ImportError:  # imported as bench.peers.openvino_structured_runner (tests)
    from bench.peers.openvino_runner import open_pipeline


def generation_config(ov_genai, max_tokens: int, schema: str | None):
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = max_tokens
    config.do_sample = False  # greedy, as temperature 0 over HTTP
    config.apply_chat_template = False  # the input ids are the chat prompt already
    if schema is None:
        config.min_new_tokens = max_tokens
        config.ignore_eos = True
    else:
        config.structured_output_config = ov_genai.StructuredOutputConfig(json_schema=schema)
    return config


def prompt_tensor(input_ids: list[int]):
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.array([input_ids], dtype=np.int64))


def closed_loop(pipe, ov_genai, items: list[tuple[list[int], object]], concurrency: int) -> dict:
    """``items``: (input ids, GenerationConfig); ``concurrency`` of them in flight at once."""
    results: list = [None] * len(items)
    active: dict[int, tuple] = {}
    next_index = 0
    started = time.perf_counter()

    def add(index: int) -> None:
        input_ids, config = items[index]
        now = time.perf_counter()
        handle = pipe.add_request(index, prompt_tensor(input_ids), config)
        active[index] = (handle, {"ttft_s": None, "latency_s": 0.0, "token_ids": [], "finish_reason": None,
                                  "error": "", "_start": now})

    while next_index < len(items) and len(active) < concurrency:
        add(next_index)
        next_index += 1
    while active:
        pipe.step()
        now = time.perf_counter()
        for index in list(active):
            handle, result = active[index]
            while handle.can_read():
                for output in handle.read().values():
                    if output.generated_ids and result["ttft_s"] is None:
                        result["ttft_s"] = now - result["_start"]
                    result["token_ids"].extend(int(t) for t in output.generated_ids)
                    reason = getattr(output, "finish_reason", None)
                    if reason is not None and str(reason) not in ("NONE", "GenerationFinishReason.NONE"):
                        result["finish_reason"] = str(reason).rsplit(".", 1)[-1].lower()
            status = handle.get_status()
            if status != ov_genai.GenerationStatus.RUNNING:
                result["latency_s"] = now - result.pop("_start")
                if status != ov_genai.GenerationStatus.FINISHED:
                    result["error"] = f"status {status}"
                results[index] = result
                del active[index]
                if next_index < len(items):
                    add(next_index)
                    next_index += 1
    return {"wall_s": time.perf_counter() - started, "results": results}


def probe(job: dict) -> dict:
    import openvino_genai as ov_genai

    pipe, facts = open_pipeline(job)
    refused: dict[str, str] = {}
    seen: set[str] = set()
    for request in job["requests"]:
        if request["name"] in seen:
            continue
        seen.add(request["name"])
        try:
            row = closed_loop(pipe, ov_genai, [(request["input_ids"],
                                                 generation_config(ov_genai, 1, request["schema"]))], 1)
            error = row["results"][0]["error"]
        except Exception as exc:  # noqa: BLE001 — a refusal is whatever the pipeline raises
            error = f"{type(exc).__name__}: {exc}"
            pipe, _ = open_pipeline(job)  # a failed step may leave the pipeline unusable
        if error:
            refused[request["name"]] = error[:500]
    return {"refused": refused, "facts": facts}


def measure(job: dict) -> dict:
    import openvino_genai as ov_genai

    pipe, facts = open_pipeline(job)
    requests, concurrency, max_tokens = job["requests"], int(job["concurrency"]), int(job["max_tokens"])
    # Warm: every prompt into the prefix cache, every schema compiled; and the unconstrained path
    # once (its first batch pays a one-time ~0.2 s here otherwise, in the first round's TTFT).
    for schema in ("constrained", None):
        closed_loop(pipe, ov_genai, [(r["input_ids"], generation_config(ov_genai, 2, schema and r["schema"]))
                                     for r in requests], concurrency)
    rounds = []
    for _ in range(int(job["rounds"])):
        constrained = closed_loop(pipe, ov_genai, [(r["input_ids"], generation_config(ov_genai, max_tokens, r["schema"]))
                                                   for r in requests], concurrency)
        lengths = [max(len(result["token_ids"]), 1) for result in constrained["results"]]
        plain = closed_loop(pipe, ov_genai, [(r["input_ids"], generation_config(ov_genai, k, None))
                                             for r, k in zip(requests, lengths)], concurrency)
        rounds.append({"json_schema": constrained, "unconstrained": plain})
    return {"rounds": rounds, "facts": facts}


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[1], encoding="utf-8").read())
    out = probe(job) if job["mode"] == "probe" else measure(job)
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
