"""Times prompt prefills on OpenVINO GenAI's ``ContinuousBatchingPipeline``, one per request line.

Executed by the OpenVINO peer's own venv python (never imported by kvserve or its tests, so it
uses nothing but the standard library, numpy and ``openvino_genai``), driven by
bench/prefill_vs_openvino.py over its stdin and stdout:

    python openvino_prefill_worker.py IR_DIR THREADS NUM_KV_BLOCKS [PRECISION]

prints ``{"ready": true, ...facts}`` once the pipeline is compiled (by openvino_runner.py's
``open_pipeline``: the served peer's scheduler, threads and precision hint), then reads one JSON list of
token ids a line and answers each with ``{"ms": wall milliseconds, "first_token": id}``: the
prompt prefilled and its first token picked (greedy, one new token), as a request's TTFT in the
same process. Prefix caching is on, as in the served peer: a prefix sent before stays cached.
"""
from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    from openvino_runner import open_pipeline  # beside this file: the served peer's set-up

    pipe, facts = open_pipeline({"model_dir": argv[0], "threads": int(argv[1]), "num_kv_blocks": int(argv[2]),
                                 "inference_precision": argv[3] if len(argv) > 3 else "",
                                 "max_num_batched_tokens": 4096, "max_num_seqs": 1})
    generation = ov_genai.GenerationConfig()
    generation.max_new_tokens = generation.min_new_tokens = 1
    generation.ignore_eos = True
    generation.do_sample = False
    print(json.dumps({"ready": True, **facts}), flush=True)
    for line in sys.stdin:
        token_ids = json.loads(line)
        input_ids = ov.Tensor(np.array([token_ids], dtype=np.int64))
        started = time.perf_counter()
        result = pipe.generate([input_ids], [generation])[0]
        elapsed = (time.perf_counter() - started) * 1e3
        print(json.dumps({"ms": elapsed, "first_token": int(result.m_generation_ids[0][0])}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
