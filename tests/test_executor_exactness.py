"""The executor against transformers, the independent implementation.

``run_scenario`` plays a tiny scheduler + block manager: all prompts in one batch,
chunked prefill (chunk smaller than the prompts, so prefill chunks and decode
tokens mix in one step), a second prompt that reuses the first one's full prefix
blocks (as the manager's prefix cache would hand them out), and a forked sequence
whose next write into a shared partial block triggers a copy-on-write block copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from executor.runner import ModelRunner, RunnerOptions, SequenceInput
from executor.sampling import SamplingParams

PROMPTS = [
    "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of",
    "The history of the Roman Empire spans many centuries, from the founding of the city to the reign of the emperor who",
    "Water boils at",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    "Translate to French: I would like a cup of coffee, please. Answer:",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to",
]
MAX_NEW = 10
CHUNK = 7


@dataclass
class Seq:
    name: str
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    table: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class ScenarioStats:
    steps: int = 0
    mixed_steps: int = 0  # steps with both prefill chunks and decode tokens
    block_copies: int = 0
    prefix_tokens_reused: int = 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_scenario(runner: ModelRunner, prompts: list[list[int]], max_new: int = MAX_NEW, chunk: int = CHUNK,
                 fork_of: int = 2) -> tuple[dict[str, list[int]], ScenarioStats]:
    """Greedy-generates ``max_new`` tokens for every prompt through ``runner.execute``.
    Prompt 1 starts from prompt 0's cached full blocks; ``fork_of`` is forked mid-decode
    (the fork is named ``fork``). Returns generated tokens by name and what happened."""
    bs = runner.block_size
    free_blocks = list(range(runner.num_blocks - 1, 0, -1))  # block 0 is the null block
    stats = ScenarioStats()
    waiting = [Seq(f"p{i}", list(p), len(p)) for i, p in enumerate(prompts)]
    running = [s for s in waiting if s.name != "p1"]
    shared_candidate = waiting[1]
    shared = common_prefix(prompts[0], prompts[1])
    reuse = min(shared, len(prompts[1]) - 1) // bs * bs  # full blocks only; the last prompt token is recomputed
    done: dict[str, list[int]] = {}
    forked = False
    while running or shared_candidate is not None:
        if shared_candidate is not None and running[0].computed >= reuse:
            shared_candidate.table = running[0].table[: reuse // bs]
            shared_candidate.computed = reuse
            stats.prefix_tokens_reused += reuse
            running.append(shared_candidate)
            shared_candidate = None
        copy_src, copy_dst = [], []
        parent = next((s for s in running if s.name == f"p{fork_of}"), None)
        if not forked and parent is not None and len(parent.generated) >= 2 and parent.computed % bs:
            # Fork: share every block; the parent's partial last block is about to be written
            # by both, so the child gets a fresh copy (copy-on-write).
            child = Seq("fork", list(parent.tokens), parent.prompt_len, list(parent.table), parent.computed)
            new_block = free_blocks.pop()
            copy_src.append(child.table[-1])
            copy_dst.append(new_block)
            child.table[-1] = new_block
            running.append(child)
            forked = True
            stats.block_copies += 1
        batch = []
        for s in running:
            if s.computed < s.prompt_len:
                n = min(chunk, s.prompt_len - s.computed)
            else:
                n = len(s.tokens) - s.computed  # the last sampled token
            while len(s.table) * bs < s.computed + n:
                s.table.append(free_blocks.pop())
            batch.append(SequenceInput(seq_id=len(batch), token_ids=s.tokens[s.computed:s.computed + n],
                                       start_position=s.computed, block_table=list(s.table),
                                       sample=s.computed + n >= s.prompt_len, sampling=SamplingParams()))
        lens = {len(b.token_ids) for b in batch}
        stats.mixed_steps += 1 in lens and len(lens) > 1
        stats.steps += 1
        out = runner.execute(batch, copy_src, copy_dst)
        sampled = iter(out.sampled_token_ids)
        for s, b in zip(running, batch):
            s.computed += len(b.token_ids)
            if b.sample:
                s.tokens.append(next(sampled))
        for s in [s for s in running if len(s.generated) >= max_new]:
            done[s.name] = s.generated[:max_new]
            running.remove(s)
    return done, stats


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_matches_reference(done: dict[str, list[int]], refs: list[list[int]], fork_of: int = 2) -> None:
    for i, ref in enumerate(refs):
        assert done[f"p{i}"][: len(ref)] == ref, f"prompt {i}"
    assert done["fork"][: len(refs[fork_of])] == refs[fork_of], "forked sequence"


# ---- the default model (SmolLM2-135M), fp32 ------------------------------------------------

@pytest.fixture(scope="module")
def prompt_ids(default_model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    return [tokenizer.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_refs(hf_model, prompt_ids):
    with torch.inference_mode():
        return [hf_greedy(hf_model, p, MAX_NEW) for p in prompt_ids]


@pytest.fixture(scope="module")
def hf_logits(hf_model, prompt_ids, hf_refs) -> list[torch.Tensor]:
    """transformers' fp32 logits over each prompt and its greedy continuation: [len, vocab] each."""
    with torch.inference_mode():
        return [hf_model(torch.tensor([p + r])).logits[0].float() for p, r in zip(prompt_ids, hf_refs)]


