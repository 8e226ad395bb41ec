"""Speculative drafts verified by the executor (executor.draft_verification).

The embedded model in float32: greedy decoding one token per step is the reference; then
the same prompt decoded with drafts that are all right (the reference's own next tokens),
all wrong, and right for a while then wrong must emit the very same tokens, and accept
exactly the right drafts. Drafts that cannot be verified exactly are refused, naming the
field, with the KV untouched.
"""
from __future__ import annotations

import pytest
import torch

from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from executor.sampling import SamplingParams
from kvserve.errors import InvalidArgument

BLOCK = 16
PROMPT = "Repeat the following list exactly: apples, pears, plums, cherries, figs.\nList: apples,"
NEW = 12


@pytest.fixture(scope="module")
def runner(default_model_dir):
    return ModelRunner(RunnerOptions(default_model_dir, dtype="float32", attention_backend="torch", num_blocks=64,
                                     max_model_len=512))


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)(PROMPT)["input_ids"]


def table_for(first_block: int, num_tokens: int) -> list[int]:
    return list(range(first_block, first_block + -(-num_tokens // BLOCK)))


def plain_greedy(runner: ModelRunner, prompt: list[int], first_block: int) -> list[int]:
    table = table_for(first_block, len(prompt) + NEW + 1)
    tokens = list(prompt)
    out = runner.execute([SequenceInput(1, tokens, 0, table, sample=True)])
    while True:
        tokens.append(out.sampled_token_ids[0])
        if len(tokens) - len(prompt) == NEW:
            return tokens[len(prompt):]
        out = runner.execute([SequenceInput(1, [tokens[-1]], len(tokens) - 1, table, sample=True)])


def drafted_greedy(runner: ModelRunner, prompt: list[int], first_block: int, propose) -> tuple[list[int], list[int]]:
    """Decodes with ``propose(tokens) -> drafts`` each step; returns (output tokens, accepted per step).
    Rejected drafts' KV stays in slots past the sequence's end and is overwritten later, as in serving."""
    table = table_for(first_block, len(prompt) + NEW + 16)
    tokens = list(prompt)
    out = runner.execute([SequenceInput(1, tokens, 0, table, sample=True)])
    tokens.append(out.sampled_token_ids[0])
    accepted = []
    while len(tokens) - len(prompt) < NEW:
        drafts = propose(tokens)
        seq = SequenceInput(1, [tokens[-1]] + drafts, len(tokens) - 1, table, sample=True,
                            num_draft_tokens=len(drafts))
        out = runner.execute([seq])
        n = out.num_accepted_draft_tokens[0] if drafts else 0
        assert len(out.sampled_token_ids) == n + 1 == len(out.sampled_logprobs)
        assert out.sampled_token_ids[:n] == drafts[:n]
        accepted.append(n)
        tokens += out.sampled_token_ids
    return tokens[len(prompt):len(prompt) + NEW], accepted


def test_drafts_right_wrong_and_partly_right_decode_exactly_as_plain_greedy(runner, prompt_ids):
    reference = plain_greedy(runner, prompt_ids, 1)
    full = prompt_ids + reference

    expected: list[int] = []  # the drafts each proposer knows to be right, step by step

    def right(tokens):  # the reference's next tokens: all accepted
        drafts = full[len(tokens):len(tokens) + 4]
        expected.append(len(drafts))
        return drafts

    def wrong(tokens):  # never the next token
        expected.append(0)
        return [(t + 1) % runner.config.vocab_size for t in full[len(tokens):len(tokens) + 3]] or [0]

    def partly(tokens):  # two right, then wrong ones
        nxt = full[len(tokens):len(tokens) + 4]
        expected.append(min(2, len(nxt)))
        return nxt[:2] + [(t + 7) % runner.config.vocab_size for t in nxt[2:]]

    for propose in (right, wrong, partly):
        expected.clear()
        out, accepted = drafted_greedy(runner, prompt_ids, 20, propose)
        assert out == reference, propose.__name__
        assert accepted == expected, propose.__name__


def greedy_with_logprobs(runner: ModelRunner, prompt: list[int], first_block: int, drafts_from=None,
                         sampling: SamplingParams = SamplingParams()):
    """NEW greedy tokens and their logprobs: one token a step, or, given ``drafts_from`` (the answer),
    each step drafting the next 4 of it (every one accepted when it is the answer: the rows of verify
    steps)."""
    table = table_for(first_block, len(prompt) + NEW + 8)
    tokens, logprobs = list(prompt), []
    out = runner.execute([SequenceInput(1, tokens, 0, table, sample=True, sampling=sampling)])
    while True:
        tokens += out.sampled_token_ids
        logprobs += out.sampled_logprobs
        if len(tokens) - len(prompt) >= NEW:
            return tokens[len(prompt):len(prompt) + NEW], logprobs[:NEW]
        drafts = drafts_from[len(tokens) - len(prompt):][:4] if drafts_from else []
        out = runner.execute([SequenceInput(1, [tokens[-1]] + drafts, len(tokens) - 1, table, sample=True,
                                            sampling=sampling, num_draft_tokens=len(drafts))])


@pytest.mark.parametrize("dtype, quantization, kv_cache_dtype", [
    ("bfloat16", "none", "auto"), ("bfloat16", "int8", "auto"), ("bfloat16", "int4", "auto"),
    ("bfloat16", "none", "int8"), ("float32", "none", "auto")])
def test_verify_steps_compute_the_bits_of_plain_decode_steps(default_model_dir, cpu_ops, prompt_ids, dtype,
                                                             quantization, kv_cache_dtype):
    """On the CPU kernels, where a prompt's matmuls round otherwise than a decode step's, a verify
    step runs its rows as decode rows: each accepted token's logprob is bit for bit the one a plain
    decode step gave it, so speculation changes no token even at a near-tie."""
    runner = ModelRunner(RunnerOptions(default_model_dir, dtype=dtype, quantization=quantization,
                                       kv_cache_dtype=kv_cache_dtype, attention_backend="cpu", num_blocks=32,
                                       max_model_len=512))
    tokens, logprobs = greedy_with_logprobs(runner, prompt_ids, 1)
    drafted_tokens, drafted_logprobs = greedy_with_logprobs(runner, prompt_ids, 10, drafts_from=tokens)
    assert drafted_tokens == tokens
    assert drafted_logprobs == logprobs


def test_suppressed_tokens_are_suppressed_at_every_drafted_row(runner, prompt_ids):
    """A request short of min_tokens drafts with its EOS suppressed: each drafted row picks what a
    plain step with the same suppression picks, so a draft of a suppressed token is rejected."""
    free, _ = greedy_with_logprobs(runner, prompt_ids, 1)
    assert free[2] not in free[:2]
    banned = SamplingParams(suppressed_token_ids=(free[2],))
    suppressed, logprobs = greedy_with_logprobs(runner, prompt_ids, 1, sampling=banned)
    assert suppressed[:2] == free[:2] and free[2] not in suppressed
    drafted, drafted_logprobs = greedy_with_logprobs(runner, prompt_ids, 20, drafts_from=suppressed, sampling=banned)
    assert drafted == suppressed
    assert drafted_logprobs == pytest.approx(logprobs, abs=1e-4)
    # Drafts from the unsuppressed answer propose the banned token at output 2: rejected there.
    assert greedy_with_logprobs(runner, prompt_ids, 20, drafts_from=free, sampling=banned)[0] == suppressed


def test_a_batch_mixes_drafted_and_plain_sequences(runner, prompt_ids):
    reference = plain_greedy(runner, prompt_ids, 1)
    table_a, table_b = table_for(20, 200), table_for(40, 200)
    tokens = list(prompt_ids) + reference[:1]
    # Both have the prompt + first token in their KV; A drafts the reference's next 3 tokens, B does not.
    for table in (table_a, table_b):
        runner.execute([SequenceInput(2, tokens[:-1], 0, table, sample=False)])
    seqs = [SequenceInput(7, [tokens[-1]] + reference[1:4], len(tokens) - 1, table_a, sample=True,
                          num_draft_tokens=3),
            SequenceInput(8, [tokens[-1]], len(tokens) - 1, table_b, sample=True)]
    out = runner.execute(seqs)
    assert out.num_accepted_draft_tokens == [3, 0]
    assert out.sampled_token_ids == reference[1:5] + reference[1:2]


@pytest.mark.parametrize("field, sampling", [
    ("temperature", SamplingParams(temperature=0.7)),
    ("top_logprobs", SamplingParams(top_logprobs=2)),
    ("logit_bias_token_ids", SamplingParams(logit_bias_token_ids=(5,), logit_bias_values=(1.0,))),
    ("repetition_penalty", SamplingParams(repetition_penalty=1.3, penalty_token_ids=(5,),
                                          penalty_output_counts=(0,))),
])
def test_drafts_that_cannot_be_verified_exactly_are_refused_naming_the_field(runner, field, sampling):
    cache = [t.clone() for layer in runner.kv_caches for t in layer]  # per layer: (K, V)
    seq = SequenceInput(3, [5, 6, 7], 0, [60], sample=True, sampling=sampling, num_draft_tokens=2)
    with pytest.raises(InvalidArgument, match=f"sampling.{field}"):
        runner.execute([seq])
    assert all(torch.equal(a, b) for a, b in zip(cache, [t for layer in runner.kv_caches for t in layer]))


def test_drafts_need_a_token_before_them_and_sampling(runner):
    with pytest.raises(InvalidArgument, match="num_draft_tokens: 3 drafts in 3 token_ids"):
        runner.execute([SequenceInput(3, [5, 6, 7], 0, [60], sample=True, num_draft_tokens=3)])
    with pytest.raises(InvalidArgument, match="num_draft_tokens: drafts need sample"):
        runner.execute([SequenceInput(3, [5, 6, 7], 0, [60], sample=False, num_draft_tokens=1)])
