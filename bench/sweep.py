"""``--sweep seed-table``: the four configurations of the seed's table and kvserve's defaults,
one KV budget, one workload.

Each configuration gets a fresh stack (kvmanager + executor + gateway, started
with ``kvserve.launcher``) so no cache or allocator state leaks between rows.
The KV budget is fixed for all of them: ``--num-blocks`` such that reserving
``max_model_len`` per request (the baseline) fits ``baseline_seqs`` requests.
``--kvserve-quantization int8,int4`` adds the defaults row (the prefix-caching row where
``--configs`` leaves it out) once more per mode, its executor started with
``--quantization MODE``. With more than one executor thread count
(``--executor-threads 1,2``) every row runs once per count, named after it.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.config import without_flag_env
from kvserve.cpus import usable_cpus
from kvserve.launcher import StackConfig, start_stack
from kvserve.ports import free_port

from bench.report import Row
from bench.runner import measure, model_info
from bench.workload import BenchRequest


# The executor's --quantization values (executor/quantization.py; not imported here, which would load torch).
QUANTIZATION_MODES = ("none", "int8", "int4")
# ... and its --kv-cache-dtype values (executor/attention/__init__.py), for the same reason.
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")


@dataclass(frozen=True)
class SweepConfig:
    """One row: how the gateway is told to batch, allocate and draft, and the executor's weight
    quantization. The seed table's rows draft nothing (prompt lookup off), as the peers' speculative
    modes are off: they compare batching, paging and kernels. The ``defaults`` row is kvserve as
    ``kvserve up`` runs it, prompt lookup on, each system in its own defaults' set-up: the
    workload's fixed-length requests draft as far as ``min_tokens`` suppresses EOS."""

    name: str
    slug: str
    batching: str  # continuous | static
    kv_allocation: str  # paged | reserve
    prefix_caching: bool
    quantization: str = "none"  # the executor's --quantization
    threads: int | None = None  # the executor's --num-threads (None: its own probe, auto)
    speculative_decoding: str = "off"  # the gateway's --speculative-decoding

    def gateway_args(self) -> list[str]:
        return ["--batching", self.batching, "--kv-allocation", self.kv_allocation,
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
                "--speculative-decoding", self.speculative_decoding]

    def executor_args(self) -> list[str]:
        quantization = [] if self.quantization == "none" else ["--quantization", self.quantization]
        return [*quantization, "--num-threads", "auto" if self.threads is None else str(self.threads)]


SEED_TABLE = (
    SweepConfig("baseline (static batching, contiguous reservation)", "baseline", "static", "reserve", False),
    SweepConfig("+ continuous batching", "continuous", "continuous", "reserve", False),
    SweepConfig("+ PagedAttention (block 16)", "paged", "continuous", "paged", False),
    SweepConfig("+ prefix caching (shared system prompt)", "prefix", "continuous", "paged", True),
)
# kvserve's own defaults: the prefix-caching row with prompt-lookup drafting, the gateway's default.
DEFAULTS = SweepConfig("kvserve defaults (prefix caching, prompt lookup)", "defaults", "continuous", "paged", True,
                       speculative_decoding="prompt-lookup")
CONFIGS = (*SEED_TABLE, DEFAULTS)


def plan_configs(slugs: set[str], quantizations: list[str],
                 thread_counts: list[int | None] = (None,)) -> tuple[SweepConfig, ...]:
    """The rows named by ``slugs`` (the seed table's, then ``defaults``), in that order, then one row
    per quantization mode other than ``none``: the defaults row's when ``slugs`` names it, else the
    prefix-caching row's (whether or not ``slugs`` names ``prefix``); all of them once per executor
    thread count (None: ``--num-threads auto``), named after the count when there are several."""
    base = DEFAULTS if DEFAULTS.slug in slugs else next(c for c in SEED_TABLE if c.slug == "prefix")
    quantized = [dataclasses.replace(base, name=f"{base.name}, {mode} weights", slug=f"{base.slug}-{mode}",
                                     quantization=mode)
                 for mode in quantizations if mode != "none"]
    planned = (*[c for c in CONFIGS if c.slug in slugs], *quantized)
    if len(thread_counts) == 1:
        return tuple(dataclasses.replace(c, threads=thread_counts[0]) for c in planned)
    return tuple(dataclasses.replace(c, name=f"{c.name} · {threads_label(threads)}",
                                     slug=f"{c.slug}-t{threads or 'auto'}", threads=threads)
                 for threads in thread_counts for c in planned)


def threads_label(threads: int | None) -> str:
    """How a row name says its executor's thread count."""
    return "auto threads" if threads is None else f"{threads} thread{'s' if threads > 1 else ''}"


