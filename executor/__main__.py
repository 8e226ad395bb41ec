"""``python -m executor``: serve ``kvserve.v1.Executor`` for one model on one device."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from executor.attention import KV_CACHE_DTYPES
from executor.kv_tier import DEFAULT_STORE_CAPACITY_BYTES
from executor.devices import huge_page_collapses, tune_host_allocator
from executor.model import UnsupportedModel
from executor.prepare_model import is_complete
from executor.quantization import QUANTIZATION_MODES
from executor.runner import ModelRunner, RunnerOptions
from executor.service import ExecutorServicer
from executor.step_socket import StepSocketListener
from executor.thread_probe_cache import ProbeKey, ThreadProbeCache
from executor.threads import ThreadProbe, loading_thread_count, parse_num_threads, probe_runner_threads
from executor.torch_thread import TorchThread
from kvserve.auth import token_or_none
from kvserve.config import (
    EnvArgumentParser, add_server_flags, add_service_token_flag, check_server_flags, config_from_args,
)
from kvserve.errors import StartupError
from kvserve.logs import configure_logging, get_logger
from kvserve.paths import cache_dir, default_model_dir
from kvserve.ports import DEFAULT_EXECUTOR_PORT
from kvserve.server import GrpcServer, Service, TlsFiles, run_service, wait_for_shutdown_signal
from kvserve.v1 import executor_pb2, executor_pb2_grpc

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
COLLAPSE_PIECE_BYTES = 4 << 20  # ~15 ms of madvise(MADV_COLLAPSE): what one step may wait behind
log = get_logger("executor")


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(prog="python -m executor", description=__doc__.splitlines()[0].strip("`: "))
    add_server_flags(parser, default_port=DEFAULT_EXECUTOR_PORT)
    add_service_token_flag(parser)
    # Each dest that names a RunnerOptions field sets it (see main).
    parser.add_argument("--model", dest="model_dir", metavar="MODEL", type=Path, default=default_model_dir(),
                        help="Hugging Face model directory")
    parser.add_argument("--served-model-name", default=None, help="model name to report (default: the directory name)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="compute dtype, and K/V's unless --kv-cache-dtype says otherwise (auto: the "
                             "checkpoint's on a device; on the CPU bfloat16 where it runs natively (AVX-512 or "
                             "AVX-NE-CONVERT), else float32)")
    parser.add_argument("--quantization", default="none", choices=list(QUANTIZATION_MODES),
                        help="quantized weights for the layers' projections (the embedding stays in --dtype): "
                             "int8 per output channel, int4 in groups of 32 with scale and min; on the CPU with "
                             "the compiled kernels, activations rounded to int8 too and an int8 LM head "
                             "(docs/quantization.md); Describe reports it in dtype, e.g. bfloat16+int8")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="K/V cache element type: auto (the model's dtype, but bfloat16 where --dtype auto "
                             "computes a bf16 checkpoint in float32 on a CPU without native bf16); bfloat16 (a "
                             "float32 model's K/V rounded to bf16, as a bf16 model keeps them: half the bytes; "
                             "the cpu and torch attention backends); int8 (a byte a value and a float32 scale "
                             "per token and KV head: half a bf16 cache's bytes, so twice the tokens in the same "
                             "memory and half the reads of a decode step; the CPU attention backend only, "
                             "docs/executor.md); Describe reports it in dtype, e.g. float32+kv-bfloat16, "
                             "bfloat16+kv-int8")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "musa"],
                        help="auto: musa if torch_musa sees a device, else cuda if available, else cpu")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "cuda", "musa"],
                        help="auto: the device's compiled kernels (cpu, cuda, musa); torch: plain torch ops "
                             "on any device (auto on the CPU falls back to it where no compiler is found)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides the memory flags)")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache (all layers, K and V)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="on a device: fraction of its memory for weights, activations and KV")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence (default and cap: the model's max_position_embeddings)")
    parser.add_argument("--num-threads", type=thread_count_flag, default="auto", metavar="auto|N",
                        help="the torch thread's CPU threads: auto times a decode step of the model at 1, 2, "
                             "4, ... and every usable CPU after it loads and keeps the fastest (the fewer "
                             "threads when within 5 %%; docs/executor.md, 'Threads'); on a GPU device auto "
                             "leaves torch's default")
    parser.add_argument("--thread-probe-cache", default="auto", metavar="auto|off|PATH",
                        help="where --num-threads auto keeps what it measured, keyed by CPU, usable CPUs, torch, "
                             "model and precision, so a restart skips the probe and replicas sharing the file "
                             "probe one at a time: auto: thread-probes.json in the kvserve cache directory; "
                             "off: probe at every start")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator unseeded sampling uses")
    parser.add_argument("--kv-store", default="", metavar="DIR|URL",
                        help="the KV store tier: a directory (a path or file:///dir; local disk, or a volume "
                             "the executors share) or redis://host:port/db. kvmanager decides what is saved "
                             "there and loaded from there; entries survive restarts of every service and are "
                             "shared by every executor of the same model, precision and KV layout "
                             "(docs/kvmanager.md, 'The store tier'). Empty: none")
    parser.add_argument("--kv-store-capacity", type=int, default=DEFAULT_STORE_CAPACITY_BYTES, metavar="BYTES",
                        help="bytes of this executor's blocks the store keeps; kvmanager evicts the least "
                             "recently used entries beyond it")
    parser.add_argument("--step-socket", default="auto", metavar="auto|off|PATH",
                        help="a Unix socket that takes ExecuteStream's steps without gRPC's cost per message, "
                             "for a gateway on this host (Describe names it; docs/executor-contract.md): "
                             "auto: in a fresh private directory under --step-socket-dir; off: none")
    parser.add_argument("--step-socket-dir", type=Path, default=None, metavar="DIR",
                        help="where --step-socket auto makes its directory (default: the temp directory); "
                             "a directory the gateway's host or container sees at the same path, such as a "
                             "volume both containers mount")
    return parser


def thread_count_flag(text: str) -> int | None:
    try:
        return parse_num_threads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--num-threads: ")) from None


def check_model_dir(model_dir: Path) -> None:
    """A missing or half-written model directory is a one-line start-up error, never a traceback."""
    if not (model_dir / "config.json").is_file():
        hint = " (run `kvserve prepare-model`)" if model_dir == default_model_dir() else ""
        raise StartupError(f"model directory {model_dir} is missing or has no config.json{hint}")
    if (model_dir / "kvserve-manifest.json").exists() and not is_complete(model_dir, verify_digests=False):
        raise StartupError(f"model directory {model_dir} is incomplete (run `kvserve prepare-model --force`)")


def probe_cache_path(text: str) -> Path | None:
    if text == "off":
        return None
    return cache_dir() / "thread-probes.json" if text == "auto" else Path(text)


def choose_threads(runner: ModelRunner, cache_path: Path | None, torch_default_threads: int) -> None:
    """``--num-threads auto`` once the model is loaded: on the CPU the cached count for this CPU and
    model, else a probe; on a GPU torch's default (run in the torch thread)."""
    if runner.device.type != "cpu":
        torch.set_num_threads(torch_default_threads)
        return

    def probe() -> ThreadProbe | None:
        result = probe_runner_threads(runner)
        if result is not None:
            log.info("threads_probed", chosen=result.chosen, decode_step_ms_by_threads=result.summary())
        return result

    if cache_path is None:
        probe()
        return
    chosen, probed = ThreadProbeCache(cache_path).chosen_or_probe(ProbeKey.for_runner(runner), probe)
    if chosen is not None and not probed:
        torch.set_num_threads(chosen)
        log.info("threads_from_probe_cache", chosen=chosen, path=str(cache_path))


