"""How the launcher starts a stack: all three services at once, one health wait for all, the
gateway connected before ``start_stack`` returns, and start-up failures named with their log
tail. Behaviour only; start-up times are measured by hand (``kvserve up`` prints its own)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest

import kvserve.launcher as launcher
from conftest import free_port, service_env
from kvserve.health import check
from kvserve.launcher import StackConfig, StartupFailed, start_stack

pytestmark = pytest.mark.timeout(300)


def _config(model_dir, log_dir, **kwargs) -> StackConfig:
    return StackConfig(model_dir=model_dir, kvmanager_port=free_port(), executor_port=free_port(),
                       gateway_port=free_port(), http_port=free_port(), log_dir=log_dir, env=service_env(),
                       timeout=kwargs.pop("timeout", 240), **kwargs)


@pytest.fixture
def recorded(monkeypatch):
    """Every spawn and every first SERVING the launcher sees, in order, with the processes."""
    events: list[tuple[str, str]] = []
    processes: list[launcher.ServiceProcess] = []
    modules: dict[str, str] = {}
    real_spawn, real_check = launcher.spawn, launcher.check

    def spawn(module, args, **kwargs):
        service = real_spawn(module, args, **kwargs)
        processes.append(service)
        modules[service.address] = module
        events.append(("spawn", module))
        return service

    def check_(address, *args, **kwargs):
        serving = real_check(address, *args, **kwargs)
        if serving and ("serving", modules.get(address)) not in events:
            events.append(("serving", modules.get(address)))
            # Who was running when this one first answered.
            events.append(("alive", ",".join(sorted(p.module for p in processes if p.alive()))))
        return serving

    monkeypatch.setattr(launcher, "spawn", spawn)
    monkeypatch.setattr(launcher, "check", check_)
    return events, processes


def test_start_stack_starts_all_three_at_once_and_returns_connected(tiny_model_dir, tmp_path, recorded):
    events, processes = recorded
    stack = start_stack(_config(tiny_model_dir, tmp_path, executor_args=["--num-blocks", "64"]))
    try:
        first_serving = next(i for i, (kind, _) in enumerate(events) if kind == "serving")
        spawned_before = [name for kind, name in events[:first_serving] if kind == "spawn"]
        assert spawned_before == ["kvmanager", "executor", "gateway"], events
        # The first to answer found all three processes running (none waited for another's health).
        assert events[first_serving + 1] == ("alive", "executor,gateway,kvmanager"), events
        assert {name for kind, name in events if kind == "serving"} == {"kvmanager", "executor", "gateway"}
        # Returned only once the gateway has its session: the model's limits are known without a request.
        models = httpx.get(stack.http_url + "/v1/models", timeout=30).json()
        assert models["data"][0]["max_model_len"] == 2048
        health = httpx.get(stack.http_url + "/health", timeout=30)
        assert health.status_code == 200, health.text
        reply = httpx.post(stack.http_url + "/v1/completions", timeout=120,
                           json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text
    finally:
        codes = stack.stop()
    assert codes == {"gateway": 0, "executor": 0, "kvmanager": 0}
    assert "connected" in stack.gateway.logs()


def test_a_service_that_dies_during_start_up_is_named_with_its_log_tail(tiny_model_dir, tmp_path, recorded):
    _, processes = recorded
    config = _config(tiny_model_dir, tmp_path, executor_args=["--block-size", "0"])
    with pytest.raises(StartupFailed) as failure:
        start_stack(config)
    message = str(failure.value)
    assert message.startswith("executor did not become healthy: the process exited (code 1)"), message
    assert "executor: error:" in message and "block" in message.split("executor: error:")[1], message
    assert failure.value.service.module == "executor"
    assert [p.module for p in processes] == ["kvmanager", "executor", "gateway"]
    assert not any(p.alive() for p in processes), "what started is stopped"
    for port in (config.kvmanager_port, config.executor_port, config.gateway_port):
        assert not check(f"127.0.0.1:{port}", timeout=0.5)


def test_timeout_names_a_pending_service_and_stops_everything(tiny_model_dir, tmp_path, recorded):
    _, processes = recorded
    with pytest.raises(StartupFailed) as failure:
        start_stack(_config(tiny_model_dir, tmp_path, timeout=0.3))
    assert "not SERVING after 0s" in str(failure.value)
    assert len(processes) == 3 and not any(p.alive() for p in processes)


def test_a_port_in_use_fails_before_anything_starts(tiny_model_dir, tmp_path, recorded):
    _, processes = recorded
    config = _config(tiny_model_dir, tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", config.http_port))
        taken.listen()
        with pytest.raises(RuntimeError, match=rf"gateway \(HTTP\): cannot listen on 127.0.0.1:{config.http_port}"):
            start_stack(config)
    assert processes == []


def test_health_check_is_not_held_back_by_another_channels_reconnect_backoff(tmp_path):
    """grpc shares a subchannel between the channels of a process to one address; while another
    channel to it sits in reconnect backoff, a probe on the shared subchannel fails fast even
    though the server is up. ``check`` has a subchannel of its own: its first try after the
    server starts succeeds."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    other = grpc.insecure_channel(address)  # e.g. a client that tried before the server was up
    try:
        other.subscribe(lambda state: None, try_to_connect=True)
        deadline = time.monotonic() + 4  # a few refused attempts: the backoff has grown past 1 s
        while time.monotonic() < deadline:
            assert not check(address, timeout=0.2)
            time.sleep(0.1)
        server = subprocess.Popen([sys.executable, "-m", "kvmanager", "--port", str(port)], cwd=launcher.REPO_ROOT,
                                  env=service_env(), stdout=(tmp_path / "log").open("wb"), stderr=subprocess.STDOUT)
        try:
            while True:  # until the port accepts connections
                assert server.poll() is None, (tmp_path / "log").read_text()
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.02)
            serving = False
            for _ in range(20):  # the health status is set right after the port opens
                serving = check(address, timeout=2.0)
                if serving:
                    break
                time.sleep(0.01)
            assert serving
        finally:
            server.terminate()
            server.wait(30)
    finally:
        other.close()