def weights_description(dtype: str, quantization: str) -> str:
    """The side-by-side table's weights column of a kvserve row."""
    loaded = f"safetensors loaded in {dtype}"
    if quantization == "int8":
        return f"{loaded}, int8 weights (per channel) x int8 activations (per token, groups of 32); LM head int8"
    if quantization == "int4":
        return f"{loaded}, int4 weights (groups of 32); LM head int8"
    return loaded


def weight_bits(dtype_flag: str, quantization: str) -> int:
    """Bits a projection weight of a kvserve row: what the peers' rows it is compared with hold.
    ``dtype_flag`` as asked: ``auto`` computes the checkpoint's 16-bit weights in the dtype the CPU
    runs fastest (float32 on an AVX2-only CPU, as OpenVINO does its FP16 IR there)."""
    return {"int8": 8, "int4": 4}.get(quantization) or (32 if dtype_flag == "float32" else 16)


def resolve_auto_dtype(dtype: str, model_dir: Path) -> str:
    """``auto`` as the executor resolves it on this machine (executor/devices.py): bfloat16 on a CPU
    that runs it natively, float32 on one that emulates it (many times slower), the checkpoint's
    dtype on a GPU. Any other name is returned as it is."""
    if dtype != "auto":
        return dtype
    from executor.devices import dtype_name, resolve_device, resolve_dtype
    from executor.model import ModelConfig

    return dtype_name(resolve_dtype("auto", ModelConfig.from_dir(model_dir), resolve_device("auto")))


