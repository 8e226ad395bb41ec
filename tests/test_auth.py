"""Authentication and TLS: the gateway's --api-key (HTTP /v1/* and gRPC Gateway), the internal
--service-token on kvmanager and executor (sent by the gateway), TLS with a self-signed CA made
here. Real processes; health and reflection stay open throughout."""
from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import REPO_ROOT, free_port, service_env
from kvserve.auth import BearerToken, bearer_metadata
from kvserve.health import check, wait_until_serving
from kvserve.launcher import StackConfig
from kvserve.launcher import start_stack as launcher_start_stack
from kvserve.v1 import executor_pb2, executor_pb2_grpc, gateway_pb2, gateway_pb2_grpc, kvmanager_pb2
from kvserve.v1 import kvmanager_pb2_grpc

pytestmark = pytest.mark.timeout(300)

API_KEY = "sk-test-api-key-0123456789"
SERVICE_TOKEN = "internal-service-token-abcdef"


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _reflected_services(address: str, credentials: grpc.ChannelCredentials | None = None) -> set[str]:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=10)
        return {s.name for reply in replies for s in reply.list_services_response.service}


# --- the token itself -------------------------------------------------------------------


def test_bearer_token_accepts_exactly_its_secret():
    token = BearerToken("s3cret")
    assert token.matches_header("Bearer s3cret")
    assert token.matches_header(b"bearer s3cret")  # the scheme is case-insensitive (RFC 7235)
    assert token.matches_header("  Bearer   s3cret ")
    for wrong in (None, "", "s3cret", "Bearer", "Bearer ", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret",
                  "Bearer S3CRET"):
        assert not token.matches_header(wrong), wrong
    assert "s3cret" not in repr(token)
    with pytest.raises(ValueError):
        BearerToken("")


