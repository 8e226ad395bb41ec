"""One executor step: validate the batch, copy blocks, run the model, sample.

Everything about a batch is checked on the host before any tensor is touched,
so a rejected batch (``InvalidArgument`` naming the field) leaves every
sequence's KV as it was. Slot mapping and block tables are built here, once per
step, vectorized; the model and attention backend only see tensors.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from executor.attention import AttentionMetadata, create_backend
from executor.draft_verification import accept, check_drafts, logit_rows
from executor.devices import (device_module, dtype_name, resolve_dtype, resolve_device, resolve_kv_cache_dtype,
                              synchronize)
from executor.host_memory import available_bytes
from executor.kv_cache import KVSizing, max_concurrency, size_kv_cache
from executor.kv_tier import DEFAULT_STORE_CAPACITY_BYTES, BlockMover, store_namespace
from executor.loader import eos_token_ids, load_model, model_fingerprint
from kvserve.identity import new_instance_id, tokenizer_fingerprint
from executor.model import ModelConfig
from executor.prompt_logprobs import PromptLogprobs, check_prompt_logprobs, score_rows
from executor.sampling import SampleResult, SamplingParams, sample
from kvserve.errors import InvalidArgument
from kvserve.kv_store import StoreError, describe_url, open_store
from kvserve.store_orders import StoreOrders
from kvserve.logs import get_logger

log = get_logger("executor.runner")


@dataclass
class RunnerOptions:
    model_dir: Path
    dtype: str = "auto"
    quantization: str = "none"  # none, int8 or int4: the projections' weights (executor/quantization.py)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), bfloat16 or int8 (executor/attention/cpu_backend.py)
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    served_model_name: str | None = None
    seed: int = 0
    profile_tokens: int = 2048  # tokens of the activation-profiling forward on a device
    kv_store: str = ""  # the store tier's URL (kvserve.kv_store.open_store); empty: none
    kv_store_capacity: int = DEFAULT_STORE_CAPACITY_BYTES  # bytes of this namespace's entries kvmanager keeps


@dataclass
class SequenceInput:
    seq_id: int
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool = False
    sampling: SamplingParams = field(default_factory=SamplingParams)
    store_load_block_ids: list[int] = field(default_factory=list)
    store_load_hashes: list[bytes] = field(default_factory=list)
    num_draft_tokens: int = 0  # the last n of token_ids are speculative drafts (executor.draft_verification)
    # The tokens after this step's first rows, whose log-probabilities to return (executor.prompt_logprobs).
    prompt_logprob_token_ids: list[int] = field(default_factory=list)
    prompt_top_logprobs: int = 0


@dataclass
class StepOutput:
    sampled_token_ids: list[int]
    sampled_logprobs: list[float]
    top_logprobs: list[tuple[list[int], list[float]]] | None
    num_tokens: int
    copy_ms: float
    forward_ms: float
    sample_ms: float
    total_ms: float
    store_ms: float = 0.0
    dropped_seq_ids: list[int] = field(default_factory=list)  # a store load missed: not run
    store_missing_hashes: list[bytes] = field(default_factory=list)
    store_saves_ok: list[bool] = field(default_factory=list)
    # Per sampled sequence, when any carried drafts: drafts accepted (sampled_token_ids then holds
    # that many + 1 tokens for it); empty otherwise.
    num_accepted_draft_tokens: list[int] = field(default_factory=list)
    # One per sequence with prompt_logprob_token_ids, in step order.
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


@dataclass(frozen=True)
class RunnerDescription:
    """What this runner serves; field for field ``kvserve.v1.DescribeResponse``."""

    model_name: str
    model_fingerprint: str
    architecture: str
    dtype: str
    device: str
    attention_backend: str
    block_size: int
    num_blocks: int
    kv_bytes_per_block: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_layers: int
    model_path: str
    instance_id: str
    tokenizer_fingerprint: str
    kv_store: str = ""
    kv_store_namespace: str = ""
    kv_store_capacity_blocks: int = 0
    verifies_draft_tokens: bool = True
    verifies_drafts_with_suppressed_tokens: bool = True
    returns_prompt_logprobs: bool = True


class ModelRunner:
    """Owns the weights and the paged KV cache of one model on one device."""

    def __init__(self, options: RunnerOptions):
        model_dir = Path(options.model_dir)
        config = ModelConfig.from_dir(model_dir)
        self.config = config
        self.device = resolve_device(options.device)
        self.dtype = resolve_dtype(options.dtype, config, self.device)
        self.block_size = options.block_size
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        self.max_model_len = min(options.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.backend = create_backend(options.attention_backend, self.device, options.kv_cache_dtype)
        self.kv_cache_dtype = resolve_kv_cache_dtype(options.kv_cache_dtype, options.dtype, config, self.dtype,
                                                     self.backend.reads_other_kv_dtype)
        self.kv_dtype = torch.bfloat16 if self.kv_cache_dtype == "bfloat16" else self.dtype  # what allocate takes
        if self.kv_dtype != self.dtype and not self.backend.reads_other_kv_dtype:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} with --dtype {dtype_name(self.dtype)} needs an "
                             f"attention backend that reads a cache of another dtype (cpu or torch), not "
                             f"{self.backend.name}")
        start = time.monotonic()
        self.quantization = options.quantization
        self.model = load_model(model_dir, self.dtype, self.device, self.max_model_len, self.quantization,
                                skinny_ops=self.backend.skinny_matmul_ops)
        log.info("model_loaded", model=str(model_dir), architecture=config.architecture, dtype=dtype_name(self.dtype),
                 quantization=self.quantization, device=str(self.device), attention_backend=self.backend.name,
                 seconds=round(time.monotonic() - start, 2))
        sizing = self._size_kv_cache(options)
        self.num_blocks = sizing.num_blocks
        self.kv_caches = [
            self.backend.allocate_kv_cache(self.num_blocks, self.block_size, config.num_kv_heads, config.head_dim,
                                           self.kv_dtype, self.device)
            for _ in range(config.num_layers)
        ]
        concurrency = max_concurrency(self.num_blocks, self.block_size, self.max_model_len)
        # ``vllm`` carries vLLM's start-up sentences verbatim, for the log scrapers written for them.
        log.info("kv_cache_allocated", num_blocks=self.num_blocks, block_size=self.block_size,
                 bytes=sizing.total_bytes, sized_by=sizing.source, attention_backend=self.backend.name,
                 kv_cache_dtype=self.kv_cache_dtype,
                 vllm=f"PagedAttention enabled, block_size={self.block_size}, num_gpu_blocks={self.num_blocks}")
        log.info("max_concurrency", max_model_len=self.max_model_len, concurrency=round(concurrency, 2),
                 vllm=f"Maximum concurrency for {self.max_model_len} tokens per request: {concurrency:.2f}x")
        self.generator = torch.Generator().manual_seed(options.seed)
        precision = dtype_name(self.dtype) + ("" if self.quantization == "none" else f"+{self.quantization}") \
            + ("" if self.kv_cache_dtype == "auto" else f"+kv-{self.kv_cache_dtype}")
        self.store_mover = self._open_store(options, model_fingerprint(model_dir), precision, sizing.bytes_per_block)
        self.info = RunnerDescription(
            model_name=options.served_model_name or model_dir.resolve().name,
            model_fingerprint=model_fingerprint(model_dir),
            architecture=config.architecture,
            # Free-form in the proto: "bfloat16", "bfloat16+int8" with quantized projections,
            # "+kv-int8" with the int8 KV cache.
            dtype=precision,
            device=str(self.device),
            attention_backend=self.backend.name,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            kv_bytes_per_block=sizing.bytes_per_block,
            max_model_len=self.max_model_len,
            vocab_size=config.vocab_size,
            eos_token_ids=eos_token_ids(model_dir, config),
            num_layers=config.num_layers,
            model_path=str(model_dir.resolve()),
            instance_id=new_instance_id(),
            tokenizer_fingerprint=tokenizer_fingerprint(model_dir),
            kv_store=options.kv_store if self.store_mover else "",
            kv_store_namespace=self.store_mover.namespace if self.store_mover else "",
            kv_store_capacity_blocks=min(options.kv_store_capacity // sizing.bytes_per_block, (1 << 32) - 1)
            if self.store_mover else 0,
        )

    def _open_store(self, options: RunnerOptions, fingerprint: str, precision: str,
                    bytes_per_block: int) -> BlockMover | None:
        """The store tier, when ``--kv-store`` names one (a bad URL is a ValueError: a start-up error)."""
        if not options.kv_store:
            return None
        if options.kv_store_capacity < bytes_per_block:
            raise ValueError(f"kv_store_capacity: {options.kv_store_capacity} bytes hold no block of "
                             f"{bytes_per_block} bytes")
        try:
            store = open_store(options.kv_store)
        except ValueError as exc:
            raise ValueError(f"kv_store: {exc}") from None
        try:
            store_id = store.identity()
        except StoreError as exc:
            raise ValueError(f"kv_store: cannot reach {describe_url(options.kv_store)}: {exc}") from None
        namespace = store_namespace(store_id, fingerprint, precision, self.backend.name, self.device.type,
                                    self.kv_caches, self.block_size)
        log.info("kv_store_opened", store=describe_url(options.kv_store), medium=store.medium, namespace=namespace,
                 capacity_bytes=options.kv_store_capacity)
        return BlockMover(store, namespace, self.kv_caches)

    # ---- KV sizing -------------------------------------------------------------------------
    def _size_kv_cache(self, options: RunnerOptions) -> KVSizing:
        device_memory = None
        if self.device.type != "cpu" and options.num_blocks is None and options.kv_cache_memory is None:
            device_memory = self._profile_device_memory(options.profile_tokens)
        return size_kv_cache(self.config, self.block_size, self.kv_dtype, self.device,
                             num_blocks=options.num_blocks, kv_cache_memory=options.kv_cache_memory,
                             gpu_memory_utilization=options.gpu_memory_utilization, device_memory=device_memory,
                             kv_cache_dtype=self.kv_cache_dtype,
                             host_available=available_bytes() if self.device.type == "cpu" else None)

    def _profile_device_memory(self, profile_tokens: int) -> tuple[int, int, int]:
        """(free, total, activation peak) bytes: one forward of the longest step we expect,
        on a throwaway KV cache just big enough for it."""
        module = device_module(self.device)
        num_tokens = min(profile_tokens, self.max_model_len)
        blocks = -(-num_tokens // self.block_size) + 1
        caches = [self.backend.allocate_kv_cache(blocks, self.block_size, self.config.num_kv_heads,
                                                 self.config.head_dim, self.kv_dtype, self.device)
                  for _ in range(self.config.num_layers)]
        synchronize(self.device)
        module.reset_peak_memory_stats(self.device)
        before = module.memory_allocated(self.device)
        seq = SequenceInput(0, [0] * num_tokens, 0, list(range(1, blocks)), sample=True)
        self._run([seq], [], [], caches)
        synchronize(self.device)
        peak = module.max_memory_allocated(self.device) - before
        del caches
        module.empty_cache()
        free, total = module.mem_get_info(self.device)
        log.info("profiled_device_memory", free=free, total=total, activation_peak=peak, tokens=num_tokens)
        return free, total, peak

    # ---- validation ------------------------------------------------------------------------
    def validate(self, sequences: list[SequenceInput], copy_src: list[int], copy_dst: list[int],
                 store_orders: StoreOrders | None = None) -> None:
        """Raises InvalidArgument naming the first bad field; touches no tensor."""
        if not sequences and not store_orders:
            raise InvalidArgument("sequences: empty batch (at least one sequence is required, "
                                  "unless the step carries store saves or deletes)")
        nb, bs, vocab = self.num_blocks, self.block_size, self.config.vocab_size
        if store_orders:
            self._validate_store_orders(store_orders)
        if len(copy_src) != len(copy_dst):
            raise InvalidArgument(f"copy_dst: {len(copy_dst)} entries but copy_src has {len(copy_src)}")
        for name, ids in (("copy_src", copy_src), ("copy_dst", copy_dst)):
            for i, block in enumerate(ids):
                if not 0 <= block < nb:
                    raise InvalidArgument(f"{name}[{i}]: block {block} outside [0, {nb})")
        sources, seen_dst = set(copy_src), set()
        for i, block in enumerate(copy_dst):
            if block in seen_dst:
                raise InvalidArgument(f"copy_dst[{i}]: block {block} is a destination twice")
            if block in sources:
                raise InvalidArgument(f"copy_dst[{i}]: block {block} is also a copy source")
            seen_dst.add(block)
        for i, seq in enumerate(sequences):
            where = f"sequences[{i}] (seq_id {seq.seq_id})"
            if not seq.token_ids:
                raise InvalidArgument(f"{where}.token_ids: empty")
            if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab:
                j, tid = next((j, t) for j, t in enumerate(seq.token_ids) if not 0 <= t < vocab)
                raise InvalidArgument(f"{where}.token_ids[{j}]: {tid} outside the vocabulary [0, {vocab})")
            end = seq.start_position + len(seq.token_ids)
            if end > self.max_model_len:
                raise InvalidArgument(f"{where}.start_position: tokens reach position {end - 1}, "
                                      f"beyond max_model_len {self.max_model_len}")
            needed = -(-end // bs)
            if len(seq.block_table) < needed:
                raise InvalidArgument(f"{where}.block_table: {len(seq.block_table)} blocks hold "
                                      f"{len(seq.block_table) * bs} positions, {end} needed")
            if min(seq.block_table) < 0 or max(seq.block_table) >= nb:
                j, block = next((j, b) for j, b in enumerate(seq.block_table) if not 0 <= b < nb)
                raise InvalidArgument(f"{where}.block_table[{j}]: block {block} outside [0, {nb})")
            if seq.sample:
                seq.sampling.validate(f"{where}.sampling", vocab)
            check_drafts(where, seq.num_draft_tokens, len(seq.token_ids), seq.sample, seq.sampling)
            check_prompt_logprobs(where, seq.prompt_logprob_token_ids, len(seq.token_ids), seq.num_draft_tokens,
                                  seq.prompt_top_logprobs, vocab)
            if seq.store_load_block_ids or seq.store_load_hashes:
                self._validate_loads(where, seq)

    def _validate_store_orders(self, ops: StoreOrders) -> None:
        if self.store_mover is None:
            raise InvalidArgument("store_save_block_ids: this executor has no KV store (start it with --kv-store)")
        if not len(ops.save_block_ids) == len(ops.save_hashes) == len(ops.save_keys):
            raise InvalidArgument(f"store_save_hashes: {len(ops.save_block_ids)} block ids, {len(ops.save_hashes)} "
                                  f"hashes and {len(ops.save_keys)} keys; they are index-aligned")
        for i, block in enumerate(ops.save_block_ids):
            if not 0 < block < self.num_blocks:
                raise InvalidArgument(f"store_save_block_ids[{i}]: block {block} outside [1, {self.num_blocks})")
        for name, hashes in (("store_save_hashes", ops.save_hashes), ("store_delete_hashes", ops.delete_hashes)):
            check_hashes(name, hashes)

    def _validate_loads(self, where: str, seq: SequenceInput) -> None:
        if self.store_mover is None:
            raise InvalidArgument(f"{where}.store_load_block_ids: this executor has no KV store (start it with "
                                  "--kv-store)")
        if len(seq.store_load_block_ids) != len(seq.store_load_hashes):
            raise InvalidArgument(f"{where}.store_load_hashes: {len(seq.store_load_hashes)} hashes for "
                                  f"{len(seq.store_load_block_ids)} blocks")
        before = set(seq.block_table[:seq.start_position // self.block_size])
        for j, block in enumerate(seq.store_load_block_ids):
            if block == 0 or block not in before:
                raise InvalidArgument(f"{where}.store_load_block_ids[{j}]: block {block} is not one of the "
                                      "sequence's blocks before start_position")
        check_hashes(f"{where}.store_load_hashes", seq.store_load_hashes)

    # ---- one step --------------------------------------------------------------------------
    def execute(self, sequences: list[SequenceInput], copy_src: list[int] = (), copy_dst: list[int] = (),
                store_orders: StoreOrders | None = None) -> StepOutput:
        start = time.perf_counter()
        self.validate(sequences, list(copy_src), list(copy_dst), store_orders)
        if not any(s.store_load_block_ids for s in sequences) and not store_orders:
            return self._run(sequences, list(copy_src), list(copy_dst), self.kv_caches, start)
        return self._run_with_store(sequences, list(copy_src), list(copy_dst), store_orders or StoreOrders(), start)

    @torch.inference_mode()
    def _run_with_store(self, sequences: list[SequenceInput], copy_src: list[int], copy_dst: list[int],
                        ops: StoreOrders, start: float) -> StepOutput:
        """Loads first (a sequence whose load misses is dropped from the step), deletes, the step
        itself over the others, then saves."""
        mover = self.store_mover
        t0 = time.perf_counter()
        dropped, missing, kept = [], [], []
        for seq in sequences:
            missed = mover.load(seq.store_load_block_ids, seq.store_load_hashes) if seq.store_load_block_ids else []
            if missed:
                dropped.append(seq.seq_id)
                missing += missed
            else:
                kept.append(seq)
        if ops.delete_hashes:
            mover.delete(ops.delete_hashes)
        store_s = time.perf_counter() - t0
        if kept:
            out = self._run(kept, copy_src, copy_dst, self.kv_caches, start)
        else:
            if copy_src:
                self._copy_blocks(copy_src, copy_dst, self.kv_caches)
            out = StepOutput([], [], None, 0, 0.0, 0.0, 0.0, 0.0)
        t1 = time.perf_counter()
        out.store_saves_ok = mover.save(ops.save_block_ids, ops.save_hashes, ops.save_keys)
        end = time.perf_counter()
        out.store_ms = (store_s + end - t1) * 1e3
        out.total_ms = (end - start) * 1e3
        out.dropped_seq_ids, out.store_missing_hashes = dropped, missing
        if dropped:
            log.warning("store_loads_missed", dropped_seq_ids=dropped, num_missing=len(missing))
        return out

    def _copy_blocks(self, copy_src: list[int], copy_dst: list[int], kv_caches) -> None:
        self.backend.copy_blocks(kv_caches, torch.tensor(copy_src, dtype=torch.long, device=self.device),
                                 torch.tensor(copy_dst, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def _run(self, sequences, copy_src, copy_dst, kv_caches, start: float | None = None) -> StepOutput:
        start = time.perf_counter() if start is None else start
        token_ids, positions, meta = self._prepare(sequences)
        t_copy = time.perf_counter()
        if copy_src:
            self._copy_blocks(copy_src, copy_dst, kv_caches)
        t_forward = time.perf_counter()
        hidden = self.model(token_ids, positions, kv_caches, meta, self.backend)
        if self.device.type != "cpu":
            synchronize(self.device)
        t_sample = time.perf_counter()
        sample_rows = [i for i, s in enumerate(sequences) if s.sample]
        result = None
        accepted: list[int] = []
        if sample_rows and any(sequences[i].num_draft_tokens for i in sample_rows):
            result, accepted = self._verify_drafts(hidden, meta, sequences, sample_rows)
        elif sample_rows:
            logits = self._last_token_logits(hidden, meta, sequences, sample_rows)
            params = [sequences[i].sampling for i in sample_rows]
            next_positions = [sequence_end(sequences[i]) for i in sample_rows]
            result = sample(logits, params, next_positions, self.generator, self.backend.greedy_sample)
        prompt_logprobs = self._prompt_logprobs(hidden, meta, sequences)
        end = time.perf_counter()
        return StepOutput(
            sampled_token_ids=result.token_ids if result else [],
            sampled_logprobs=result.logprobs if result else [],
            top_logprobs=result.top_logprobs if result else None,
            num_tokens=len(token_ids),
            copy_ms=(t_forward - t_copy) * 1e3,
            forward_ms=(t_sample - t_forward) * 1e3,
            sample_ms=(end - t_sample) * 1e3,
            total_ms=(end - start) * 1e3,
            num_accepted_draft_tokens=accepted,
            prompt_logprobs=prompt_logprobs,
        )

    def _verify_drafts(self, hidden: torch.Tensor, meta: AttentionMetadata, sequences: list[SequenceInput],
                       sample_rows: list[int]) -> tuple[SampleResult, list[int]]:
        """Greedy picks at each drafted sequence's last n + 1 positions (one row per other sampled
        sequence), then acceptance; validation made every drafted row greedy, its sequence's
        suppressed tokens (if any) suppressed at each."""
        ends = list(itertools.accumulate(len(s.token_ids) for s in sequences))
        rows = logit_rows(ends, sample_rows, [s.num_draft_tokens for s in sequences])
        index = torch.tensor(rows.token_rows, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index),
                                           decode_step=meta.step_kind)  # [rows, vocab]
        params, positions = [], []
        for i, count in zip(sample_rows, rows.counts):
            params += [sequences[i].sampling] * count
            end = sequence_end(sequences[i])
            positions += range(end - count + 1, end + 1)
        picked = sample(logits, params, positions, self.generator, self.backend.greedy_sample)
        drafts = [sequences[i].token_ids[len(sequences[i].token_ids) - sequences[i].num_draft_tokens:]
                  for i in sample_rows]
        tokens, logprobs, accepted = accept(drafts, picked.token_ids, picked.logprobs, rows.counts)
        top = None
        if picked.top_logprobs is not None:  # only undrafted rows may ask: one row each, kept in order
            top, offset = [], 0
            for count, a in zip(rows.counts, accepted):
                top += picked.top_logprobs[offset:offset + a + 1]
                offset += count
        return SampleResult(tokens, logprobs, top), accepted

    def _prompt_logprobs(self, hidden: torch.Tensor, meta: AttentionMetadata,
                         sequences: list[SequenceInput]) -> list[PromptLogprobs]:
        asking = [i for i, s in enumerate(sequences) if s.prompt_logprob_token_ids]
        if not asking:
            return []
        starts = [0, *itertools.accumulate(len(s.token_ids) for s in sequences)]
        return score_rows(hidden, [starts[i] for i in asking], [sequences[i].prompt_logprob_token_ids for i in asking],
                          [sequences[i].prompt_top_logprobs for i in asking],
                          lambda rows: self.model.compute_logits(rows, decode_step=meta.step_kind))

    def _last_token_logits(self, hidden: torch.Tensor, meta: AttentionMetadata, sequences: list[SequenceInput],
                           rows: list[int]) -> torch.Tensor:
        # hidden: [num_tokens, hidden] → logits [len(rows), vocab] (the head's dtype) at each row's last token
        ends = list(itertools.accumulate(len(s.token_ids) for s in sequences))
        last_tokens = torch.tensor([ends[i] - 1 for i in rows], device=self.device)
        return self.model.compute_logits(hidden.index_select(0, last_tokens), decode_step=meta.step_kind)

    @torch.inference_mode()
    def forward_logits(self, sequences: list[SequenceInput]) -> torch.Tensor:
        """Runs a validated step (writing KV like ``execute``) and returns the float32 logits
        [num_seqs, vocab] after each sequence's last token, unsampled: for comparisons and debugging."""
        self.validate(sequences, [], [])
        token_ids, positions, meta = self._prepare(sequences)
        hidden = self.model(token_ids, positions, self.kv_caches, meta, self.backend)
        return self._last_token_logits(hidden, meta, sequences, list(range(len(sequences)))).float().cpu()

    def _prepare(self, sequences: list[SequenceInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flattened token ids and positions, and the attention metadata (slot mapping from block tables)
        of the step's attention rows (``attention_rows``)."""
        rows = attention_rows(sequences)
        verify_rows, sequences = rows is not sequences, rows
        bs = self.block_size
        query_lens = [len(s.token_ids) for s in sequences]
        seq_lens = [sequence_end(s) for s in sequences]
        max_blocks = -(-max(seq_lens) // bs)
        tables = [s.block_table[: -(-n // bs)] for s, n in zip(sequences, seq_lens)]
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        token_ids = torch.tensor([t for s in sequences for t in s.token_ids], dtype=torch.long)
        num_seqs, num_tokens = len(sequences), len(token_ids)
        query_lens_t = torch.tensor(query_lens, dtype=torch.long)
        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        if num_tokens == num_seqs:  # decode only: one token per sequence
            seq_index = torch.arange(num_seqs)
            positions = torch.tensor([s.start_position for s in sequences], dtype=torch.long)
        else:
            seq_index = torch.repeat_interleave(torch.arange(num_seqs), query_lens_t)
            first = torch.tensor([s.start_position for s in sequences], dtype=torch.long)
            offsets = torch.arange(num_tokens) - query_start_loc[:-1].long().repeat_interleave(query_lens_t)
            positions = first[seq_index] + offsets
        slot_mapping = block_tables[seq_index, positions // bs].long() * bs + positions % bs
        if num_seqs > 1 and torch.unique(slot_mapping).numel() != num_tokens:
            raise InvalidArgument("sequences.block_table: two tokens of this batch write the same KV slot")
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            query_start_loc=query_start_loc.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
            block_tables=block_tables.to(device),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=bs,
            verify_rows=verify_rows,
        )
        return token_ids.to(device), positions.to(device), meta


def sequence_end(sequence: SequenceInput) -> int:
    """The sequence's length once this step's tokens are in: the position its next token takes."""
    return sequence.start_position + len(sequence.token_ids)


def attention_rows(sequences: list[SequenceInput]) -> list[SequenceInput]:
    """The step as the model runs it. A verify step — every sequence one decode token and its drafts
    (``num_draft_tokens``), no prompt tokens — runs as a decode step with a row per token: each row
    one query over the sequence's blocks up to its own position, so the few-row matmuls, the fused
    decode layers and the decode attention kernel take it, and each row computes the bits a plain
    decode step at its position would (those kernels give a row the same result in any batch).
    The KV of every row is written before any row attends. Any other step runs as it comes."""
    if all(len(s.token_ids) == 1 for s in sequences) or any(
            len(s.token_ids) != s.num_draft_tokens + 1 for s in sequences):
        return sequences
    return [SequenceInput(s.seq_id, [token], s.start_position + offset, s.block_table)
            for s in sequences for offset, token in enumerate(s.token_ids)]


def check_hashes(name: str, hashes: list[bytes]) -> None:
    for i, block_hash in enumerate(hashes):
        if len(block_hash) != 16:
            raise InvalidArgument(f"{name}[{i}]: a block hash is 16 bytes, got {len(block_hash)}")