@dataclass
class Budget:
    """The fixed engine limits every configuration runs with."""

    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  # the executor's --kv-cache-dtype: auto (= dtype), bfloat16 or int8
    extra_executor_args: list[str] = field(default_factory=list)
    extra_gateway_args: list[str] = field(default_factory=list)

    def executor_args(self) -> list[str]:
        kv = [] if self.kv_cache_dtype == "auto" else ["--kv-cache-dtype", self.kv_cache_dtype]
        return ["--num-blocks", str(self.num_blocks), "--block-size", str(self.block_size),
                "--max-model-len", str(self.max_model_len), "--dtype", self.dtype, *kv, *self.extra_executor_args]

    def kv_description(self) -> str:
        if self.kv_cache_dtype == "int8":
            return "int8 K/V (a float32 scale per token and head)"
        return f"{self.dtype if self.kv_cache_dtype == 'auto' else self.kv_cache_dtype} K/V"

    def gateway_args(self) -> list[str]:
        return ["--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens), *self.extra_gateway_args]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_budget(requests: list[BenchRequest], *, block_size: int = 16, baseline_seqs: int = 12,
                max_model_len: int | None = None, num_blocks: int | None = None, max_num_seqs: int = 64,
                max_num_batched_tokens: int | None = None, dtype: str = "bfloat16") -> Budget:
    """Limits from the workload: ``max_model_len`` fits its longest request, and the block
    budget holds exactly ``baseline_seqs`` full-length reservations."""
    longest = max(r.prompt_len + r.output_len for r in requests)
    # +8: the server's tokenization of system prompt + user turn may differ by a token or two
    max_model_len = max_model_len or round_up(longest + 8, block_size)
    # +1: block 0 is the null block, never handed out
    num_blocks = num_blocks or baseline_seqs * (max_model_len // block_size + (max_model_len % block_size > 0)) + 1
    # a whole prompt fits one step, so prefill chunking does not differ between rows
    max_num_batched_tokens = max_num_batched_tokens or max(2048, max_model_len)
    return Budget(max_model_len, block_size, num_blocks, max_num_seqs, max_num_batched_tokens, dtype)


def check_applied(config: SweepConfig, info: dict, kv_cache_dtype: str = "auto") -> list[str]:
    """Where the running gateway's ModelInfo disagrees with the configuration asked for."""
    if "error" in info:
        return [f"could not verify the configuration: {info['error']}"]
    wanted = {"batching": config.batching, "kv_allocation": config.kv_allocation,
              "enable_prefix_caching": config.prefix_caching}
    problems = [f"asked {key}={value!r}, gateway reports {info.get(key)!r}"
                for key, value in wanted.items() if key in info and info[key] != value]
    # The executor reports its quantization and KV cache in dtype: "bfloat16+int4", "bfloat16+kv-int8",
    # plain "bfloat16" for neither.
    if "dtype" in info:
        extras = info["dtype"].split("+")[1:]
        weights = next((e for e in extras if not e.startswith("kv-")), "none")
        kv = next((e.removeprefix("kv-") for e in extras if e.startswith("kv-")), "auto")
        if kv == "auto" and info["dtype"].split("+")[0] == kv_cache_dtype:  # a bf16 model's bf16 K/V
            kv = kv_cache_dtype
        if weights != config.quantization:
            problems.append(f"asked quantization={config.quantization!r}, executor reports dtype {info['dtype']!r}")
        if kv != kv_cache_dtype:
            problems.append(f"asked kv_cache_dtype={kv_cache_dtype!r}, executor reports dtype {info['dtype']!r}")
    return problems


def run_config(config: SweepConfig, requests: list[BenchRequest], budget: Budget, model_dir: Path,
               log_dir: Path, *, concurrency: int | None, request_rate: float | None, seed: int,
               progress: bool, metrics_interval: float, startup_timeout: float = 300.0) -> tuple[Row, dict]:
    """Starts a stack with ``config``, measures the workload on it, stops it."""
    stack_config = StackConfig(
        model_dir=Path(model_dir), kvmanager_port=free_port(), executor_port=free_port(),
        gateway_port=free_port(), http_port=free_port(),
        executor_args=[*budget.executor_args(), *config.executor_args()],
        # --gateway-args (the budget's extras) come last: they win over the row's own flags.
        gateway_args=[*config.gateway_args(), *budget.gateway_args()], log_dir=log_dir / config.slug,
        env=without_flag_env(), timeout=startup_timeout,  # only the sweep's flags apply
    )
    stack_config.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    stack = start_stack(stack_config)
    startup_s = time.perf_counter() - started
    try:
        info = model_info(stack.grpc_address)
        row = measure(config.name, requests, base_url=stack.http_url, concurrency=concurrency,
                      request_rate=request_rate, seed=seed, progress=progress, metrics_interval=metrics_interval,
                      kv_allocation=config.kv_allocation,
                      server_pids={s.module: s.proc.pid for s in stack.services()})
    finally:
        stack.stop()
    row.notes.extend(check_applied(config, info, budget.kv_cache_dtype))
    return row, {"config": vars(config), "model_info": info, "startup_s": startup_s}


def run_seed_table(requests: list[BenchRequest], budget: Budget, model_dir: Path, out_dir: Path, *,
                   concurrency: int | None, request_rate: float | None = None, seed: int = 0,
                   configs: tuple[SweepConfig, ...] = SEED_TABLE, progress: bool = True,
                   metrics_interval: float = 0.25, log=print) -> tuple[list[Row], list[dict]]:
    """Runs each configuration in turn; a configuration that fails to start becomes a failed row."""
    rows, details = [], []
    for config in configs:
        log(f"== {config.name}: starting kvmanager, executor, gateway "
            f"({' '.join([*config.executor_args(), *config.gateway_args(), *budget.extra_gateway_args])})")
        try:
            row, detail = run_config(config, requests, budget, model_dir, out_dir / "logs",
                                     concurrency=concurrency, request_rate=request_rate, seed=seed,
                                     progress=progress, metrics_interval=metrics_interval)
        except Exception as exc:  # one broken configuration must not lose the other rows
            row = Row(name=config.name, failed=len(requests), errors=[f"{type(exc).__name__}: {exc}"[:2000]])
            detail = {"config": vars(config), "error": row.errors[0]}
        log(f"   {row.completed} done, {row.failed} failed, {row.output_throughput:.1f} output tok/s, "
            f"TTFT P99 {row.ttft_ms.get('p99') or float('nan'):.0f} ms, {row.duration_s:.0f} s")
        rows.append(row)
        details.append(detail)
    return rows, details


def machine_description() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "usable_cpus": usable_cpus(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "platform": platform.platform()}


def resolve_auto_kv_cache_dtype(kv_cache_dtype: str, dtype_flag: str, dtype: str, model_dir: Path) -> str:
    """``--kv-cache-dtype`` as the executor resolves it for ``--dtype dtype_flag`` (executor/devices.py):
    bfloat16 where ``auto`` computes a bf16 checkpoint in float32 (an AVX2-only CPU). The sweep passes
    the executor the resolved names, so that each row says what ran."""
    if (kv_cache_dtype, dtype_flag, dtype) != ("auto", "auto", "float32"):
        return kv_cache_dtype
    import torch

    from executor.devices import resolve_kv_cache_dtype
    from executor.model import ModelConfig

    return resolve_kv_cache_dtype(kv_cache_dtype, dtype_flag, ModelConfig.from_dir(model_dir), getattr(torch, dtype),
                                  reads_other_kv_dtype=True)


def probe_auto_threads(model_dir: Path, dtype: str, quantization: str, kv_cache_dtype: str) -> dict:
    """What the executor's ``--num-threads auto`` picks on this machine for one row's precision
    (``python -m executor.threads``): {"chosen": N, "decode_step_ms_by_threads": {...}}, or
    {"error": ...} when it could not run."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "executor.threads", "--model", str(model_dir), "--dtype", dtype,
               "--quantization", quantization, "--kv-cache-dtype", kv_cache_dtype]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=without_flag_env())
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
