"""The ground every service stands on: stubs, flags, real processes, health,
reflection, graceful shutdown, bad command lines, compose.yaml."""
from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import REPO_ROOT, service_env
from kvserve.config import EnvArgumentParser
from kvserve.protogen import file_descriptors, generate

def test_committed_stubs_match_the_protos(tmp_path):
    """The committed stubs say what protos/ says, whichever grpcio-tools wrote them: per
    .proto the same FileDescriptorProto, in *_pb2_grpc.py the same service and method
    comments, in *_pb2.pyi the same classes and fields. Bytes are not compared: every
    grpcio-tools release writes its own version checks and layout. And the grpcio and
    protobuf floors in pyproject.toml admit the committed stubs' import-time checks."""
    regenerate = "run `python -m kvserve.protogen`"
    written = generate(tmp_path)
    assert written, "protoc produced nothing"
    fresh = {str(path.relative_to(tmp_path)) for path in written}
    committed = {str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "kvserve" / "v1").glob("*_pb2*")}
    assert not fresh - committed, f"{sorted(fresh - committed)} missing: {regenerate}"
    assert not committed - fresh, f"{sorted(committed - fresh)} have no .proto any more: delete them"

    from google.protobuf import descriptor_pb2

    for proto, expected in file_descriptors().items():
        module = importlib.import_module(proto.removesuffix(".proto").replace("/", ".") + "_pb2")
        path = REPO_ROOT / (proto.removesuffix(".proto") + "_pb2.py")
        assert os.path.samefile(module.__file__, path), f"imported {module.__file__}, not {path}"
        found = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        assert _without_derived_json_names(found) == _without_derived_json_names(expected), (
            f"{path} is stale ({proto} says something else): {regenerate}"
        )
    for path in written:
        path_committed = REPO_ROOT / path.relative_to(tmp_path)
        if path.name.endswith("_pb2_grpc.py"):
            assert _servicer_docstrings(path_committed) == _servicer_docstrings(path), (
                f"{path_committed} is stale (service or rpc comments differ): {regenerate}"
            )
        elif path.suffix == ".pyi":
            assert _declared_names(path_committed) == _declared_names(path), f"{path_committed} is stale: {regenerate}"

    _assert_floors_admit_the_committed_stubs()


def _without_derived_json_names(file):
    """``file`` without the json_names that only repeat the field name in lowerCamelCase:
    protoc's descriptor set spells them out, the descriptor embedded in *_pb2.py does not."""
    file = type(file).FromString(file.SerializeToString())

    def json_name(name: str) -> str:  # protobuf's ToJsonName
        parts = name.split("_")
        return parts[0] + "".join(part[:1].upper() + part[1:] for part in parts[1:])

    def strip(messages) -> None:
        for message in messages:
            for field in [*message.field, *message.extension]:
                if field.json_name == json_name(field.name):
                    field.ClearField("json_name")
            strip(message.nested_type)

    strip(file.message_type)
    for field in file.extension:
        if field.json_name == json_name(field.name):
            field.ClearField("json_name")
    return file


