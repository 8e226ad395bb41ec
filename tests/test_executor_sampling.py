"""Sampling semantics on synthetic logits (fast), and seeded reproducibility through the runner."""
from __future__ import annotations

import math

import pytest
import torch

from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from executor import sampling
from executor.sampling import SamplingParams, sample, seed_for
from kvserve.errors import InvalidArgument

VOCAB = 1000


def logits(rows: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draw(x: torch.Tensor, params, positions=None, gen_seed: int = 0):
    positions = positions or list(range(len(params)))
    return sample(x, params, positions, torch.Generator().manual_seed(gen_seed))


def test_greedy_is_argmax_with_its_logprob():
    x = logits()
    out = draw(x, [SamplingParams()] * 8)
    assert out.token_ids == x.argmax(-1).tolist()
    expected = x.log_softmax(-1).max(-1).values
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    assert out.top_logprobs is None


def test_compiled_greedy_pick_equals_the_torch_path():
    """The CPU kernels' fused greedy pick: same tokens (first index on ties) and logprobs as argmax +
    log_softmax, on a vocabulary that is not a multiple of the vector width; suppressed ids (what
    min_tokens sends with every step) are masked first and the kernel picks over the rest; batches it
    cannot serve (a sampled row, top logprobs) take the torch path."""
    from executor.attention.cpu_backend import CpuAttentionBackend

    greedy = CpuAttentionBackend(torch.device("cpu")).greedy_sample
    x = logits(8) * 4
    x[3, 10] = x[3, 990] = x[3].max() + 1  # a tie: the first index wins, as in torch.argmax
    x[4, 37] = x[4, 33] = x[4].max() + 1  # a tie inside one vector of 16
    x[5, -1] = x[5].max() + 1  # the maximum in the vector tail
    fused = sample(x, [SamplingParams()] * 8, list(range(8)), torch.Generator(), greedy)
    assert fused.token_ids == x.argmax(-1).tolist() and fused.token_ids[3] == 10 and fused.token_ids[5] == VOCAB - 1
    assert fused.token_ids[4] == 33
    assert fused.logprobs == pytest.approx(x.log_softmax(-1).max(-1).values.tolist(), abs=1e-5)
    for odd_one in (SamplingParams(temperature=0.7, seed=1), SamplingParams(top_logprobs=2)):
        params = [odd_one] + [SamplingParams()] * 7
        with_kernel = sample(x, params, list(range(8)), torch.Generator().manual_seed(0), greedy)
        assert with_kernel == sample(x, params, list(range(8)), torch.Generator().manual_seed(0))
    banned = int(x[0].argmax())
    params = [SamplingParams(suppressed_token_ids=(banned,))] + [SamplingParams()] * 7
    with_kernel = sample(x, params, list(range(8)), torch.Generator(), greedy)
    torch_path = sample(x, params, list(range(8)), torch.Generator())
    assert with_kernel.token_ids == torch_path.token_ids and with_kernel.token_ids[0] != banned
    assert with_kernel.logprobs == pytest.approx(torch_path.logprobs, abs=1e-5)
    assert x[0].argmax() == banned  # the caller's logits are not masked in place


def test_logits_in_bf16_give_what_their_float32_values_give():
    """The model hands its logits over in its own dtype: the compiled pick reads bf16 as it is, the
    torch path widens them first; either way the result is that of the widened logits."""
    from executor.attention.cpu_backend import CpuAttentionBackend

    greedy = CpuAttentionBackend(torch.device("cpu")).greedy_sample
    x = (logits(8) * 4).to(torch.bfloat16)
    x[2, 7] = x[2, 700] = x[2].max() + 1  # a tie in bf16: the first index wins
    widened = x.float()
    for params in ([SamplingParams()] * 8,
                   [SamplingParams(suppressed_token_ids=(int(x[0].argmax()),))] + [SamplingParams()] * 7,
                   [SamplingParams(temperature=0.7, seed=3)] + [SamplingParams(top_logprobs=2)] * 7):
        for pick in (greedy, None):
            got = sample(x, params, list(range(8)), torch.Generator().manual_seed(0), pick)
            want = sample(widened, params, list(range(8)), torch.Generator().manual_seed(0))
            assert got.token_ids == want.token_ids and got.top_logprobs == want.top_logprobs
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert sample(x, [SamplingParams()] * 8, list(range(8)), torch.Generator(), greedy).token_ids[2] == 7
    assert torch.equal(x.float(), widened)  # the caller's logits are not masked in place


def test_top_k_one_equals_greedy():
    x = logits(32)
    params = [SamplingParams(temperature=1.3, top_k=1)] * 32
    assert draw(x, params, gen_seed=5).token_ids == x.argmax(-1).tolist()


def test_seed_reproducible_independent_of_batch():
    x = logits(4)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    alone = draw(x[2:3], [seeded], positions=[17], gen_seed=1).token_ids[0]
    in_batch = draw(x, [other, other, seeded, other], positions=[3, 4, 17, 9], gen_seed=99).token_ids[2]
    assert alone == in_batch
    # Different positions or seeds give different draws (a flat distribution makes collisions rare).
    flat = torch.zeros(1, VOCAB)
    tokens = {draw(flat, [SamplingParams(temperature=1.0, seed=7)], positions=[p]).token_ids[0] for p in range(20)}
    assert len(tokens) >= 15
    assert seed_for(7, 0) != seed_for(8, 0) != seed_for(7, 1)


def test_unseeded_draws_vary_and_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3))
    x = probs.clamp_min(1e-30).log().expand(4000, VOCAB)
    out = draw(x, [SamplingParams(temperature=1.0)] * 4000)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=3)[:3].float() / 4000
    assert counts.tolist() == pytest.approx([0.5, 0.3, 0.2], abs=0.04)