def test_secrets_are_not_shown_in_help():
    env = {**service_env(), "KVSERVE_API_KEY": "visible-if-leaked", "KVSERVE_SERVICE_TOKEN": "visible-if-leaked"}
    for command in (["gateway", "--help"], ["kvmanager", "--help"], ["kvserve", "up", "--help"]):
        out = subprocess.run([sys.executable, "-m", *command], cwd=REPO_ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "--service-token" in out.stdout or "--api-key" in out.stdout
        assert "visible-if-leaked" not in out.stdout, command


def test_tls_cert_without_key_is_a_flag_error():
    out = subprocess.run([sys.executable, "-m", "kvmanager", "--port", str(free_port()), "--tls-cert-file",
                          str(REPO_ROOT / "README.md")], cwd=REPO_ROOT, env=service_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "--tls-cert-file and --tls-key-file go together" in out.stderr


def test_kvserve_up_generates_a_service_token_unless_given(monkeypatch, tmp_path):
    """`kvserve up` hands all three a fresh random token (via the environment) unless one is set."""
    from kvserve import cli

    seen: list[StackConfig] = []

    def fake_start_stack(config):
        seen.append(config)
        raise KeyboardInterrupt

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(cli, "start_stack", fake_start_stack)
    monkeypatch.delenv("KVSERVE_SERVICE_TOKEN", raising=False)
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    for _ in range(2):
        assert cli.up(["--model", str(tmp_path)]) == 130
    monkeypatch.setenv("KVSERVE_SERVICE_TOKEN", "chosen")
    monkeypatch.setenv("KVSERVE_API_KEY", "key")
    assert cli.up(["--model", str(tmp_path)]) == 130
    generated = [c.service_token for c in seen[:2]]
    assert all(t and len(t) >= 32 for t in generated) and generated[0] != generated[1]
    assert seen[0].api_key is None
    assert (seen[2].service_token, seen[2].api_key) == ("chosen", "key")


# --- kvmanager alone ---------------------------------------------------------------------


def test_kvmanager_with_service_token_refuses_other_callers_but_not_health(start_service):
    service = start_service("kvmanager", "--service-token", SERVICE_TOKEN)
    request = kvmanager_pb2.GetStatsRequest(pool_id="nope")
    with grpc.insecure_channel(service.address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        assert _code(lambda: stub.GetStats(request, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        for wrong in ("Bearer wrong", SERVICE_TOKEN, f"Basic {SERVICE_TOKEN}"):
            assert _code(lambda: stub.GetStats(request, timeout=10, metadata=[("authorization", wrong)])) \
                == grpc.StatusCode.UNAUTHENTICATED, wrong
        try:
            stub.GetStats(request, timeout=10)
        except grpc.RpcError as exc:
            assert "service token" in exc.details() and SERVICE_TOKEN not in exc.details()
        # With the token the call reaches kvmanager (which does not know the pool).
        assert _code(lambda: stub.GetStats(request, timeout=10, metadata=bearer_metadata(SERVICE_TOKEN))) \
            == grpc.StatusCode.NOT_FOUND
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert check(service.address)
    assert "kvserve.v1.KVManager" in _reflected_services(service.address)
    assert SERVICE_TOKEN not in service.logs()


# --- the whole stack with an API key and a service token ----------------------------------


@pytest.fixture(scope="module")
def secured_stack(module_stack, tiny_model_dir):
    return module_stack(tiny_model_dir, executor_args=["--num-blocks", "64"], timeout=240, api_key=API_KEY,
                        service_token=SERVICE_TOKEN, exit_0=("gateway", "executor", "kvmanager"))


def _completion(stack, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}  # no model: the served one
    return httpx.post(stack.http_url + "/v1/completions", json=body, headers=headers or {}, timeout=120)


def test_http_v1_needs_the_api_key(secured_stack):
    url = secured_stack.http_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/responses"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                             ("GET", "/tokenizer_info")):
            reply = httpx.request(method, url + path, headers=headers, json={"prompt": "x"}, timeout=30)
            assert reply.status_code == 401, (method, path, headers, reply.text)
            error = reply.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == 401
            assert "API key" in error["message"] and API_KEY not in reply.text
            assert reply.headers["www-authenticate"] == "Bearer"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    models = httpx.get(url + "/v1/models", headers=auth, timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["max_model_len"]
    reply = _completion(secured_stack, auth)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert _completion(secured_stack, {"authorization": f"bearer {API_KEY}"}).status_code == 200


def test_the_gateway_steps_over_the_executors_socket_with_the_service_token(secured_stack):
    assert _completion(secured_stack, {"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    logs = secured_stack.gateway.logs()
    assert '"step_socket_open"' in logs and "step_socket_not_used" not in logs
    assert SERVICE_TOKEN not in logs + secured_stack.executor.logs()


def test_openai_client_with_the_key_works_and_without_it_gets_authentication_error(secured_stack):
    import openai

    good = openai.OpenAI(base_url=secured_stack.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    name = good.models.list().data[0].id
    assert good.completions.create(model=name, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=secured_stack.http_url + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health_and_metrics_stay_open(secured_stack):
    health = httpx.get(secured_stack.http_url + "/health", timeout=30)
    assert health.status_code == 200, health.text
    assert health.json()["kvmanager"] == "SERVING" and health.json()["executor"] == "SERVING"
    metrics = httpx.get(secured_stack.http_url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    for service in secured_stack.services():
        assert check(service.address), service.module


def test_grpc_gateway_needs_the_api_key(secured_stack):
    address = secured_stack.grpc_address
    request = gateway_pb2.GenerateRequest(text="Hello", params=gateway_pb2.GenerationParams(max_tokens=3))
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        info = gateway_pb2.GetModelInfoRequest()
        assert _code(lambda: stub.GetModelInfo(info, timeout=30)) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: list(stub.Generate(request, timeout=30))) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: list(stub.Generate(request, timeout=30, metadata=bearer_metadata("wrong")))) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetModelInfo(info, timeout=30, metadata=bearer_metadata(API_KEY)).max_model_len > 0
        replies = list(stub.Generate(request, timeout=60, metadata=bearer_metadata(API_KEY)))
        assert replies[-1].usage.completion_tokens == 3
    assert "kvserve.v1.Gateway" in _reflected_services(address)


def test_kvmanager_and_executor_refuse_callers_without_the_service_token(secured_stack):
    with grpc.insecure_channel(secured_stack.executor.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        assert _code(lambda: stub.Describe(executor_pb2.DescribeRequest(), timeout=30)) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Describe(executor_pb2.DescribeRequest(), timeout=30,
                             metadata=bearer_metadata(SERVICE_TOKEN)).block_size > 0
    with grpc.insecure_channel(secured_stack.kvmanager.address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        assert _code(lambda: stub.GetStats(kvmanager_pb2.GetStatsRequest(pool_id="x"), timeout=30)) \
            == grpc.StatusCode.UNAUTHENTICATED
    # ... while the gateway, which has it, served the requests of the tests above.
    assert _completion(secured_stack, {"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_secrets_stay_off_command_lines_and_logs(secured_stack):
    for service in secured_stack.services():
        cmdline = " ".join(psutil.Process(service.proc.pid).cmdline())
        assert SERVICE_TOKEN not in cmdline and API_KEY not in cmdline, service.module
        logs = service.logs()
        assert SERVICE_TOKEN not in logs and API_KEY not in logs, service.module


def test_gateway_with_the_wrong_service_token_says_why(secured_stack, start_service, tiny_model_dir):
    """Health is open, so a misconfigured gateway looks healthy; its requests fail 503 naming the refusal."""
    http_port = free_port()
    gateway = start_service(
        "gateway", "--http-port", str(http_port), "--model", str(tiny_model_dir),
        "--kvmanager-address", secured_stack.kvmanager.address,
        "--executor-address", secured_stack.executor.address, env={"KVSERVE_SERVICE_TOKEN": "not-the-token"})
    url = f"http://127.0.0.1:{http_port}"
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    reply = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 503, reply.text
    assert "UNAUTHENTICATED" in reply.json()["error"]["message"]
    assert "not-the-token" not in gateway.logs()


def test_start_stack_fails_at_once_when_a_dependency_refuses_the_gateways_token(tiny_model_dir, tmp_path):
    config = StackConfig(
        model_dir=tiny_model_dir, kvmanager_port=free_port(), executor_port=free_port(),
        gateway_port=free_port(), http_port=free_port(), executor_args=["--num-blocks", "64"],
        kvmanager_args=["--service-token", "another-token"], log_dir=tmp_path, env=service_env(), timeout=600,
        service_token=SERVICE_TOKEN,
    )
    with pytest.raises(RuntimeError) as failure:  # long before the timeout
        launcher_start_stack(config)
    message = str(failure.value)
    assert message.startswith("gateway did not become healthy: the gateway cannot serve:"), message
    assert "kvmanager" in message and "UNAUTHENTICATED" in message
    assert SERVICE_TOKEN not in message and "another-token" not in message


# --- TLS -----------------------------------------------------------------------------------


def _self_signed(tmp_path):
    """A CA and a server certificate it signed, for 127.0.0.1 and localhost."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvserve test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "server.pem", "key": tmp_path / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return paths


def test_tls_end_to_end(start_service, tiny_model_dir, tmp_path):
    """kvmanager and executor serve TLS and want the token; the gateway reaches them over TLS
    (--tls-ca-file) and serves HTTPS and gRPC over TLS itself."""
    pem = _self_signed(tmp_path)
    roots = pem["ca"].read_bytes()
    tls_args = ["--tls-cert-file", str(pem["cert"]), "--tls-key-file", str(pem["key"])]
    env = {"KVSERVE_SERVICE_TOKEN": SERVICE_TOKEN}
    kvmanager = start_service("kvmanager", *tls_args, env=env, wait=False)
    executor = start_service("executor", "--model", str(tiny_model_dir), "--num-blocks", "64", *tls_args,
                             env=env, wait=False)
    for service in (kvmanager, executor):
        wait_until_serving(service.address, 240, is_alive=service.alive, root_certificates=roots)
        assert not check(service.address)  # plaintext gets nowhere
        health = subprocess.run([sys.executable, "-m", "kvserve.health", service.address, "--tls-ca-file",
                                 str(pem["ca"])], cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True,
                                timeout=60)
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
    credentials = grpc.ssl_channel_credentials(roots)
    with grpc.secure_channel(executor.address, credentials) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        assert _code(lambda: stub.Describe(executor_pb2.DescribeRequest(), timeout=30)) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Describe(executor_pb2.DescribeRequest(), timeout=30,
                             metadata=bearer_metadata(SERVICE_TOKEN)).block_size > 0

    http_port = free_port()
    gateway = start_service(
        "gateway", "--http-port", str(http_port), "--model", str(tiny_model_dir),
        "--kvmanager-address", kvmanager.address, "--executor-address", executor.address,
        "--tls-ca-file", str(pem["ca"]), *tls_args, env={**env, "KVSERVE_API_KEY": API_KEY}, wait=False)
    wait_until_serving(gateway.address, 120, is_alive=gateway.alive, root_certificates=roots)
    url = f"https://127.0.0.1:{http_port}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(url + "/health", verify=str(pem["ca"]), timeout=30).status_code == 200
    with pytest.raises(httpx.ConnectError):  # the CA is not trusted by default
        httpx.get(url + "/health", timeout=30)
    assert httpx.get(url + "/v1/models", verify=str(pem["ca"]), timeout=30).status_code == 401
    reply = httpx.post(url + "/v1/completions", verify=str(pem["ca"]), headers=auth, timeout=120,
                       json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200, reply.text + gateway.logs()[-2000:]
    with grpc.secure_channel(gateway.address, credentials) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        assert stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=30,
                                 metadata=bearer_metadata(API_KEY)).max_model_len > 0
    assert "kvserve.v1.Gateway" in _reflected_services(gateway.address, credentials)