def _servicer_docstrings(path) -> dict[str, str | None]:
    """``{Servicer class or Servicer.method: docstring}``: the .proto's service and rpc comments."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Servicer"):
            found[node.name] = ast.get_docstring(node)
            for method in node.body:
                if isinstance(method, ast.FunctionDef):
                    found[f"{node.name}.{method.name}"] = ast.get_docstring(method)
    return found


def _declared_names(path) -> dict[str, list[str]]:
    """``{class (qualified, "" for the module): annotated names}`` of a .pyi: messages and
    their fields, enums and their values."""
    found = {}

    def visit(body, scope: str) -> None:
        found[scope] = sorted(n.target.id for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{scope}.{node.name}" if scope else node.name)

    visit(ast.parse(path.read_text()).body, "")
    return found


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _assert_floors_admit_the_committed_stubs() -> None:
    """*_pb2_grpc.py refuses a grpcio older than GRPC_GENERATED_VERSION and *_pb2.py a
    protobuf older than its gencode (ValidateProtobufRuntimeVersion): pyproject.toml's
    floors must be at least those, or a fresh install can resolve versions that fail at import."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()

    def floor(package: str) -> tuple[int, ...]:
        match = re.search(rf'"{package}\s*>=\s*([0-9][0-9.]*)', pyproject)
        assert match, f"pyproject.toml has no {package}>= floor"
        return _version(match.group(1))

    for path in sorted((REPO_ROOT / "kvserve" / "v1").glob("*_pb2*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and any(isinstance(t, ast.Name) and t.id == "GRPC_GENERATED_VERSION" for t in node.targets)):
                needed, package = _version(node.value.value), "grpcio"
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "ValidateProtobufRuntimeVersion"):
                needed, package = tuple(arg.value for arg in node.args[1:4]), "protobuf"
            else:
                continue
            assert floor(package) >= needed, (
                f"{path.name} needs {package}>={'.'.join(map(str, needed))}; "
                f"pyproject.toml allows {package}>={'.'.join(map(str, floor(package)))}: raise the floor"
            )


def _imported_top_level_modules(path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_three_services_never_import_each_other():
    packages = {"kvmanager", "executor", "gateway"}
    for package in packages:
        for path in (REPO_ROOT / package).rglob("*.py"):
            others = _imported_top_level_modules(path) & (packages - {package})
            assert not others, f"{path} imports {others}"


@pytest.mark.parametrize("package", ["kvmanager", "gateway"])
def test_kvmanager_and_gateway_never_load_torch(package):
    code = (
        f"import sys, importlib, pkgutil, {package}\n"
        f"for mod in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
        "    if not mod.name.endswith('__main__'): importlib.import_module(mod.name)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=service_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"{package} imports torch"


def test_flags_come_from_environment_and_command_line_wins():
    parser = EnvArgumentParser(prog="t", environ={"KVSERVE_MAX_NUM_SEQS": "7", "KVSERVE_DTYPE": "float16",
                                                  "KVSERVE_ENABLE_X": "false"})
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float16"])
    parser.add_argument("--enable-x", action="store_true")
    assert vars(parser.parse_args([])) == {"max_num_seqs": 7, "dtype": "float16", "enable_x": False}
    assert parser.parse_args(["--max-num-seqs", "3"]).max_num_seqs == 3


@pytest.mark.parametrize("module", ["kvmanager", "executor", "gateway", "kvserve"])
def test_help_exits_zero(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO_ROOT, env=service_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()


def _one_line_failure(args: list[str], env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, env=service_env(env),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, f"{args} should fail\n{out.stdout}\n{out.stderr}"
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line of reason, got:\n{out.stderr}"
    return lines[0]


@pytest.mark.parametrize("module", ["kvmanager", "executor", "gateway"])
def test_unknown_flag_is_one_line(module):
    assert "--no-such-flag" in _one_line_failure([module, "--no-such-flag"])


def test_bad_environment_value_is_one_line():
    assert "KVSERVE_PORT" in _one_line_failure(["kvmanager"], env={"KVSERVE_PORT": "not-a-port"})


def test_port_in_use_is_one_line():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        reason = _one_line_failure(["kvmanager", "--port", str(port)])
    assert str(port) in reason


def test_missing_model_directory_is_one_line(tmp_path):
    missing = tmp_path / "no-model-here"
    assert str(missing) in _one_line_failure(["executor", "--port", "0", "--model", str(missing)])


def _assert_serving_with_reflection(address: str, service_name: str) -> None:
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", service_name):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert service_name in names and "grpc.health.v1.Health" in names


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_kvmanager_serves_health_and_reflection_and_stops_cleanly(start_service, sig):
    service = start_service("kvmanager")
    _assert_serving_with_reflection(service.address, "kvserve.v1.KVManager")
    assert service.stop(sig) == 0, service.logs()


def test_port_from_environment(start_service):
    from conftest import free_port

    port = free_port()
    service = start_service("kvmanager", env={"KVSERVE_PORT": str(port)}, wait=False, port=port)
    from kvserve.health import wait_until_serving

    wait_until_serving(f"127.0.0.1:{port}", 60, is_alive=service.alive)


def test_whole_stack_healthy_then_sigterm_exits_zero(tiny_model_dir, tmp_path):
    from conftest import start_stack

    stack = start_stack(tiny_model_dir, tmp_path, executor_args=["--num-blocks", "64"])
    try:
        _assert_serving_with_reflection(stack.kvmanager.address, "kvserve.v1.KVManager")
        _assert_serving_with_reflection(stack.executor.address, "kvserve.v1.Executor")
        _assert_serving_with_reflection(stack.grpc_address, "kvserve.v1.Gateway")
    finally:
        codes = stack.stop()
    assert codes == {"gateway": 0, "executor": 0, "kvmanager": 0}, {s.module: s.logs()[-2000:] for s in stack.services()}


def test_compose_file_is_valid():
    compose = REPO_ROOT / "compose.yaml"
    if shutil.which("docker-compose"):
        out = subprocess.run(["docker-compose", "-f", str(compose), "config", "-q"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    import yaml

    spec = yaml.safe_load(compose.read_text())
    services = spec["services"]
    assert {"kvmanager", "executor", "gateway"} <= set(services)
    for name in ("kvmanager", "executor", "gateway"):
        assert "kvserve.health" in " ".join(services[name]["healthcheck"]["test"])
    published = [name for name, svc in services.items() if svc.get("ports")]
    assert published == ["gateway"]


def _kvserve_up(model_dir, ports: list[int], log_path):
    return subprocess.Popen(
        [sys.executable, "-m", "kvserve", "up", "--model", str(model_dir),
         "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
         "--kvmanager-port", str(ports[2]), "--executor-port", str(ports[3]),
         "--executor-args", "--num-blocks 64"],
        cwd=REPO_ROOT, env=service_env(), stdout=log_path.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
        # A background shell ignores SIGINT in its children; a terminal's Ctrl-C does not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _services_on(ports: list[int]) -> list[str]:
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "--port" in cmdline and any(f"--port {p}" in cmdline for p in ports):
            found.append(cmdline)
    return found


@pytest.mark.parametrize("how", ["ctrl-c", "launcher-killed"])
def test_kvserve_up_leaves_nothing_running(tiny_model_dir, tmp_path, how):
    from conftest import free_port, wait_for

    ports = [free_port() for _ in range(4)]
    log_path = tmp_path / "up.log"
    up = _kvserve_up(tiny_model_dir, ports, log_path)
    try:
        assert wait_for(lambda: "kvserve is up" in log_path.read_text() or up.poll() is not None, 180), log_path.read_text()
        assert up.poll() is None, log_path.read_text()
        assert len(_services_on(ports[1:])) == 3
        # The banner says what the executor runs: its precision, device and KV cache.
        assert re.search(r"executor +\S+ on cpu, 64 KV blocks of 16 tokens, up to \d+ tokens a request",
                         log_path.read_text()), log_path.read_text()
        if how == "ctrl-c":
            os.killpg(up.pid, signal.SIGINT)  # what a terminal does
            assert up.wait(60) == 0, log_path.read_text()
            assert "gateway exit 0, executor exit 0, kvmanager exit 0" in log_path.read_text()
        else:
            up.kill()
            up.wait()
        assert wait_for(lambda: not _services_on(ports[1:]), 30), _services_on(ports[1:])
    finally:
        if up.poll() is None:
            up.kill()
