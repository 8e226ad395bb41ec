"""Prompt log-probabilities: completions' ``echo`` with ``logprobs`` (what lm-evaluation-harness's
loglikelihood tasks send), from the executor's rows to the HTTP response, against transformers
reading the same checkpoint."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest
import torch

from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from gateway.detokenizer import ModelTokenizer
from kvserve.errors import InvalidArgument
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(300)

# Gateway steps of 16 tokens: a 40-token prompt is scored over three chunks, each naming the
# next chunk's first token.
CHUNK_TOKENS = 16


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    """token ids → log-probabilities [len, vocab] of transformers' float32 forward."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()

    def log_softmax(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)

    return log_softmax


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return ModelRunner(RunnerOptions(tiny_model_dir, dtype="float32", num_blocks=16))


def prompt_tokens(count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (count,), generator=generator).tolist()


def test_the_executor_scores_a_prompt_over_chunks_as_transformers_does(runner, oracle):
    tokens = prompt_tokens(40, seed=1)
    table = [1, 2, 3]
    first = SequenceInput(7, tokens[:25], 0, table, prompt_logprob_token_ids=tokens[1:26], prompt_top_logprobs=3)
    out = runner.execute([first])
    last = SequenceInput(7, tokens[25:], 25, table, sample=True, prompt_logprob_token_ids=tokens[26:])
    out2 = runner.execute([last])
    scores = out.prompt_logprobs[0].logprobs + out2.prompt_logprobs[0].logprobs
    expected = oracle(tokens)
    want = expected[torch.arange(39), torch.tensor(tokens[1:])]
    torch.testing.assert_close(torch.tensor(scores), want, atol=2e-4, rtol=0)
    top_ids = [ids for ids, _ in out.prompt_logprobs[0].top_logprobs]
    assert top_ids == expected[:25].topk(3, dim=-1).indices.tolist()
    assert out2.prompt_logprobs[0].top_logprobs == []  # none asked for
    # The sampled token's logprob is the last row's: the same distribution.
    assert out2.sampled_logprobs[0] == pytest.approx(expected[39, out2.sampled_token_ids[0]].item(), abs=2e-4)


def test_only_asking_sequences_answer_in_step_order(runner, oracle):
    a, b = prompt_tokens(12, seed=2), prompt_tokens(9, seed=3)
    out = runner.execute([SequenceInput(1, a, 0, [1], sample=True, prompt_logprob_token_ids=a[1:]),
                          SequenceInput(2, b, 0, [2], sample=True),
                          SequenceInput(3, b, 0, [3], prompt_logprob_token_ids=b[1:4])])
    assert [len(p.logprobs) for p in out.prompt_logprobs] == [11, 3]
    want_b = oracle(b)[torch.arange(3), torch.tensor(b[1:4])]
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1].logprobs), want_b, atol=2e-4, rtol=0)


@pytest.mark.parametrize("change, needle", [
    (dict(prompt_logprob_token_ids=[5] * 5), "at most one per row"),
    (dict(prompt_logprob_token_ids=[5, 49152]), "outside the vocabulary"),
    (dict(prompt_logprob_token_ids=[5], prompt_top_logprobs=21), "prompt_top_logprobs"),
    (dict(prompt_logprob_token_ids=[5], num_draft_tokens=1, sample=True), "num_draft_tokens"),
])
def test_a_bad_prompt_logprob_request_is_refused_by_name(runner, change, needle):
    with pytest.raises(InvalidArgument, match=needle):
        runner.validate([SequenceInput(1, [4, 5, 6, 7], 0, [1], **change)], [], [])


@pytest.fixture(scope="module")
def stack(module_stack, tiny_model_dir):
    return module_stack(tiny_model_dir, executor_args=["--dtype", "float32", "--num-blocks", "64"],
                        gateway_args=["--max-num-batched-tokens", str(CHUNK_TOKENS)])


