"""Shared fixtures: real service processes on free loopback ports, and models.

``start_service("kvmanager", "--flag", ...)`` starts ``python -m kvmanager`` on a
free port, waits until its health service says SERVING, and stops it (SIGTERM)
at teardown. ``start_stack(model_dir)`` does that for all three services.

The process stacks, one home each:

* ``module_stack(model_dir, ...)``: kvmanager + executor + gateway (the launcher's
  ``start_stack``), shared by a module's tests, stopped (and the gateway's clean exit
  checked) when the module ends. For tests that only send requests.
* ``service_stack(model_dir, ...)``: the same three started one by one with
  ``start_service``, per test, for tests that kill, stop or restart one of them.
* ``tiny_executor``: one executor of the tiny model (``tiny_executor_args``), per test.
* ``stub``: a KVManager stub on a module's ``server`` fixture (its own kvmanager and flags).
"""
from __future__ import annotations

import os

# The pytest workers and the services they start share the box's cores, each with OpenMP threads.
# libgomp's default has a thread that waits for its team spin for a while, holding a core another
# process's team needs: two modules side by side on 2 cores ran 3.8x longer than with passive
# waits (180 s against 47 s). Set before anything loads torch (libgomp reads it once, at load).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

import httpx
import pytest

from kvserve.config import without_flag_env
from kvserve.launcher import ServiceProcess, Stack, StackConfig, StartupFailed, spawn, start_healthy
from kvserve.launcher import start_stack as launcher_start_stack
from loopback_ports import free_port  # the tests import it from here too

