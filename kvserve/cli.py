"""The ``kvserve`` command: ``up``, ``prepare-model``, ``bench``, ``protogen``.

``kvserve up`` runs the whole system locally (what ``make run`` calls): it
prepares the default model if needed, starts kvmanager, executor and gateway,
waits until all three are healthy, prints where to connect and what the executor
runs, and stops all three on Ctrl-C or SIGTERM. The other commands hand over to
the module that owns the work, in a child process, so this package imports no
service.
"""
from __future__ import annotations

import argparse
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvserve.config import EnvArgumentParser
from kvserve.launcher import StackConfig, start_stack
from kvserve.paths import cache_dir, default_model_dir
from kvserve.ports import (
    DEFAULT_EXECUTOR_PORT, DEFAULT_GATEWAY_PORT, DEFAULT_HOST, DEFAULT_HTTP_PORT, DEFAULT_KVMANAGER_PORT,
)


def _run_module(module: str, args: list[str]) -> int:
    return subprocess.call([sys.executable, "-m", module, *args])


def _ensure_default_model(model_dir: Path) -> None:
    if model_dir != default_model_dir():
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"kvserve up: error: model directory {model_dir} has no config.json")
        return
    if _run_module("executor.prepare_model", ["--check"]) != 0:
        if _run_module("executor.prepare_model", []) != 0:
            raise SystemExit("kvserve up: error: preparing the default model failed")


# What `kvserve up --kv-store auto` lets the store keep: warm restarts for a session's prompts,
# bounded well below a laptop's free disk.
AUTO_KV_STORE_BYTES = 2 << 30


def default_kv_store_dir() -> Path:
    return cache_dir() / "kv-store"


def with_kv_store(executor_args: list[str], kv_store: str) -> list[str]:
    """The executor's flags with ``kvserve up --kv-store``'s choice, unless they name a store themselves."""
    if kv_store == "off" or any(a == "--kv-store" or a.startswith("--kv-store=") for a in executor_args):
        return executor_args
    if kv_store == "auto":
        return ["--kv-store", str(default_kv_store_dir()), "--kv-store-capacity", str(AUTO_KV_STORE_BYTES),
                *executor_args]  # a capacity among them wins
    return ["--kv-store", kv_store, *executor_args]


def describe_executor(info) -> str:
    """The banner's line on what the executor runs: the precision its defaults chose on this
    machine (``--dtype auto`` computes a bf16 checkpoint in float32 where the CPU has no native
    bf16), where, and its KV cache. ``info``: the gateway's ``ModelInfo``."""
    return (f"  executor     {info.dtype} on {info.device}, {info.num_blocks} KV blocks of {info.block_size} "
            f"tokens, up to {info.max_model_len} tokens a request\n")


def up(argv: list[str]) -> int:
    parser = EnvArgumentParser(prog="kvserve up", description="Run kvmanager, executor and gateway locally.")
    parser.add_argument("--model", type=Path, default=default_model_dir(), help="Hugging Face model directory")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address all three listen on")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT, help="gateway OpenAI-compatible HTTP port")
    parser.add_argument("--grpc-port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway gRPC port")
    parser.add_argument("--kvmanager-port", type=int, default=DEFAULT_KVMANAGER_PORT, help="kvmanager gRPC port")
    parser.add_argument("--executor-port", type=int, default=DEFAULT_EXECUTOR_PORT, help="executor gRPC port")
    parser.add_argument("--executor-args", default="", help="extra executor flags, e.g. '--num-blocks 4096'")
    parser.add_argument("--gateway-args", default="", help="extra gateway flags, e.g. '--batching static'")
    parser.add_argument("--kvmanager-args", default="", help="extra kvmanager flags")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for health")
    parser.add_argument("--kv-store", default="auto", metavar="auto|off|DIR|URL",
                        help="the executor's KV store tier (its --kv-store): auto: a directory under the cache "
                             f"dir ({default_kv_store_dir()}), at most {AUTO_KV_STORE_BYTES >> 30} GiB, so that a "
                             "restart serves repeated prompts by a load; off: none; or a directory or redis:// URL")
    parser.add_argument("--api-key", default=None, secret=True,
                        help="the gateway's --api-key: clients must send 'Authorization: Bearer <key>' (default: "
                             "none, the API is open)")
    parser.add_argument("--service-token", default=None, secret=True,
                        help="the token kvmanager and executor require and the gateway sends (default: a random "
                             "one per run, so only this gateway can call them)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    _ensure_default_model(args.model)
    config = StackConfig(
        model_dir=args.model, host=args.host, kvmanager_port=args.kvmanager_port,
        executor_port=args.executor_port, gateway_port=args.grpc_port, http_port=args.http_port,
        kvmanager_args=shlex.split(args.kvmanager_args),
        executor_args=with_kv_store(shlex.split(args.executor_args), args.kv_store),
        gateway_args=shlex.split(args.gateway_args), timeout=args.startup_timeout,
        api_key=args.api_key or None, service_token=args.service_token or secrets.token_urlsafe(32),
    )
    # SIGTERM (docker stop, systemd) stops the stack the same way Ctrl-C does, and so
    # does SIGINT even where a shell started us in the background with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        stack = start_stack(config)
    except RuntimeError as exc:
        sys.stderr.write(f"kvserve up: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    print(
        f"\nkvserve is up in {time.monotonic() - started:.1f}s (model {args.model.name})\n"
        f"  OpenAI API   {stack.http_url}/v1   (try: curl {stack.http_url}/v1/models)\n"
        f"  gRPC gateway {stack.grpc_address}   (kvserve.v1.Gateway)\n"
        f"  metrics      {stack.http_url}/metrics\n"
        f"  kvmanager    {stack.kvmanager.address}   executor {stack.executor.address}   "
        f"(service token: {'--service-token' if args.service_token else 'generated for this run'})\n"
        + (describe_executor(stack.model_info) if stack.model_info is not None else "")
        + ("  API key      required (Authorization: Bearer ...)\n" if args.api_key else "")
        + "Ctrl-C stops all three.\n",
        flush=True,
    )
    try:
        while all(s.alive() for s in stack.services()):
            time.sleep(0.5)
        dead = [s.module for s in stack.services() if not s.alive()]
        sys.stderr.write(f"kvserve up: {', '.join(dead)} exited; stopping the rest\n")
        code = 1
    except KeyboardInterrupt:
        code = 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    codes = stack.stop()
    print("stopped: " + ", ".join(f"{name} exit {rc}" for name, rc in codes.items()), flush=True)
    return code


COMMANDS = {
    "up": (up, "run kvmanager, executor and gateway locally"),
    "prepare-model": (lambda argv: _run_module("executor.prepare_model", argv),
                      "convert the embedded default model (SmolLM2-135M-Instruct) once"),
    "bench": (lambda argv: _run_module("bench", argv), "benchmark a running system or sweep configurations"),
    "protogen": (lambda argv: _run_module("kvserve.protogen", argv), "regenerate kvserve/v1 stubs from protos/"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: LLM serving with a paged KV cache manager service.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command (see kvserve COMMAND --help)")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    ns = parser.parse_args(argv[:1])
    handler, _ = COMMANDS[ns.command]
    return handler(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
