"""Runs the workload on OpenVINO GenAI's ``ContinuousBatchingPipeline``, in-process.

Executed by the OpenVINO peer's own venv python (never imported by kvserve or its tests,
so it uses nothing but the standard library and ``openvino_genai``):

    python openvino_runner.py job.json result.json

``job.json``: {"model_dir", "requests": [{"prompt", "prompt_len", "output_len"}], "concurrency",
"threads", "num_kv_blocks", "cache_size_gb", "max_num_batched_tokens", "max_num_seqs", "warmup"}.

A closed loop like bench/client.py's: ``concurrency`` requests are in flight; when one
finishes the next is added. One thread drives ``pipe.step()``; after each step every
request's ``GenerationHandle`` is read, and the time a request's first (next) tokens
become readable is its TTFT (ITL gap), as a streaming client in the same process sees it.
"""
from __future__ import annotations

import json
import sys
import time


def scheduler_config(ov_genai, job: dict):
    config = ov_genai.SchedulerConfig()
    config.enable_prefix_caching = True
    config.max_num_batched_tokens = int(job["max_num_batched_tokens"])
    config.max_num_seqs = int(job["max_num_seqs"])
    if hasattr(config, "dynamic_split_fuse"):
        config.dynamic_split_fuse = True
    if job.get("num_kv_blocks") and hasattr(config, "num_kv_blocks"):
        config.num_kv_blocks = int(job["num_kv_blocks"])
    else:
        config.cache_size = max(1, int(round(float(job.get("cache_size_gb") or 1))))
    return config


def generation_config(ov_genai, output_len: int):
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = output_len
    config.min_new_tokens = output_len
    config.ignore_eos = True
    config.do_sample = False  # greedy
    if hasattr(config, "apply_chat_template"):
        config.apply_chat_template = False  # raw prompts, as /v1/completions sends them
    return config


def open_pipeline(job: dict):
    """(the ContinuousBatchingPipeline for ``job``, facts for the report): its threads, precision
    hint and scheduler as the job says, and what the CPU plugin reports of its precisions."""
    import openvino_genai as ov_genai

    properties = {"INFERENCE_NUM_THREADS": int(job["threads"])} if job.get("threads") else {}
    if job.get("inference_precision"):
        properties["INFERENCE_PRECISION_HINT"] = job["inference_precision"]
    loaded = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(job["model_dir"], scheduler_config(ov_genai, job), "CPU",
                                               properties)
    load_s = time.perf_counter() - loaded
    facts = {"load_s": load_s, "openvino_genai": getattr(ov_genai, "__version__", "?")}
    try:
        import openvino as ov

        core = ov.Core()
        facts["openvino"] = ov.get_version()
        for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION"):
            try:
                value = core.get_property("CPU", key)
                facts[key] = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
            except Exception:  # noqa: BLE001 — informational only
                pass
    except Exception:  # noqa: BLE001
        pass
    if job.get("inference_precision"):  # what this pipeline was given, not the plugin's default
        facts["INFERENCE_PRECISION_HINT"] = job["inference_precision"]
    return pipe, facts


def run(job: dict) -> dict:
    import openvino_genai as ov_genai

    pipe, facts = open_pipeline(job)

    def drive(requests: list[dict], concurrency: int) -> tuple[list[dict], float, dict]:
        results = [None] * len(requests)
        active: dict[int, tuple] = {}  # index -> (handle, result)
        next_index = 0
        usage_peak, usage_sum, usage_n = 0.0, 0.0, 0
        t0 = time.perf_counter()

        def add(index: int) -> None:
            request = requests[index]
            now = time.perf_counter()
            result = {"prompt_len": request["prompt_len"], "expected_output_len": request["output_len"],
                      "sent_at": now - t0, "ttft": 0.0, "e2e": 0.0, "itl": [], "output_tokens": 0,
                      "ok": False, "error": "", "_start": now, "_last": now}
            handle = pipe.add_request(index, request["prompt"], generation_config(ov_genai, request["output_len"]))
            active[index] = (handle, result)

        while next_index < len(requests) and len(active) < concurrency:
            add(next_index)
            next_index += 1
        while active:
            pipe.step()
            now = time.perf_counter()
            try:
                metrics = pipe.get_metrics()
                usage = float(metrics.cache_usage) / 100.0
                usage_peak, usage_sum, usage_n = max(usage_peak, usage), usage_sum + usage, usage_n + 1
            except Exception:  # noqa: BLE001 — older versions have no get_metrics
                pass
            for index in list(active):
                handle, result = active[index]
                new_tokens = 0
                while handle.can_read():
                    for output in handle.read().values():
                        new_tokens += len(output.generated_ids)
                if new_tokens:
                    if result["output_tokens"] == 0:
                        result["ttft"] = now - result["_start"]
                    else:
                        result["itl"].append(now - result["_last"])
                    result["_last"] = now
                    result["output_tokens"] += new_tokens
                status = handle.get_status()
                if status != ov_genai.GenerationStatus.RUNNING:
                    result["e2e"] = now - result["_start"]
                    result["ok"] = result["output_tokens"] > 0 and status == ov_genai.GenerationStatus.FINISHED
                    if not result["ok"]:
                        result["error"] = f"status {status}"
                    for key in ("_start", "_last"):
                        result.pop(key)
                    results[index] = result
                    del active[index]
                    if next_index < len(requests):
                        add(next_index)
                        next_index += 1
        wall = time.perf_counter() - t0
        cache = {"kv_usage_peak": usage_peak, "kv_usage_mean": usage_sum / usage_n if usage_n else None}
        return results, wall, cache

    warmup = [{"prompt": "Say hello to the benchmark in one short sentence.", "prompt_len": 12, "output_len": 8}]
    for _ in range(int(job.get("warmup", 2))):
        drive(warmup, 1)
    cpu_before = time.process_time()
    results, wall, cache = drive(job["requests"], int(job["concurrency"]))
    return {"results": results, "wall_s": wall, "cache": cache, "facts": facts,
            "cpu_s": round(time.process_time() - cpu_before, 3)}


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[1], encoding="utf-8").read())
    out = run(job)
    with open(argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