def test_draws_reach_both_ends_of_the_vocabulary_and_never_an_impossible_token():
    # The draw inverts the cumulative distribution: the first and last tokens' intervals, and
    # those of tokens of probability 0 between allowed ones (width 0), are where it could go wrong.
    for allowed in ([0], [VOCAB - 1], [3, VOCAB - 1]):
        x = torch.full((200, VOCAB), -math.inf)
        x[:, allowed] = 0.0
        for params in ([SamplingParams(temperature=1.0)] * 200,
                       [SamplingParams(temperature=1.0, seed=s) for s in range(200)]):
            assert set(draw(x, params).token_ids) == set(allowed)
    # Every other token allowed, equally likely: each quarter of the vocabulary gets its share.
    x = torch.full((4000, VOCAB), -math.inf)
    x[:, 1::2] = 0.0
    tokens = torch.tensor(draw(x, [SamplingParams(temperature=1.0)] * 4000).token_ids)
    assert (tokens % 2 == 1).all()
    shares = torch.bincount(tokens * 4 // VOCAB, minlength=4).float() / 4000
    assert shares.tolist() == pytest.approx([0.25] * 4, abs=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4))
    x = probs.clamp_min(1e-30).log().expand(500, VOCAB)
    tokens = set(draw(x, [SamplingParams(temperature=1.0, top_p=0.7)] * 500).token_ids)
    assert tokens == {0, 1}
    tokens = set(draw(x, [SamplingParams(temperature=1.0, top_k=3)] * 500).token_ids)
    assert tokens == {0, 1, 2}


def test_top_k_top_p_from_the_most_likely_candidates_equal_the_full_sort(monkeypatch):
    monkeypatch.setattr(sampling, "TOP_CANDIDATES", 64)
    gen = torch.Generator().manual_seed(3)
    # Peaked rows (the candidates hold top_p), flat rows (they do not: the full sort), -inf masks.
    x = torch.cat([torch.randn(6, VOCAB, generator=gen) * 8, torch.randn(6, VOCAB, generator=gen) * 0.1])
    x[::3, :500] = -math.inf
    cases = [(0, 0.9), (10, 1.0), (10, 0.5), (64, 0.95), (65, 1.0), (300, 0.8), (0, 0.999), (VOCAB, 0.7),
             (0, 1.0), (1, 0.3), (100, 1.0), (0, 0.2)]
    top_k = torch.tensor([k for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases])
    fast = sampling._filter_top_k_top_p(x, top_k, top_p)
    full = sampling._filter_sorted(x, top_k, top_p)
    assert torch.equal(fast.isfinite(), full.isfinite())
    assert torch.equal(fast[fast.isfinite()], full[full.isfinite()])
    assert (fast.isfinite().sum(-1) < VOCAB).any() and (fast.isfinite().sum(-1) > 64).any()


def test_suppressed_ids_are_never_sampled():
    x = logits(1).expand(300, VOCAB).clone()
    top = x[0].topk(5).indices.tolist()
    params = [SamplingParams(temperature=0.7, suppressed_token_ids=tuple(top))] * 299 + \
             [SamplingParams(suppressed_token_ids=tuple(top))]
    out = draw(x, params)
    assert not set(out.token_ids) & set(top)
    assert out.token_ids[-1] == x[0].topk(6).indices[5].item()  # greedy takes the best one left


def test_logprobs_and_top_logprobs_are_consistent():
    x = logits(3)
    params = [SamplingParams(temperature=0.5, top_logprobs=4, seed=1), SamplingParams(),
              SamplingParams(top_logprobs=2)]
    out = draw(x, params)
    scaled = torch.stack([x[0] / 0.5, x[1], x[2]]).log_softmax(-1)
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(scaled[row, token].item(), abs=1e-5)
        assert out.logprobs[row] <= 0
    ids, lps = out.top_logprobs[0]
    assert len(ids) == 4 and lps == sorted(lps, reverse=True)
    assert ids == scaled[0].topk(4).indices.tolist()
    assert math.fsum(math.exp(v) for v in scaled[0].tolist()) == pytest.approx(1.0, abs=1e-4)
    assert out.top_logprobs[1] == ([], [])
    assert out.top_logprobs[2][0] == [out.token_ids[2], scaled[2].topk(2).indices[1].item()]


@pytest.mark.parametrize("params,field", [
    (SamplingParams(temperature=-1.0), "temperature"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_logprobs=1000), "top_logprobs"),
    (SamplingParams(suppressed_token_ids=(VOCAB,)), "suppressed_token_ids[0]"),
])
def test_bad_sampling_params_name_the_field(params, field):
    with pytest.raises(InvalidArgument, match=field.replace("[", r"\[").replace("]", r"\]")):
        params.validate("sampling", VOCAB)


def test_runner_seeded_sampling_is_reproducible(tiny_model_dir):
    runner = ModelRunner(RunnerOptions(tiny_model_dir, dtype="float32", num_blocks=32))
    prompt = list(range(100, 120))
    seeded = SamplingParams(temperature=1.0, seed=42, top_p=0.9)

    def one(seq_first: bool, extra: int) -> int:
        seqs = [SequenceInput(1, prompt, 0, [1, 2], sample=True, sampling=seeded)]
        others = [SequenceInput(2, list(range(5, 5 + extra)), 0, [3, 4, 5, 6], sample=True,
                                sampling=SamplingParams(temperature=1.0))]
        batch = seqs + others if seq_first else others + seqs
        out = runner.execute(batch)
        return out.sampled_token_ids[0 if seq_first else 1]

    assert len({one(True, 3), one(False, 40), one(True, 17)}) == 1
