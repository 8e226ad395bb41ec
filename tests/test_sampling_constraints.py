"""SamplingParams fields 7-15 (bitmask, logit_bias, penalties, min_p) against a reference computed
here, row by row in plain float32 torch from executor.proto's wording; then validation, and one
step through ``run_step`` (proto in, proto out) on the tiny model."""
from __future__ import annotations

import math

import pytest
import torch

from executor.sampling import SamplingParams, sample
from kvserve.errors import InvalidArgument

VOCAB = 1003  # not a multiple of 8: the last byte of a bitmask has bits past the vocabulary
NEED = -(-VOCAB // 8)  # 126 bytes
MOST = -(-NEED // 4) * 4  # 128
MASK64 = (1 << 64) - 1


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def bitmask(allowed: set[int], size: int = NEED, junk: bool = False) -> bytes:
    """LSB first; ``junk`` sets every bit past the vocabulary (which must be ignored)."""
    out = bytearray(size)
    for t in allowed:
        out[t // 8] |= 1 << (t % 8)
    if junk:
        for t in range(VOCAB, size * 8):
            out[t // 8] |= 1 << (t % 8)
    return bytes(out)


# ---- the reference --------------------------------------------------------------------------------


def ref_edit(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """executor.proto's steps up to temperature, one token at a time, float32."""
    y = row.float().clone()
    for t in p.suppressed_token_ids:
        y[t] = -math.inf
    if p.allowed_token_bitmask:
        for t in range(VOCAB):
            if not (p.allowed_token_bitmask[t // 8] >> (t % 8)) & 1:
                y[t] = -math.inf
    for t, v in zip(p.logit_bias_token_ids, p.logit_bias_values):
        y[t] = y[t] + torch.tensor(v, dtype=torch.float32)
    rp = torch.tensor(p.repetition_penalty, dtype=torch.float32)
    for t, count in zip(p.penalty_token_ids, p.penalty_output_counts):
        v = y[t]
        if p.repetition_penalty not in (0.0, 1.0):
            v = v / rp if v > 0 else v * rp
        if count > 0:
            v = v - torch.tensor(p.frequency_penalty, dtype=torch.float32) * count
            v = v - torch.tensor(p.presence_penalty, dtype=torch.float32)
        y[t] = v
    return y


def ref_logprobs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    y = ref_edit(row, p)
    if p.temperature > 0:
        y = y / torch.tensor(p.temperature, dtype=torch.float32)
    return y.log_softmax(-1)


def ref_kept(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Bool [vocab]: the tokens a random row may draw (finite after the edits, min_p)."""
    probs = ref_logprobs(row, p).exp()
    kept = probs > 0
    if p.min_p > 0:
        kept &= probs >= p.min_p * probs.max()
    return kept


def splitmix(seed: int, position: int) -> int:
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def ref_token(row: torch.Tensor, p: SamplingParams, position: int) -> int:
    """Greedy: argmax of the edited logits. Seeded: the cumulative distribution of the kept tokens,
    inverted at one uniform of the (seed, position) generator."""
    if p.temperature == 0:
        return int(ref_edit(row, p).argmax())
    assert p.seed is not None and not p.top_k and not p.top_p
    scaled = ref_logprobs(row, p).masked_fill(~ref_kept(row, p), -math.inf)
    cdf = scaled.softmax(-1).double().cumsum(-1)
    u = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(splitmix(p.seed, position)))
    return int((cdf <= u * cdf[-1]).sum())  # the tokens whose whole interval lies below the target


def check_against_reference(x: torch.Tensor, params: list[SamplingParams], greedy=None):
    positions = [7 + r for r in range(len(params))]
    out = sample(x, params, positions, torch.Generator().manual_seed(0), greedy)
    for r, p in enumerate(params):
        want = ref_token(x[r], p, positions[r])
        assert out.token_ids[r] == want, (r, p)
        assert out.logprobs[r] == pytest.approx(ref_logprobs(x[r], p)[want].item(), abs=1e-5), r
    return out


# ---- bitmask ---------------------------------------------------------------------------------------


def test_bitmask_rows_pick_the_reference_token_and_never_a_disallowed_one():
    x = logits(1).expand(240, VOCAB).clone()
    gen = torch.Generator().manual_seed(1)
    allowed = (set(torch.randperm(VOCAB, generator=gen)[:40].tolist()) | {VOCAB - 1}) - {int(x[0].argmax())}
    params = []
    for r in range(240):
        size, junk = ((NEED, False), (MOST, False), (MOST, True), (NEED, True))[r % 4]  # padded, junk past vocab
        mask = bitmask(allowed, size, junk)
        params.append(SamplingParams(allowed_token_bitmask=mask) if r % 6 == 0 else
                      SamplingParams(temperature=1.5, seed=r, allowed_token_bitmask=mask))
    for p in params:
        p.validate("sampling", VOCAB)
    out = check_against_reference(x, params)
    assert set(out.token_ids) <= allowed
    assert len(set(out.token_ids)) > 5  # the seeded rows spread over the allowed tokens
    best = max(allowed, key=lambda t: x[0, t].item())
    assert out.token_ids[0] == best


def test_bitmask_allowing_one_token_yields_it_with_logprob_zero():
    x = logits(3, seed=2)
    params = [SamplingParams(allowed_token_bitmask=bitmask({5})),
              SamplingParams(temperature=0.7, seed=3, top_k=0, allowed_token_bitmask=bitmask({VOCAB - 1}, MOST)),
              SamplingParams(temperature=1.0, top_logprobs=3, allowed_token_bitmask=bitmask({9}))]
    out = sample(x, params, [0, 1, 2], torch.Generator())
    assert out.token_ids == [5, VOCAB - 1, 9] and out.logprobs == [0.0, 0.0, 0.0]
    assert out.top_logprobs[2][0][0] == 9 and out.top_logprobs[2][1][1:] == [-math.inf, -math.inf]


def test_bitmask_and_edits_through_the_compiled_greedy_pick(cpu_ops):
    """All-greedy batches keep the compiled pick: it gets the edited logits and agrees with the
    reference (and with the torch path); the caller's logits are left alone."""
    x = logits(6, seed=4) * 2
    before = x.clone()
    top = x.topk(4, dim=-1).indices
    params = [SamplingParams(allowed_token_bitmask=bitmask({1, 2, 3, int(top[0, 2])})),
              SamplingParams(logit_bias_token_ids=(int(top[1, 3]),), logit_bias_values=(20.0,)),
              SamplingParams(frequency_penalty=2.0, penalty_token_ids=(int(top[2, 0]),), penalty_output_counts=(30,)),
              SamplingParams(repetition_penalty=1e6, penalty_token_ids=(int(top[3, 0]),),
                             penalty_output_counts=(0,)),
              SamplingParams(suppressed_token_ids=(int(top[4, 0]),), min_p=1.0),
              SamplingParams()]
    compiled = check_against_reference(x, params, cpu_ops.greedy_sample)
    assert compiled.token_ids[:5] == [int(top[0, 2]), int(top[1, 3]), int(top[2, 1]), int(top[3, 1]),
                                      int(top[4, 1])]
    for dtype in (torch.float32, torch.bfloat16):
        y = x.to(dtype)
        with_kernel = sample(y, params, list(range(6)), torch.Generator(), cpu_ops.greedy_sample)
        torch_path = sample(y, params, list(range(6)), torch.Generator())
        assert with_kernel.token_ids == torch_path.token_ids
        assert with_kernel.logprobs == pytest.approx(torch_path.logprobs, abs=1e-5)
    assert torch.equal(x, before)


# ---- logit_bias and penalties --------------------------------------------------------------------


def test_logit_bias_changes_the_greedy_pick_as_the_reference_says():
    x = logits(5, seed=5)
    ranked = x.sort(dim=-1, descending=True).indices
    gap = [(x[r, ranked[r, 0]] - x[r, ranked[r, 9]]).item() for r in range(5)]
    params = [
        SamplingParams(logit_bias_token_ids=(int(ranked[0, 9]),), logit_bias_values=(gap[0] + 0.5,)),
        SamplingParams(logit_bias_token_ids=(int(ranked[1, 0]), int(ranked[1, 1])), logit_bias_values=(-100.0, -100.0)),
        SamplingParams(logit_bias_token_ids=(int(ranked[2, 9]),), logit_bias_values=(gap[2] - 0.5,)),  # not enough
        SamplingParams(temperature=0.5, seed=11, logit_bias_token_ids=(int(ranked[3, 500]),),
                       logit_bias_values=(100.0,)),
        SamplingParams(top_logprobs=2, logit_bias_token_ids=(3, 4, int(ranked[4, 0])),
                       logit_bias_values=(1.5, -2.0, 0.0)),
    ]
    out = check_against_reference(x, params)
    assert out.token_ids[:4] == [int(ranked[0, 9]), int(ranked[1, 2]), int(ranked[2, 0]), int(ranked[3, 500])]
    ids, lps = out.top_logprobs[4]
    reference = ref_logprobs(x[4], params[4]).topk(2)
    assert ids == reference.indices.tolist() and lps == pytest.approx(reference.values.tolist(), abs=1e-5)


def test_penalties_match_the_reference_pick_and_logprob():
    x = logits(8, seed=6)
    ranked = x.sort(dim=-1, descending=True).indices.tolist()
    negative = [[t for t in row if x[r, t] < 0][:3] for r, row in enumerate(ranked)]

    def listed(r, counts):
        ids = tuple(ranked[r][:len(counts) - 3]) + tuple(negative[r])
        return dict(penalty_token_ids=ids, penalty_output_counts=tuple(counts))

    params = [
        SamplingParams(presence_penalty=2.0, **listed(0, (1, 1, 0, 2, 0, 1))),
        SamplingParams(frequency_penalty=1.5, **listed(1, (3, 0, 1, 1, 5, 0))),
        SamplingParams(repetition_penalty=1.8, **listed(2, (0, 0, 0, 0, 0, 0))),
        SamplingParams(repetition_penalty=0.5, **listed(3, (0, 0, 0, 4, 0, 0))),  # < 1 favours them
        SamplingParams(presence_penalty=-2.0, frequency_penalty=0.5, repetition_penalty=1.3,
                       **listed(4, (2, 0, 1, 0, 3, 1))),
        SamplingParams(temperature=0.8, seed=9, presence_penalty=1.0, frequency_penalty=2.0, repetition_penalty=1.2,
                       **listed(5, (4, 2, 0, 1, 0, 0))),
        SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, **listed(6, (9, 9, 9, 9, 9, 9))),  # all off
        SamplingParams(temperature=1.3, seed=10, frequency_penalty=-1.0, top_logprobs=5,
                       **listed(7, (0, 3, 0, 1, 1, 1))),
    ]
    for p in params:
        p.validate("sampling", VOCAB)
    out = check_against_reference(x, params)
    # The penalties did something: the greedy picks of rows 0, 1, 2 moved off the plain argmax.
    assert all(out.token_ids[r] != ranked[r][0] for r in (0, 1, 2)) and out.token_ids[6] == ranked[6][0]
    ids, lps = out.top_logprobs[7]
    reference = ref_logprobs(x[7], params[7]).topk(5)
    assert ids == reference.indices.tolist() and lps == pytest.approx(reference.values.tolist(), abs=1e-5)


# ---- min_p -----------------------------------------------------------------------------------------


def test_min_p_drops_what_the_reference_drops():
    probs = torch.tensor([0.40, 0.25, 0.17, 0.078, 0.05, 0.03] + [0.022 / (VOCAB - 6)] * (VOCAB - 6))
    x = probs.log().expand(400, VOCAB).clone()
    params = [SamplingParams(temperature=1.0, seed=s, min_p=0.2) for s in range(300)] + \
             [SamplingParams(temperature=2.0, seed=s, min_p=0.4) for s in range(99)] + [SamplingParams(min_p=1.0)]
    params[299] = SamplingParams(temperature=1.0, seed=299, min_p=1.0)  # keeps only the most likely
    kept_02 = set(ref_kept(x[0], params[0]).nonzero().view(-1).tolist())
    kept_04 = set(ref_kept(x[0], params[300]).nonzero().view(-1).tolist())
    # 0.078 < 0.2 * 0.40; at T = 2 the ratios are square roots: sqrt(0.078 / 0.40) = 0.44 >= 0.4 stays.
    assert kept_02 == {0, 1, 2} and kept_04 == {0, 1, 2, 3}
    out = check_against_reference(x, params)
    assert set(out.token_ids[:300]) == kept_02 and set(out.token_ids[300:399]) <= kept_04
    assert out.token_ids[399] == out.token_ids[299] == 0
    # min_p comes after the reported logprobs: they are those of the unfiltered distribution.
    assert out.logprobs[0] == pytest.approx(math.log(probs[out.token_ids[0]]), abs=1e-5)


def test_min_p_then_top_p_renormalizes_over_the_kept_tokens():
    probs = torch.tensor([0.30, 0.28, 0.12, 0.10] + [0.20 / (VOCAB - 4)] * (VOCAB - 4))
    x = probs.log().expand(300, VOCAB).clone()
    # min_p 0.3 keeps {0, 1, 2, 3} (mass 0.8); top_p 0.7 of those (0.375, 0.35, ...) keeps {0, 1}.
    params = [SamplingParams(temperature=1.0, min_p=0.3, top_p=0.7)] * 300
    assert set(sample(x, params, list(range(300)), torch.Generator().manual_seed(0)).token_ids) == {0, 1}


# ---- batches -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(dtype):
    x = logits(10, seed=8).to(dtype)
    top = x.float().topk(3, dim=-1).indices
    plain = [SamplingParams(), SamplingParams(temperature=0.9, seed=1), SamplingParams(top_logprobs=4),
             SamplingParams(temperature=1.2, seed=2, top_k=50, top_p=0.9, top_logprobs=2), SamplingParams()]
    constrained = [SamplingParams(allowed_token_bitmask=bitmask({1, 2})),
                   SamplingParams(temperature=0.5, seed=3, logit_bias_token_ids=(4,), logit_bias_values=(50.0,),
                                  min_p=0.1),
                   SamplingParams(frequency_penalty=2.0, penalty_token_ids=(int(top[7, 0]),),
                                  penalty_output_counts=(9,)),
                   SamplingParams(temperature=1.0, seed=4, repetition_penalty=2.0, top_logprobs=1,
                                  penalty_token_ids=(0, 1), penalty_output_counts=(0, 0)),
                   SamplingParams(suppressed_token_ids=(int(top[9, 0]),))]
    alone = sample(x[0:5], plain, [3, 4, 5, 6, 7], torch.Generator().manual_seed(0))
    mixed_rows = [0, 5, 1, 6, 2, 7, 3, 8, 4, 9]  # plain rows interleaved with constrained ones
    batch = torch.cat([x[0:5], x[5:10]])[mixed_rows]
    params = [(plain + constrained)[r] for r in mixed_rows]
    positions = [([3, 4, 5, 6, 7] + [20, 21, 22, 23, 24])[r] for r in mixed_rows]
    mixed = sample(batch, params, positions, torch.Generator().manual_seed(0))
    assert [mixed.token_ids[i] for i in (0, 2, 4, 6, 8)] == alone.token_ids
    assert [mixed.logprobs[i] for i in (0, 2, 4, 6, 8)] == alone.logprobs
    assert [mixed.top_logprobs[i] for i in (0, 2, 4, 6, 8)] == alone.top_logprobs
    assert mixed.token_ids[1] in (1, 2) and mixed.token_ids[3] == 4 and mixed.token_ids[5] != int(top[7, 0])


def test_an_unconstrained_batch_is_not_copied():
    """No row edits its logits: no copy, no float32 widening before the compiled pick."""
    from executor.logit_processors import edit_logits

    x = logits(4).to(torch.bfloat16)
    assert edit_logits(x, [SamplingParams(temperature=1.0, seed=1, top_k=5, min_p=0.2)] * 4) is x
    # Penalty ids listed with every penalty off: nothing to compute either (ids are still validated).
    off = SamplingParams(repetition_penalty=1.0, penalty_token_ids=(1,), penalty_output_counts=(3,))
    assert edit_logits(x, [off] * 4) is x


# ---- validation ----------------------------------------------------------------------------------


BAD = {
    "bitmask too short": (dict(allowed_token_bitmask=bitmask({1}, NEED - 1)), "allowed_token_bitmask"),
    "bitmask too long": (dict(allowed_token_bitmask=bitmask({1}, MOST + 1)), "allowed_token_bitmask"),
    "bitmask allows nothing": (dict(allowed_token_bitmask=bitmask(set(), MOST, junk=True)), "allowed_token_bitmask"),
    "bitmask all suppressed": (dict(allowed_token_bitmask=bitmask({3, 4}), suppressed_token_ids=(4, 2, 3)),
                               "allowed_token_bitmask"),
    "bias id >= vocab": (dict(logit_bias_token_ids=(1, VOCAB), logit_bias_values=(1.0, 1.0)),
                         "logit_bias_token_ids[1]"),
    "bias id < 0": (dict(logit_bias_token_ids=(-1,), logit_bias_values=(1.0,)), "logit_bias_token_ids[0]"),
    "bias id repeated": (dict(logit_bias_token_ids=(5, 6, 5), logit_bias_values=(1.0, 2.0, 3.0)),
                         "logit_bias_token_ids"),
    "bias value nan": (dict(logit_bias_token_ids=(5,), logit_bias_values=(math.nan,)), "logit_bias_values[0]"),
    "bias value inf": (dict(logit_bias_token_ids=(5,), logit_bias_values=(-math.inf,)), "logit_bias_values[0]"),
    "bias value > 100": (dict(logit_bias_token_ids=(5, 6), logit_bias_values=(1.0, 100.5)), "logit_bias_values[1]"),
    "bias value < -100": (dict(logit_bias_token_ids=(5,), logit_bias_values=(-101.0,)), "logit_bias_values[0]"),
    "bias lists unequal": (dict(logit_bias_token_ids=(5, 6), logit_bias_values=(1.0,)), "logit_bias_values"),
    "penalty id >= vocab": (dict(penalty_token_ids=(VOCAB,), penalty_output_counts=(1,)), "penalty_token_ids[0]"),
    "penalty id < 0": (dict(penalty_token_ids=(0, -3), penalty_output_counts=(1, 1)), "penalty_token_ids[1]"),
    "penalty id repeated": (dict(penalty_token_ids=(4, 4), penalty_output_counts=(1, 1)), "penalty_token_ids"),
    "penalty lists unequal": (dict(penalty_token_ids=(4,), penalty_output_counts=()), "penalty_output_counts"),
    "presence nan": (dict(presence_penalty=math.nan), "presence_penalty"),
    "presence > 2": (dict(presence_penalty=2.5), "presence_penalty"),
    "frequency < -2": (dict(frequency_penalty=-2.01), "frequency_penalty"),
    "frequency inf": (dict(frequency_penalty=math.inf), "frequency_penalty"),
    "repetition < 0": (dict(repetition_penalty=-0.5), "repetition_penalty"),
    "repetition inf": (dict(repetition_penalty=math.inf), "repetition_penalty"),
    "repetition nan": (dict(repetition_penalty=math.nan), "repetition_penalty"),
    "min_p < 0": (dict(min_p=-0.1), "min_p"),
    "min_p > 1": (dict(min_p=1.5), "min_p"),
    "min_p nan": (dict(min_p=math.nan), "min_p"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_invalid_constraints_name_the_field(name):
    fields, field = BAD[name]
    pattern = r"^sequences\[0\]\.sampling\." + field.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(InvalidArgument, match=pattern):
        SamplingParams(**fields).validate("sequences[0].sampling", VOCAB)


def test_the_limits_themselves_are_valid():
    for fields in (dict(allowed_token_bitmask=bitmask({VOCAB - 1}, MOST, junk=True)),
                   dict(allowed_token_bitmask=bitmask({3, 4}), suppressed_token_ids=(3,)),
                   dict(logit_bias_token_ids=(0, VOCAB - 1), logit_bias_values=(-100.0, 100.0)),
                   dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.0),
                   dict(penalty_token_ids=(0, VOCAB - 1), penalty_output_counts=(0, 2**32 - 1)),
                   dict(min_p=0.0), dict(min_p=1.0)):
        SamplingParams(**fields).validate("sampling", VOCAB)


# ---- through run_step (proto in, proto out) --------------------------------------------------------


def test_a_step_through_run_step_applies_the_proto_fields(tiny_model_dir):
    from executor.runner import ModelRunner, RunnerOptions
    from executor.service import run_step
    from kvserve.v1 import executor_pb2 as pb

    runner = ModelRunner(RunnerOptions(tiny_model_dir, dtype="float32", num_blocks=16))
    vocab = runner.info.vocab_size
    prompt = list(range(100, 120))

    def step(table, **sampling):
        request = pb.ExecuteRequest(sequences=[pb.ExecuteSequence(
            seq_id=table[0], token_ids=prompt, start_position=0, block_table=table, sample=True,
            sampling=pb.SamplingParams(**sampling))])
        return run_step(runner, request, 0.0)

    plain = step([1, 2], top_logprobs=3)
    first, second = plain.top_logprobs[0].token_ids[:2]
    only = bytearray(-(-vocab // 8))
    only[4321 // 8] |= 1 << (4321 % 8)
    for table, sampling in (([3, 4], {}), ([5, 6], dict(temperature=1.0, seed=5))):
        reply = step(table, allowed_token_bitmask=bytes(only), **sampling)
        assert list(reply.sampled_token_ids) == [4321] and reply.sampled_logprobs[0] == 0.0
    biased = step([7, 8], logit_bias_token_ids=[77], logit_bias_values=[100.0])
    assert list(biased.sampled_token_ids) == [77]
    penalized = step([9, 10], frequency_penalty=2.0, presence_penalty=2.0, penalty_token_ids=[first, second],
                     penalty_output_counts=[50, 0])  # the count-0 one keeps its logit
    assert list(penalized.sampled_token_ids) == [second]
    with pytest.raises(InvalidArgument, match=r"sequences\[0\] \(seq_id 11\)\.sampling\.allowed_token_bitmask"):
        step([11, 12], allowed_token_bitmask=bytes(len(only)))
    with pytest.raises(InvalidArgument, match=r"sampling\.min_p"):
        step([11, 12], min_p=2.0)