@pytest.mark.parametrize("block_size", [16, 5])
def test_fp32_greedy_matches_transformers(default_model_dir, prompt_ids, hf_refs, block_size):
    assert len({len(p) for p in prompt_ids}) >= 8 and all(len(p) > 0 for p in prompt_ids)
    runner = ModelRunner(RunnerOptions(default_model_dir, dtype="float32", block_size=block_size, num_blocks=160))
    done, stats = run_scenario(runner, prompt_ids)
    assert stats.mixed_steps >= 1 and stats.block_copies == 1 and stats.prefix_tokens_reused >= block_size
    assert_matches_reference(done, hf_refs)


@pytest.mark.parametrize("cached_prefix", [False, True], ids=["whole-prompt", "cached-prefix"])
def test_bf16_logits_close_to_fp32(default_model_dir, prompt_ids, hf_refs, hf_logits, cached_prefix):
    """Teacher-forced over each prompt and its fp32 greedy continuation, every step's bf16
    logits against transformers' fp32 logits at the same positions. Tolerance per row: the
    log-probabilities of fp32's 5 most likely tokens within 0.6 nats (measured: <= 0.33), and the
    relative RMS error ||bf16 - fp32|| / ||fp32 - mean(fp32)|| over the whole vocabulary <= 0.5
    (measured: <= 0.32; the far tail moves most); argmax agreement >= 90% (measured: 97.8%).
    cached-prefix: each prompt's first tokens (all whole blocks of them, at least one) are written
    by a step of their own first, as a prefix-cache hit leaves them, and the rest attends to them
    from the cache (on an AMX CPU in bf16, the fused prefill kernel over paged blocks)."""
    runner = ModelRunner(RunnerOptions(default_model_dir, dtype="bfloat16", num_blocks=160))
    seqs = [p + r for p, r in zip(prompt_ids, hf_refs)]
    tables = [[1 + 8 * i + j for j in range(8)] for i in range(len(seqs))]
    if cached_prefix:
        prefixes = [max(1, (len(p) - 1) // runner.block_size * runner.block_size) for p in prompt_ids]
        runner.forward_logits([SequenceInput(i, p[:n], 0, tables[i]) for i, (p, n) in enumerate(zip(prompt_ids, prefixes))])
        assert max(prefixes) >= runner.block_size
    agree = total = 0
    worst_rel, worst_top5 = 0.0, 0.0
    failures = []
    for step in range(MAX_NEW):
        if step == 0 and cached_prefix:
            batch = [SequenceInput(i, p[n:], n, tables[i]) for i, (p, n) in enumerate(zip(prompt_ids, prefixes))]
        else:
            batch = [SequenceInput(i, s[:len(p)] if step == 0 else [s[len(p) + step - 1]],
                                   0 if step == 0 else len(p) + step - 1, tables[i])
                     for i, (s, p) in enumerate(zip(seqs, prompt_ids))]
        bf16 = runner.forward_logits(batch)
        for i, p in enumerate(prompt_ids):
            ref = hf_logits[i][len(p) - 1 + step]
            rel = ((bf16[i] - ref).norm() / (ref - ref.mean()).norm()).item()
            top5 = ref.topk(5).indices
            top5_err = (bf16[i].log_softmax(-1)[top5] - ref.log_softmax(-1)[top5]).abs().max().item()
            worst_rel, worst_top5 = max(worst_rel, rel), max(worst_top5, top5_err)
            failures += [f"prompt {i} step {step}: rel {rel:.3f}, top5 {top5_err:.3f}"] * (rel > 0.5 or top5_err > 0.6)
            agree += int(bf16[i].argmax() == ref.argmax())
            total += 1
    print(f"\nbf16 vs fp32: argmax agreement {agree}/{total} ({agree / total:.1%}), "
          f"worst relative RMS error {worst_rel:.4f}, worst top-5 logprob error {worst_top5:.3f} nats")
    assert not failures, failures
    assert agree / total >= 0.9


# ---- Qwen2, Qwen3 and Llama-3 rope scaling on tiny random checkpoints ----------------------

def tiny_checkpoint(tmp_path, arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if arch == "qwen2":  # q/k/v biases, untied LM head
        config, cls = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6), Qwen2ForCausalLM
    elif arch == "qwen3":  # q/k RMSNorm, head_dim 32 != hidden / heads
        config, cls = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1e6), Qwen3ForCausalLM
    else:  # Llama-3 rope scaling
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        config, cls = LlamaConfig(**common, head_dim=16, rope_parameters=rope), LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # random biases/norm weights, so those code paths matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    out = tmp_path / arch
    model.save_pretrained(out, safe_serialization=True)
    return out, model


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3-rope"])
def test_tiny_architectures_match_transformers(tmp_path, arch):
    model_dir, hf = tiny_checkpoint(tmp_path, arch)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 512, (40,), generator=gen).tolist()
    prompts = [shared + [7, 8, 9], shared + [10, 11]] + [
        torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 30, 4, 17, 51, 2)
    ]
    with torch.inference_mode():
        refs = [hf_greedy(hf, p, 16) for p in prompts]
    runner = ModelRunner(RunnerOptions(model_dir, dtype="float32", block_size=8, num_blocks=128))
    done, stats = run_scenario(runner, prompts, max_new=16)
    assert stats.block_copies == 1 and stats.prefix_tokens_reused == 40
    assert_matches_reference(done, refs)