REPO_ROOT = Path(__file__).resolve().parent.parent
PORT_RACE_ATTEMPTS = 3  # start_stack's tries when a port it picked was taken before a service listened
# The default model's sanity question. Asked plainly ("What is the capital of France?") its first
# token is a near-tie (fp32 logits 0.1 apart: "The" vs "L'Étoile, …") that bf16 or quantized
# rounding flips on one CPU and not another; asked for a sentence, the margin is 1.5 nats.
PARIS_QUESTION = "What is the capital of France? Answer in one sentence."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def service_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without KVSERVE_* variables (they would change flag defaults)."""
    env = without_flag_env()
    env.setdefault("OMP_NUM_THREADS", "2")
    env.update(extra or {})
    # A fixed count: the executor's --num-threads auto probe would add its timing runs to every
    # start (tests/test_executor_threads.py starts one with auto on purpose).
    env.setdefault("KVSERVE_NUM_THREADS", env["OMP_NUM_THREADS"])
    return env


def launch(module: str, args: list[str], log_dir: Path, *, port: int | None = None,
           env: dict[str, str] | None = None, wait: bool = True, timeout: float = 120.0) -> ServiceProcess:
    """Starts ``python -m module --port PORT *args`` and (by default) waits for SERVING."""
    port = port or free_port()
    kwargs = dict(port=port, log_path=log_dir / f"{module}-{port}.log", env=service_env(env))
    if wait:
        return start_healthy(module, args, timeout=timeout, **kwargs)
    return spawn(module, args, **kwargs)


@pytest.fixture
def short_tmp_path():
    """A Unix socket's path must fit in 108 bytes; tmp_path under a parallel worker's base
    directory plus two more levels may not."""
    with tempfile.TemporaryDirectory(prefix="kvs-", dir="/tmp") as path:
        yield Path(path)


@pytest.fixture
def start_service(tmp_path):
    """Factory fixture: ``start_service(module, *args, env=None, wait=True)``; all stopped at teardown."""
    started: list[ServiceProcess] = []

    def start(module: str, *args: str, env: dict[str, str] | None = None, wait: bool = True,
              port: int | None = None, timeout: float = 120.0) -> ServiceProcess:
        service = launch(module, list(args), tmp_path, port=port, env=env, wait=wait, timeout=timeout)
        started.append(service)
        return service

    yield start
    for service in reversed(started):
        service.stop()


def start_stack(model_dir: Path, log_dir: Path, *, executor_args: list[str] = (),
                gateway_args: list[str] = (), kvmanager_args: list[str] = (), **config) -> Stack:
    """kvmanager, executor and gateway as three processes on free loopback ports, all healthy;
    ``config``: more ``StackConfig`` fields (``api_key``, ``service_token``, ``timeout``).

    A port is free when picked and bound seconds later (the executor listens once its model is
    loaded); the ports come from this worker's window below the ephemeral range
    (tests/loopback_ports.py), where no other worker or outgoing connection takes them. A service
    that still cannot listen (something outside the tests bound its port) is started again, on
    fresh ports, up to ``PORT_RACE_ATTEMPTS`` times."""
    def on_free_ports() -> StackConfig:
        return StackConfig(
            model_dir=model_dir, kvmanager_port=free_port(), executor_port=free_port(),
            gateway_port=free_port(), http_port=free_port(), kvmanager_args=list(kvmanager_args),
            executor_args=list(executor_args), gateway_args=list(gateway_args), log_dir=log_dir,
            env=service_env(), **config,
        )

    for _ in range(PORT_RACE_ATTEMPTS - 1):
        try:
            return launcher_start_stack(on_free_ports())
        except StartupFailed as exc:
            if "Address already in use" not in str(exc):
                raise
    return launcher_start_stack(on_free_ports())


@pytest.fixture(scope="module")
def module_stack(tmp_path_factory, request):
    """Factory fixture: ``module_stack(model_dir, executor_args=..., gateway_args=..., exit_0=("gateway",))``
    (more keywords: ``start_stack``'s) starts a stack that the module's tests share; at the
    module's end it is stopped and the services named in ``exit_0`` must have exited 0."""
    started: list[tuple[Stack, tuple[str, ...]]] = []
    name = request.module.__name__.rsplit(".", 1)[-1]

    def start(model_dir: Path, *, exit_0: tuple[str, ...] = ("gateway",), **kwargs) -> Stack:
        stack = start_stack(model_dir, tmp_path_factory.mktemp(name), **kwargs)
        started.append((stack, exit_0))
        return stack

    yield start
    for stack, exit_0 in reversed(started):
        codes = stack.stop()
        assert {m: codes[m] for m in exit_0} == dict.fromkeys(exit_0, 0), (codes, stack.gateway.logs()[-3000:])


@pytest.fixture(scope="module")
def stub(server):
    """A KVManager stub on the module's own ``server`` fixture (a kvmanager started with its flags)."""
    from kvserve.v1 import kvmanager_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        yield kvmanager_pb2_grpc.KVManagerStub(channel)


@dataclass
class ServiceStack:
    """kvmanager, executor and gateway started by ``start_service`` (any can be killed and restarted)."""

    kvmanager: ServiceProcess
    executor: ServiceProcess
    gateway: ServiceProcess
    http_port: int
    model_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture
def service_stack(start_service):
    """Factory fixture: ``service_stack(model_dir, *gateway_args, executor_args=())`` starts
    kvmanager, executor and gateway one by one (per test, stopped at its end)."""

    def start(model_dir: Path, *gateway_args: str, executor_args: tuple[str, ...] = ()) -> ServiceStack:
        kvmanager = start_service("kvmanager")
        executor = start_service("executor", "--model", str(model_dir), *executor_args, timeout=300)
        http_port = free_port()
        gateway = start_service("gateway", "--http-port", str(http_port), "--kvmanager-address", kvmanager.address,
                                "--executor-address", executor.address, "--model", str(model_dir), *gateway_args)
        return ServiceStack(kvmanager, executor, gateway, http_port, model_dir)

    return start


# The tiny executor of the executor-service and step-socket tests.
TINY_NUM_BLOCKS = 24
TINY_MAX_MODEL_LEN = 128


def tiny_executor_args(tiny_model_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(tiny_model_dir), "--num-blocks", str(TINY_NUM_BLOCKS),
            "--max-model-len", str(TINY_MAX_MODEL_LEN), "--dtype", "float32", *extra]


def _connected_executor(service: ServiceProcess):
    from kvserve.v1 import executor_pb2, executor_pb2_grpc

    channel = grpc.insecure_channel(service.address)
    stub = executor_pb2_grpc.ExecutorStub(channel)
    return channel, (service, stub, stub.Describe(executor_pb2.DescribeRequest(), timeout=10))


@pytest.fixture
def tiny_executor(start_service, tiny_model_dir):
    """(service, stub, DescribeResponse) of a tiny-model executor (``tiny_executor_args``), per
    test: for a test that stops it."""
    channel, executor = _connected_executor(start_service("executor", *tiny_executor_args(tiny_model_dir)))
    yield executor
    channel.close()


@pytest.fixture(scope="module")
def shared_tiny_executor(tiny_model_dir, tmp_path_factory):
    """``tiny_executor``, one per module, for tests that leave it running. The executor holds no
    state between steps but the KV its blocks hold, and every such test writes (prefills) the
    blocks it reads first, so the tests cannot see each other."""
    service = launch("executor", tiny_executor_args(tiny_model_dir), tmp_path_factory.mktemp("tiny-executor"))
    channel, executor = _connected_executor(service)
    yield executor
    channel.close()
    service.stop()


@pytest.fixture(scope="session")
def cpu_ops():
    """``torch.ops.kvserve_cpu``, built for this CPU (cached); the test skips where it cannot be built."""
    from executor.attention.csrc_loader import csrc_build_script

    try:
        return csrc_build_script().load_cpu()
    except (ImportError, OSError, RuntimeError) as exc:
        pytest.skip(f"the CPU kernels cannot be built here: {exc}")


@pytest.fixture(scope="session")
def executor_kernels() -> None:
    """Builds the CPU kernels here, once, before a test starts an executor: an executor that
    compiled them itself (minutes, on a new checkout) would run past its stack's start timeout."""
    from executor.attention.csrc_loader import csrc_build_script

    try:
        csrc_build_script().load_cpu()
    except (ImportError, OSError, RuntimeError):
        pass  # the executor reports it (or runs without them) itself


@pytest.fixture(scope="session")
def default_model_dir(executor_kernels) -> Path:
    """The embedded SmolLM2-135M-Instruct, converted on first use."""
    from executor.prepare_model import default_model_dir as model_dir, prepare

    return prepare(model_dir())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A 2-layer random-weight Llama with the default model's tokenizer: fast, deterministic, wrong."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, out / name)
    return out


# The modules that take longest (pytest --durations, about 35-150 s each on a 2-core box), first:
# `make test` deals whole modules to parallel workers in collection order, and a long module
# dealt last would run alone at the end.
SLOWEST_MODULES = (
    "test_kv_store_e2e", "test_gateway_multi_executor", "test_structured_outputs", "test_gateway_real_model",
    "test_gateway_recovery", "test_sampling_parity", "test_kv_correctness_e2e", "test_csrc_compile",
    "test_executor_skinny_linear", "test_foundation", "test_step_socket", "test_gateway_kv_shadow",
    "test_gateway_discovery", "test_executor_exactness", "test_gateway_tenants", "test_bench", "test_auth",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(Path(item.nodeid.split("::", 1)[0]).stem, len(rank)))


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Polls ``predicate`` until true or ``timeout`` s pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


class CompletionStream(threading.Thread):
    """A streaming ``/v1/completions`` read in the background (ask for ``logprobs`` to get
    ``token_texts`` and ``logprobs``); ``started`` is set once ``started_after`` tokens came,
    or when the stream ends."""

    def __init__(self, url: str, body: dict, started_after: int = 20, timeout: float = 180):
        super().__init__(daemon=True)
        self.url = url
        self.body = {**body, "stream": True}
        self.started_after = started_after
        self.timeout = timeout
        self.text = ""
        self.token_texts: list[str] = []
        self.logprobs: list[float] = []
        self.finish_reason = None
        self.error = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            self._read()
        except httpx.HTTPError as exc:
            self.error = {"code": None, "message": repr(exc)}
        finally:
            self.started.set()

    def _read(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=self.timeout) as reply:
            if reply.status_code != 200:
                self.error = {"code": reply.status_code, "message": reply.read().decode()}
                return
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.error = chunk["error"]
                    return
                choice = chunk["choices"][0]
                self.text += choice["text"]
                logprobs = choice.get("logprobs") or {}
                self.token_texts += logprobs.get("tokens") or []
                self.logprobs += logprobs.get("token_logprobs") or []
                self.finish_reason = choice["finish_reason"] or self.finish_reason
                if len(self.logprobs) >= self.started_after:
                    self.started.set()
