"""Speculative drafts over the executor's step socket: its frames carry ExecuteRequest and
ExecuteResponse whole, so ``num_draft_tokens`` and ``num_accepted_draft_tokens`` travel as over
gRPC. A twin sequence stepped over gRPC is the oracle; a draft the executor cannot verify is
refused on the socket with INVALID_ARGUMENT naming the field, and the connection stays."""
from __future__ import annotations

import grpc

from kvserve.v1 import executor_pb2 as pb
from tests.test_executor_service import seq
from tests.test_step_socket import RawStepClient


def test_drafts_are_verified_alike_over_the_socket_and_grpc(tiny_executor):
    _, stub, info = tiny_executor
    assert info.verifies_draft_tokens
    client = RawStepClient(info.step_socket)
    prompt = list(range(300, 330))
    # Reference: plain greedy decoding of 4 tokens over gRPC in blocks 7..9.
    reply = stub.Execute(pb.ExecuteRequest(sequences=[seq(prompt, 0, [7, 8, 9])]))
    reference = [reply.sampled_token_ids[0]]
    for position in range(30, 33):
        reply = stub.Execute(pb.ExecuteRequest(sequences=[seq([reference[-1]], position, [7, 8, 9])]))
        reference.append(reply.sampled_token_ids[0])
    # A over the socket (blocks 1..3), B over gRPC (4..6): prefill, then the first token with
    # drafts: two right, one wrong.
    client.answered(pb.ExecuteRequest(sequences=[seq(prompt, 0, [1, 2, 3])]))
    stub.Execute(pb.ExecuteRequest(sequences=[seq(prompt, 0, [4, 5, 6])]))
    drafts = reference[1:3] + [(reference[3] + 1) % info.vocab_size]
    answers = []
    for send, table in ((client.answered, [1, 2, 3]), (stub.Execute, [4, 5, 6])):
        step = seq([reference[0]] + drafts, 30, table)
        step.num_draft_tokens = len(drafts)
        answers.append(send(pb.ExecuteRequest(sequences=[step])))
    over_socket, over_grpc = answers
    assert list(over_socket.num_accepted_draft_tokens) == list(over_grpc.num_accepted_draft_tokens) == [2]
    assert list(over_socket.sampled_token_ids) == list(over_grpc.sampled_token_ids) == reference[1:4]
    refused = seq([reference[0]] + drafts, 30, [1, 2, 3], temperature=0.5)
    refused.num_draft_tokens = len(drafts)
    status, body = client.step(pb.ExecuteRequest(sequences=[refused]))
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"sampling.temperature" in body, body
    client.answered(pb.ExecuteRequest(sequences=[seq([reference[3]], 33, [1, 2, 3])]))  # the connection stays
    client.close()
