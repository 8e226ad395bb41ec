"""Peer: Hugging Face ``transformers`` with static batching, the naive server a user would write.

Requests are taken ``batch_size`` at a time (the closed loop's concurrency),
left-padded into one tensor and run through ``generate`` greedily until the
longest output of the batch is done (``min_new_tokens == max_new_tokens``, so
EOS cannot end it early: fixed output lengths, as for kvserve). Each request
counts only its own reference length as useful output; the rest is the waste
static batching pays. A stopping criterion that never stops records when each
decoding step ends, which gives TTFT and ITL per request.

KV memory utilization is computed from the batch shapes: the cache holds
``batch x (longest prompt + step)`` slots at every step, of which each request
fills its own prompt plus the tokens it still needs.
"""
from __future__ import annotations

import time
from pathlib import Path

from bench.client import RequestResult
from bench.report import Row, row_from_results
from bench.workload import BenchRequest, load_tokenizer


class _StepClock:
    """A ``StoppingCriteria`` that only timestamps steps (called once per generated token)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def left_padded(token_lists: list[list[int]], pad_id: int):
    """(input_ids, attention_mask) with every row right-aligned."""
    import torch

    width = max(len(ids) for ids in token_lists)
    input_ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for row, ids in enumerate(token_lists):
        if ids:
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[row, width - len(ids):] = 1
    return input_ids, mask


def batch_kv_slots(prompt_lens: list[int], output_lens: list[int]) -> tuple[int, int]:
    """(useful tokens, allocated slots) summed over the steps of one padded batch."""
    width, steps = max(prompt_lens), max(output_lens)
    stored = allocated = 0
    for step in range(steps):
        allocated += len(prompt_lens) * (width + step)
        stored += sum(p + min(step, o) for p, o in zip(prompt_lens, output_lens))
    return stored, allocated


def keep_freed_memory_in_heap() -> bool:
    """Stops glibc from returning large freed buffers to the OS (and page-faulting them back).

    ``python -m executor`` does the same at start. Without it, every decode step's
    large temporaries are fresh mmap'd pages: on the 2-core dev box transformers'
    bf16 batch-32 decode step took ~1.5 s instead of ~0.2 s. The peer gets the same
    machine setting as kvserve, so the comparison is about serving, not malloc.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # mallopt parameter ids in glibc's malloc.h
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def load_model(model_dir: Path, dtype: str = "bfloat16"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.eval()


def run_static_batches(model, token_lists: list[list[int]], requests: list[BenchRequest], batch_size: int,
                       pad_id: int, progress: bool = True) -> tuple[list[RequestResult], float, tuple[int, int]]:
    """Generates every batch; returns (results, wall seconds, (stored, allocated) KV slot-steps)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import StoppingCriteriaList

    results: list[RequestResult] = []
    stored = allocated = 0
    bar = tqdm(total=len(requests), desc="transformers", unit="req", disable=not progress, leave=False)
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        ids = token_lists[start:start + batch_size]
        steps = max(r.output_len for r in batch)
        input_ids, mask = left_padded(ids, pad_id)
        clock = _StepClock()
        sent = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=steps,
                           min_new_tokens=steps, pad_token_id=pad_id,
                           stopping_criteria=StoppingCriteriaList([clock]))
        done = time.perf_counter()
        for request, prompt in zip(batch, ids):
            own = clock.times[:request.output_len]
            result = RequestResult(len(prompt), request.output_len, sent_at=sent - t0)
            result.ttft = own[0] - sent
            result.itl = [b - a for a, b in zip(own, own[1:])]
            result.e2e = done - sent  # a naive server answers when the whole batch returns
            result.output_tokens = len(own)
            result.ok = len(own) == request.output_len
            results.append(result)
        s, a = batch_kv_slots([len(p) for p in ids], [r.output_len for r in batch])
        stored, allocated = stored + s, allocated + a
        bar.update(len(batch))
    bar.close()
    return results, time.perf_counter() - t0, (stored, allocated)


def run_transformers_peer(model_dir: Path, requests: list[BenchRequest], batch_size: int,
                          dtype: str = "bfloat16", progress: bool = True) -> Row:
    """The peer's table row: same prompts, same output lengths, batches of ``batch_size``."""
    import torch
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    heap_tuned = keep_freed_memory_in_heap()
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype)
    pad_id = model.config.pad_token_id
    if pad_id is None:
        pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    token_lists = [tokenizer.encode(r.prompt, add_special_tokens=False).ids for r in requests]
    with torch.inference_mode():  # one short warm-up so first-call setup is not timed
        model.generate(input_ids=torch.tensor([token_lists[0][:8]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad_id)
    cpu_before = time.process_time()
    results, wall, (stored, allocated) = run_static_batches(model, token_lists, requests, batch_size,
                                                            pad_id, progress)
    cpu_s = round(time.process_time() - cpu_before, 3)
    row = row_from_results(f"peer: transformers static batching ({dtype})", results, wall)
    row.cpu_s = {"transformers (in-process)": cpu_s}
    row.max_concurrency = min(batch_size, len(requests))
    row.kv_utilization = stored / allocated if allocated else None
    row.internal_fragmentation = None  # a contiguous cache has no blocks; its waste is padding + reservation
    if not heap_tuned:
        row.notes.append("could not raise glibc's mmap threshold: decode steps may page-fault")
    row.notes.append("KV utilization from batch shapes (left padding + tokens generated past each "
                     "request's length); TTFT = first step of the batch; E2E = whole batch")
    return row