def start_huge_pages(runner: ModelRunner, torch_thread: TorchThread) -> None:
    """Moves the weights and KV cache into huge pages while the executor serves, not before it:
    collapsing 2 GiB takes 4 s. It runs in the torch thread, a piece at a time between steps
    (``TorchThread.run_when_idle``): beside the steps, on a 2-core machine a collapsing thread
    preempted an OpenMP thread of every step, and the first request took 2.8 s instead of 0.15.
    Steps run at 4 KiB-page speed until it is done."""
    if runner.device.type != "cpu":
        return

    def pieces() -> Iterator[None]:
        collapsed = 0
        for num_bytes in huge_page_collapses(piece_bytes=COLLAPSE_PIECE_BYTES):
            collapsed += num_bytes
            yield
        log.info("host_memory_in_huge_pages", mib=collapsed >> 20)

    torch_thread.run_when_idle(pieces())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_server_flags(parser, args)
    configure_logging(args.log_level)
    tune_host_allocator()

    async def serve() -> None:
        check_model_dir(args.model_dir)
        options = config_from_args(RunnerOptions, args)
        torch_default_threads = torch.get_num_threads()
        # all torch work happens there, see executor.service
        torch_thread = TorchThread(args.num_threads or loading_thread_count())
        try:
            runner = await torch_thread.run(ModelRunner, options)
        except (UnsupportedModel, ValueError, ImportError, OSError) as exc:
            torch_thread.close()
            raise StartupError(parser.in_flag_terms(str(exc))) from exc
        except Exception as exc:  # noqa: BLE001 — e.g. a corrupt safetensors file: still one line
            torch_thread.close()
            raise StartupError(f"cannot load {args.model_dir}: {type(exc).__name__}: {exc}") from exc
        if args.num_threads is None:
            await torch_thread.run(choose_threads, runner, probe_cache_path(args.thread_probe_cache),
                                   torch_default_threads)
        token = token_or_none(args.service_token)
        step_socket = StepSocketListener.create(args.step_socket, runner, torch_thread, token,
                                                  args.step_socket_dir)
        if step_socket is not None:
            await step_socket.start()
        servicer = ExecutorServicer(runner, torch_thread, str(step_socket.path) if step_socket else "")
        server = GrpcServer("executor", args.host, args.port,
                            [Service(SERVICE_NAME, servicer, executor_pb2_grpc.add_ExecutorServicer_to_server)],
                            auth=token, auth_what="service token",
                            tls=TlsFiles.from_args(args))
        try:
            await server.start()
            log.info("executor_ready", model=runner.info.model_name, device=runner.info.device,
                     attention_backend=runner.info.attention_backend,
                     torch_threads=await torch_thread.run(torch.get_num_threads))
            start_huge_pages(runner, torch_thread)
            sig = await wait_for_shutdown_signal()
            log.info("shutting_down", signal=sig.name)
            await server.stop(args.shutdown_grace)
        finally:
            if step_socket is not None:
                await step_socket.stop()
            torch_thread.close()

    return run_service("executor", serve)


if __name__ == "__main__":
    sys.exit(main())