def complete(stack, **body) -> dict:
    reply = httpx.post(stack.http_url + "/v1/completions", json={"max_tokens": 2, "temperature": 0, **body},
                       timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_echo_with_logprobs_reports_every_prompt_token_as_transformers_does(stack, tiny_model_dir, oracle):
    tokens = prompt_tokens(40, seed=4)
    body = complete(stack, prompt=tokens, echo=True, logprobs=2)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    tokenizer = ModelTokenizer(tiny_model_dir)
    assert len(lp["tokens"]) == 40 + 2  # the prompt's, then the completion's
    assert lp["tokens"][:40] == [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = oracle(tokens)
    want = expected[torch.arange(39), torch.tensor(tokens[1:])]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:40]), want, atol=2e-4, rtol=0)
    for position in (1, 16, 17, 39):  # either side of the chunk boundaries
        best = expected[position - 1].topk(2)
        reported = lp["top_logprobs"][position]
        assert list(reported) == [tokenizer.decode([t], skip_special_tokens=False) for t in best.indices.tolist()]
        assert list(reported.values()) == pytest.approx(best.values.tolist(), abs=2e-4)
    assert choice["text"].startswith(tokenizer.decode(tokens, skip_special_tokens=False))
    assert lp["text_offset"][0] == 0
    # The same prompt again: nothing comes from the prefix cache, every position is scored again.
    again = complete(stack, prompt=tokens, echo=True, logprobs=2)
    assert again["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]
    assert again["usage"]["prompt_tokens"] == 40


def test_echo_of_a_text_prompt_without_logprobs_puts_the_prompt_in_front(stack):
    plain = complete(stack, prompt="The capital of France is")
    echoed = complete(stack, prompt="The capital of France is", echo=True)
    assert echoed["choices"][0]["text"] == "The capital of France is" + plain["choices"][0]["text"]
    assert echoed["choices"][0]["logprobs"] is None


def test_every_choice_and_prompt_echoes_its_own_prompt(stack, oracle):
    a, b = prompt_tokens(20, seed=5), prompt_tokens(7, seed=6)
    body = complete(stack, prompt=[a, b], echo=True, logprobs=0, n=2, temperature=1.0, seed=3)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice, prompt in zip(body["choices"], [a, a, b, b]):
        scores = choice["logprobs"]["token_logprobs"][1:len(prompt)]
        want = oracle(prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(torch.tensor(scores), want, atol=2e-4, rtol=0)
        assert len(choice["logprobs"]["tokens"]) == len(prompt) + 2


def test_a_streamed_echo_sends_the_prompt_first(stack, oracle):
    tokens = prompt_tokens(30, seed=7)
    chunks = []
    with httpx.stream("POST", stack.http_url + "/v1/completions", timeout=120, json={
            "prompt": tokens, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None
    want = oracle(tokens)[torch.arange(29), torch.tensor(tokens[1:])]
    torch.testing.assert_close(torch.tensor(first["token_logprobs"][1:30]), want, atol=2e-4, rtol=0)
    streamed = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"][0]["logprobs"])
    assert streamed == 30 + 3


def test_grpc_generate_returns_the_prompt_s_logprobs_on_each_choice_s_first_message(stack, oracle):
    tokens = prompt_tokens(24, seed=8)
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        messages = list(stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=tokens),
            params=gateway_pb2.GenerationParams(max_tokens=3, n=2, temperature=1.0, prompt_logprobs=True))))
    want = oracle(tokens)[torch.arange(23), torch.tensor(tokens[1:])]
    for index in (0, 1):
        mine = [m for m in messages if m.index == index]
        torch.testing.assert_close(torch.tensor(list(mine[0].prompt_logprobs)), want, atol=2e-4, rtol=0)
        assert all(not m.prompt_logprobs for m in mine[1:])
    assert messages[-1].usage.cached_tokens == 0


def test_echo_with_max_tokens_0_scores_the_prompt_alone(stack, oracle):
    """What HELM's language-modelling runs send: the prompt's log-probabilities, no completion."""
    tokens = prompt_tokens(20, seed=9)
    body = complete(stack, prompt=tokens, echo=True, logprobs=1, max_tokens=0)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 20 and lp["token_logprobs"][0] is None
    want = oracle(tokens)[torch.arange(19), torch.tensor(tokens[1:])]
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), want, atol=2e-4, rtol=0)
    text = complete(stack, prompt="Just the prompt", echo=True, max_tokens=0)["choices"][0]
    assert text["text"] == "Just the prompt" and text["finish_reason"] == "length"
    for refused in (dict(max_tokens=0), dict(max_tokens=0, echo=True, n=2)):
        reply = httpx.post(stack.http_url + "/v1/completions", json={"prompt": "x", **refused}, timeout=30)
        assert reply.status_code == 400 and ("max_tokens" in reply.text or "n:" in reply.text), reply.text
    long_text = "A prompt long enough to fill whole KV blocks, sent twice so that the second is a prefix hit. " * 3
    cached = []
    for _ in range(2):  # the second time its whole blocks are cached
        again = complete(stack, prompt=long_text, echo=True, max_tokens=0)
        assert again["choices"][0]["text"] == long_text and again["usage"]["completion_tokens"] == 0
        cached.append(again["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] >= CHUNK_TOKENS
