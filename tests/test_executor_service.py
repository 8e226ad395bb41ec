"""``python -m executor`` as a real process over gRPC: Describe, Execute, bad input, shutdown."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest

from executor.loader import model_fingerprint
from executor.model import cpu_packs_bf16
from kvserve.health import check
from kvserve.v1 import executor_pb2 as pb
from kvserve.v1 import executor_pb2_grpc
from tests.conftest import PARIS_QUESTION, REPO_ROOT, free_port, service_env
from tests.conftest import TINY_MAX_MODEL_LEN as MAX_MODEL_LEN
from tests.conftest import TINY_NUM_BLOCKS as NUM_BLOCKS


def seq(tokens, start, table, sample=True, **sampling):
    return pb.ExecuteSequence(seq_id=len(tokens), token_ids=tokens, start_position=start, block_table=table,
                              sample=sample, sampling=pb.SamplingParams(**sampling))


def test_describe_and_clean_shutdown(tiny_executor, tiny_model_dir):
    service, stub, _ = tiny_executor
    info = stub.Describe(pb.DescribeRequest(), timeout=10)
    assert info.architecture == "LlamaForCausalLM" and info.model_name == tiny_model_dir.name
    assert info.model_fingerprint == model_fingerprint(tiny_model_dir) and len(info.model_fingerprint) == 64
    assert (info.dtype, info.device, info.attention_backend) == ("float32", "cpu", "cpu")
    assert (info.block_size, info.num_blocks, info.max_model_len) == (16, NUM_BLOCKS, MAX_MODEL_LEN)
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2] and info.num_layers == 2
    assert info.kv_bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    logs = service.logs()
    assert f"PagedAttention enabled, block_size=16, num_gpu_blocks={NUM_BLOCKS}" in logs
    assert f"Maximum concurrency for {MAX_MODEL_LEN} tokens per request: 2.88x" in logs
    assert service.stop() == 0


BAD_REQUESTS = {
    "empty batch": (pb.ExecuteRequest(), "sequences"),
    "empty token_ids": (pb.ExecuteRequest(sequences=[seq([], 0, [1])]), "sequences[0] (seq_id 0).token_ids"),
    "token outside vocab": (pb.ExecuteRequest(sequences=[seq([5, 49152], 0, [1])]), "token_ids[1]"),
    "block id outside range": (pb.ExecuteRequest(sequences=[seq([5] * 20, 0, [1, NUM_BLOCKS])]), "block_table[1]"),
    "block table too short": (pb.ExecuteRequest(sequences=[seq([5] * 20, 0, [1])]), "block_table"),
    "position beyond max_model_len": (pb.ExecuteRequest(sequences=[seq([5], MAX_MODEL_LEN, list(range(1, 10)))]),
                                      "start_position"),
    "copy dst repeated": (pb.ExecuteRequest(copy_src=[1, 2], copy_dst=[3, 3], sequences=[seq([5], 0, [4])]),
                          "copy_dst[1]"),
    "copy dst is a source": (pb.ExecuteRequest(copy_src=[1, 2], copy_dst=[2, 3], sequences=[seq([5], 0, [4])]),
                             "copy_dst[0]"),
    "copy block outside range": (pb.ExecuteRequest(copy_src=[NUM_BLOCKS], copy_dst=[3], sequences=[seq([5], 0, [4])]),
                                 "copy_src[0]"),
    "copy lengths differ": (pb.ExecuteRequest(copy_src=[1], copy_dst=[], sequences=[seq([5], 0, [4])]), "copy_dst"),
    "bad sampling": (pb.ExecuteRequest(sequences=[seq([5], 0, [4], top_p=2.0)]), "sampling.top_p"),
}


def test_bad_requests_are_invalid_argument_and_leave_kv_intact(shared_tiny_executor):
    _, stub, _ = shared_tiny_executor
    prompt = list(range(300, 340))  # 40 tokens: blocks 1-3 for A, 4-6 for its twin B
    first = stub.Execute(pb.ExecuteRequest(sequences=[seq(prompt, 0, [1, 2, 3]), seq(prompt, 0, [4, 5, 6])]))
    assert first.sampled_token_ids[0] == first.sampled_token_ids[1] and first.num_tokens == 80
    for name, (request, field) in BAD_REQUESTS.items():
        with pytest.raises(grpc.RpcError) as info:
            stub.Execute(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert field in info.value.details(), (name, info.value.details())
    # Rejected batches that would have overwritten A's KV: a sequence writing garbage into
    # A's blocks next to a bad one, and copies into A's blocks with an overlap.
    garbage = seq(list(range(1000, 1040)), 0, [1, 2, 3])
    for request in (pb.ExecuteRequest(sequences=[garbage, seq([5, 49152], 0, [7])]),
                    pb.ExecuteRequest(sequences=[garbage, seq([5], MAX_MODEL_LEN, [7])]),
                    pb.ExecuteRequest(copy_src=[7, 8], copy_dst=[1, 1], sequences=[garbage])):
        with pytest.raises(grpc.RpcError) as info:
            stub.Execute(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A and its twin still agree on the next token and its log-probabilities.
    token = first.sampled_token_ids[0]
    after = stub.Execute(pb.ExecuteRequest(sequences=[seq([token], 40, [1, 2, 3], top_logprobs=5),
                                                      seq([token], 40, [4, 5, 6], top_logprobs=5)]))
    assert after.sampled_token_ids[0] == after.sampled_token_ids[1]
    assert after.top_logprobs[0] == after.top_logprobs[1]
    assert after.timings.total_ms > 0 and after.timings.forward_ms > 0


def test_execute_stream_answers_each_step_in_order_as_execute_does(shared_tiny_executor):
    """ExecuteStream (what the gateway uses): step after step on one stream, each reply the one a
    unary Execute gives for the same step; a refused step ends the stream with Execute's status
    and changes no KV; a malformed message is INVALID_ARGUMENT; the next stream serves again."""
    service, stub, _ = shared_tiny_executor
    prompt = list(range(300, 340))
    unary = [stub.Execute(pb.ExecuteRequest(sequences=[seq(prompt, 0, [1, 2, 3])]))]
    unary.append(stub.Execute(pb.ExecuteRequest(sequences=[seq([unary[0].sampled_token_ids[0]], 40, [1, 2, 3],
                                                               top_logprobs=3)])))
    steps = [pb.ExecuteRequest(sequences=[seq(prompt, 0, [4, 5, 6])]),
             pb.ExecuteRequest(sequences=[seq([unary[0].sampled_token_ids[0]], 40, [4, 5, 6], top_logprobs=3)])]
    streamed = list(stub.ExecuteStream(iter(steps), timeout=60))
    assert [r.sampled_token_ids for r in streamed] == [r.sampled_token_ids for r in unary]
    assert [list(r.sampled_logprobs) for r in streamed] == [list(r.sampled_logprobs) for r in unary]
    assert streamed[1].top_logprobs == unary[1].top_logprobs
    # A refused step after a good one: the good one is answered, then the stream ends with the refusal.
    garbage = seq(list(range(1000, 1040)), 0, [4, 5, 6])
    replies = stub.ExecuteStream(iter([steps[1], pb.ExecuteRequest(sequences=[garbage, seq([5, 49152], 0, [7])]),
                                       steps[1]]), timeout=60)
    assert next(replies).sampled_token_ids
    with pytest.raises(grpc.RpcError) as info:
        next(replies)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[1]" in info.value.details()
    with grpc.insecure_channel(service.address) as channel:
        malformed = channel.stream_stream("/kvserve.v1.Executor/ExecuteStream", request_serializer=lambda b: b,
                                          response_deserializer=pb.ExecuteResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(malformed(iter([b"\xff\xff"]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in info.value.details()
    # B's KV is as the good steps left it: the same next step as A's, unary or streamed.
    token = unary[1].sampled_token_ids[0]
    again = [pb.ExecuteRequest(sequences=[seq([token], 41, [1, 2, 3])]),
             pb.ExecuteRequest(sequences=[seq([token], 41, [4, 5, 6])])]
    assert [r.sampled_token_ids for r in stub.ExecuteStream(iter(again), timeout=60)] == \
        [stub.Execute(again[0]).sampled_token_ids] * 2


def test_missing_model_dir_is_one_line_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "executor", "--model", str(tmp_path / "nope"), "--port", str(free_port())],
        cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "executor: error:" in proc.stderr and "nope" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_default_model_answers_paris_and_stays_healthy_during_a_step(start_service, default_model_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    service = start_service("executor", "--model", str(default_model_dir), "--num-blocks", "128")
    stub = executor_pb2_grpc.ExecutorStub(grpc.insecure_channel(service.address))
    # auto on the CPU: bf16 where the CPU runs it natively, float32 where it would be emulated, with
    # the bf16 checkpoint's K/V kept in bf16 (--kv-cache-dtype auto)
    assert stub.Describe(pb.DescribeRequest()).dtype == ("bfloat16" if cpu_packs_bf16() else "float32+kv-bfloat16")
    chat = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = chat.apply_chat_template([{"role": "user", "content": PARIS_QUESTION}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    tokens, table, position, generated = list(prompt), list(range(1, 9)), 0, []
    while len(generated) < 24:
        out = stub.Execute(pb.ExecuteRequest(sequences=[seq(tokens, position, table)]), timeout=60)
        position += len(tokens)
        tokens = [out.sampled_token_ids[0]]
        if tokens[0] == 2:
            break
        generated.append(tokens[0])
    text = Tokenizer.from_file(str(default_model_dir / "tokenizer.json")).decode(generated)
    assert "Paris" in text, text

    # Health checks answer while a long step runs (the step is off the event loop).
    long_step = pb.ExecuteRequest(sequences=[seq(list(range(1000, 2500)), 0, list(range(9, 9 + 94)))])
    replies = []
    worker = threading.Thread(target=lambda: replies.append(stub.Execute(long_step, timeout=120)))
    start = time.monotonic()
    worker.start()
    time.sleep(0.2)
    answered_during_step = check(service.address, timeout=1.0) and worker.is_alive()
    worker.join()
    assert replies and replies[0].num_tokens == 1500
    if time.monotonic() - start > 1.5:  # a step long enough to overlap the check
        assert answered_during_step


def test_a_sequence_reads_from_its_proto_with_every_sampling_field():
    """What run_step hands the runner: every field as sent, sampling parameters parsed once per
    distinct set (seed 0 kept apart from no seed), large ones (a constraint's bitmask) parsed anew."""
    from executor.sampling import SamplingParams
    from executor.service import CACHED_SAMPLING_BYTES, sequence_from_proto

    def sequence(**sampling) -> pb.ExecuteSequence:
        seq = pb.ExecuteSequence(seq_id=7, token_ids=[5, 6], start_position=3, block_table=[9, 4], sample=True,
                                 num_draft_tokens=1, prompt_top_logprobs=2, prompt_logprob_token_ids=[6],
                                 store_load_block_ids=[9], store_load_hashes=[b"h" * 32])
        seq.sampling.CopyFrom(pb.SamplingParams(**sampling))
        return seq

    full = dict(temperature=0.7, top_k=5, top_p=0.9, seed=0, top_logprobs=2, suppressed_token_ids=[2],
                logit_bias_token_ids=[3], logit_bias_values=[1.5], presence_penalty=0.5, frequency_penalty=0.25,
                repetition_penalty=1.1, penalty_token_ids=[4], penalty_output_counts=[2], min_p=0.05)
    got = sequence_from_proto(sequence(**full))
    assert (got.seq_id, got.token_ids, got.start_position, got.block_table, got.sample) == (7, [5, 6], 3, [9, 4], True)
    assert (got.num_draft_tokens, got.prompt_top_logprobs, got.prompt_logprob_token_ids) == (1, 2, [6])
    assert (got.store_load_block_ids, got.store_load_hashes) == ([9], [b"h" * 32])
    for name, sent in full.items():  # float32 on the wire
        assert getattr(got.sampling, name) == pytest.approx(tuple(sent) if isinstance(sent, list) else sent), name
    assert got.sampling.seed == 0
    assert sequence_from_proto(sequence(**full)).sampling is got.sampling  # parsed once
    unseeded = {k: v for k, v in full.items() if k != "seed"}
    assert sequence_from_proto(sequence(**unseeded)).sampling.seed is None
    bitmask = bytes(range(256)) * (CACHED_SAMPLING_BYTES // 256 + 1)
    constrained = sequence_from_proto(sequence(allowed_token_bitmask=bitmask))
    assert constrained.sampling.allowed_token_bitmask == bitmask
    assert sequence_from_proto(sequence(allowed_token_bitmask=bitmask)).sampling is not constrained.sampling
    plain = sequence_from_proto(pb.ExecuteSequence(seq_id=1, token_ids=[1], block_table=[0]))
    assert plain.sampling == SamplingParams() and plain.store_load_hashes == [] and plain.prompt_logprob_token_ids == []
