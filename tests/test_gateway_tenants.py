"""Tenants through the gateway (issue 36), against real kvmanager + executor processes (tiny model).

* ``keyed``: a stack whose gateway names tenants by API key (--api-keys-file) and has the
  admin API (--admin-key, kvmanager with the same key), on a small pool (64 blocks of 16).
* ``headed``: a stack whose gateway lets the X-Kvserve-Tenant header pick a tenant (--tenants).

Prompts are token ids (random, seeded), so the blocks they fill are exactly known.
"""
from __future__ import annotations

import json
import random

import grpc
import httpx
import pytest

from conftest import free_port, wait_for
from gateway.detokenizer import ModelTokenizer
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc, kvmanager_pb2, kvmanager_pb2_grpc

pytestmark = pytest.mark.timeout(600)

BLOCK = 16
NUM_BLOCKS = 64
ADMIN_KEY = "admin-secret"
KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
ALPHA = {"Authorization": "Bearer key-alpha"}
BETA = {"Authorization": "Bearer key-beta"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
_rng = random.Random(36)


def tokens(n: int) -> list[int]:
    return [_rng.randrange(100, 49000) for _ in range(n)]


@pytest.fixture(scope="module")
def keyed(module_stack, tiny_model_dir, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("gateway-tenants-keys") / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    stack = module_stack(tiny_model_dir, executor_args=["--num-blocks", str(NUM_BLOCKS)],
                         kvmanager_args=["--admin-key", ADMIN_KEY],
                         gateway_args=["--api-keys-file", str(keys_file), "--admin-key", ADMIN_KEY])
    # The launcher's probe takes UNAUTHENTICATED (it has no key) as up: wait for the executor here.
    assert wait_for(lambda: httpx.get(stack.http_url + "/health").status_code == 200, timeout=180), \
        stack.gateway.logs()[-3000:]
    return stack


@pytest.fixture(scope="module")
def headed(module_stack, tiny_model_dir):
    return module_stack(tiny_model_dir, gateway_args=["--tenants", "red,blue"], exit_0=())


def complete(stack, headers: dict, prompt, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(stack.http_url + "/v1/completions", json=body, headers=headers, timeout=120)


def cached(stack, headers: dict, prompt, **fields) -> int:
    reply = complete(stack, headers, prompt, **fields)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def pool_tenants(stack) -> dict[str, kvmanager_pb2.TenantStats]:
    with grpc.insecure_channel(stack.kvmanager.address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerStub(channel)
        stats = stub.GetStats(kvmanager_pb2.GetStatsRequest(pool_id=f"executor@{stack.executor.address}"))
    return {t.tenant: t for t in stats.tenants}


def assert_4xx(reply: httpx.Response, status: int, *words: str) -> None:
    assert reply.status_code == status, reply.text
    message = reply.json()["error"]["message"]
    for word in words:
        assert word in message, message


# --- (a) isolation, and the shareable range -------------------------------------------------------

def test_tenants_never_hit_each_others_cache(keyed):
    prompt = tokens(100)  # 6 full blocks before the last token
    assert cached(keyed, ALPHA, prompt) == 0
    assert wait_for(lambda: cached(keyed, ALPHA, prompt) == 96, timeout=5)
    assert cached(keyed, BETA, prompt) == 0  # the same tokens, another tenant: nothing shared
    assert wait_for(lambda: cached(keyed, BETA, prompt) == 96, timeout=5)
    tenants = pool_tenants(keyed)
    assert tenants["alpha"].num_cached_blocks >= 6 and tenants["beta"].num_cached_blocks >= 6, tenants
    assert tenants["alpha"].prefix_cache_hits >= 96 and tenants["beta"].prefix_cache_hits >= 96


def test_shared_prefix_is_cached_once_for_all_tenants(keyed):
    prompt = tokens(120)
    shared = 40  # 2 whole blocks (32 tokens) hashed in the shared namespace
    assert cached(keyed, ALPHA, prompt, kv_shared_prefix_tokens=shared) == 0
    assert wait_for(lambda: cached(keyed, ALPHA, prompt, kv_shared_prefix_tokens=shared) == 112, timeout=5)
    # beta hits the shared range alpha computed, and nothing of alpha's own blocks after it
    assert cached(keyed, BETA, prompt, kv_shared_prefix_tokens=shared) == 32
    # without marking it shareable, beta's hashes are its own: no hit
    assert cached(keyed, BETA, tokens(8) + prompt) == 0
    assert pool_tenants(keyed)["shared"].num_cached_blocks >= 2


def test_chat_shares_the_system_prompt(keyed, tiny_model_dir):
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    tokenizer = ModelTokenizer(tiny_model_dir)
    full = tokenizer.encode(tokenizer.apply_chat_template([system, {"role": "user", "content": "Hi alpha"}], True))
    alone = tokenizer.encode(tokenizer.apply_chat_template([system], False))
    common = next(i for i, (a, b) in enumerate(zip(alone + [-1], full)) if a != b)
    expected = common // BLOCK * BLOCK
    assert expected >= 32

    def chat(headers, user):
        body = {"messages": [system, {"role": "user", "content": user}], "max_tokens": 2, "temperature": 0,
                "kv_share_system_prompt": True}
        reply = httpx.post(keyed.http_url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    chat(ALPHA, "Hi alpha")
    assert wait_for(lambda: chat(BETA, "Hi beta") == expected, timeout=5)  # the system prompt, no more


# --- (b) bad input: a clear 4xx each, and the server serves on -----------------------------------

def test_bad_cache_terms_are_400(keyed):
    prompt = tokens(20)
    for fields, word in [({"kv_cache_ttl_s": 0}, "kv_cache_ttl_s"), ({"kv_cache_ttl_s": 1e9}, "kv_cache_ttl_s"),
                         ({"kv_cache_priority": "urgent"}, "kv_cache_priority"),
                         ({"kv_shared_prefix_tokens": 21}, "kv_shared_prefix_tokens"),
                         ({"kv_shared_prefix_tokens": -1}, "kv_shared_prefix_tokens"),
                         ({"kv_cache_ttl_s": "soon"}, "kv_cache_ttl_s")]:
        assert_4xx(complete(keyed, ALPHA, prompt, **fields), 400, word)
    assert cached(keyed, ALPHA, prompt, kv_cache_ttl_s=60, kv_cache_priority="low",
                  kv_shared_prefix_tokens=20) == 0
    assert complete(keyed, {"Authorization": "Bearer nope"}, prompt).status_code == 401
    assert complete(keyed, {}, prompt).status_code == 401


def test_a_key_names_the_tenant_and_the_header_is_ignored(keyed):
    prompt = tokens(40)
    cached(keyed, ALPHA, prompt)
    assert wait_for(lambda: cached(keyed, ALPHA, prompt) == 32, timeout=5)
    assert cached(keyed, {**BETA, "X-Kvserve-Tenant": "alpha"}, prompt) == 0


def test_header_picks_a_listed_tenant(headed):
    prompt = tokens(40)
    assert_4xx(complete(headed, {"X-Kvserve-Tenant": "green"}, prompt), 400, "x-kvserve-tenant", "green")
    assert_4xx(complete(headed, {"X-Kvserve-Tenant": "bad name!"}, prompt), 400, "x-kvserve-tenant")
    assert_4xx(complete(headed, {"X-Kvserve-Tenant": "shared"}, prompt), 400, "reserved")
    assert cached(headed, {"X-Kvserve-Tenant": "red"}, prompt) == 0
    assert wait_for(lambda: cached(headed, {"X-Kvserve-Tenant": "red"}, prompt) == 32, timeout=5)
    assert cached(headed, {"X-Kvserve-Tenant": "blue"}, prompt) == 0
    assert cached(headed, {}, prompt) == 0  # the default tenant
    # no admin key: the admin API is off
    assert_4xx(httpx.get(headed.http_url + "/admin/v1/tenants", headers=ADMIN), 404, "--admin-key")


def test_admin_bad_input(keyed):
    url = keyed.http_url + "/admin/v1"
    assert httpx.get(url + "/tenants").status_code == 401
    assert httpx.get(url + "/tenants", headers=ALPHA).status_code == 401  # an API key is no admin key
    assert_4xx(httpx.put(url + "/tenants/alpha", json={"quota_blocks": -1}, headers=ADMIN), 400, "quota_blocks")
    assert_4xx(httpx.put(url + "/tenants/alpha", json={"weight": 0}, headers=ADMIN), 400, "weight")
    assert_4xx(httpx.put(url + "/tenants/bad%20name", json={}, headers=ADMIN), 400, "tenant")
    assert_4xx(httpx.put(url + "/tenants/alpha", json={"burst": 1}, headers=ADMIN), 400, "burst")
    too_big = httpx.post(url + "/pins", json={"tenant": "alpha", "token_ids": tokens(NUM_BLOCKS * BLOCK + 40)},
                         headers=ADMIN, timeout=60)
    assert too_big.status_code in (400, 409), too_big.text
    assert "pool" in too_big.json()["error"]["message"]
    assert_4xx(httpx.post(url + "/pins", json={"text": "a", "token_ids": [5]}, headers=ADMIN), 400, "exactly one")
    assert_4xx(httpx.get(url + "/pins/123456789", headers=ADMIN), 404)
    assert_4xx(httpx.get(url + "/pins/abc", headers=ADMIN), 400, "pin id")
    reply = httpx.put(url + "/tenants/alpha", json={"weight": 2, "quota_blocks": 0}, headers=ADMIN)
    assert reply.status_code == 200, reply.text
    assert cached(keyed, ALPHA, tokens(20)) == 0  # still serving


# --- (c) pins ----------------------------------------------------------------------------------

def test_pinned_prefix_survives_a_flood_and_unpins(keyed):
    url = keyed.http_url + "/admin/v1"
    prefix = tokens(4 * BLOCK)
    reply = httpx.post(url + "/pins", json={"tenant": "alpha", "token_ids": prefix}, headers=ADMIN, timeout=120)
    assert reply.status_code == 200, reply.text
    pin = reply.json()
    assert [(p["num_blocks"], p["num_blocks_held"]) for p in pin["pools"]] == [(4, 4)], pin
    victim = tokens(50)
    cached(keyed, BETA, victim)
    for _ in range(12):  # 12 x 19 blocks through a pool of 64
        cached(keyed, BETA, tokens(300))
        cached(keyed, ALPHA, tokens(300))
    assert cached(keyed, BETA, victim) == 0  # the flood evicted what was not pinned
    assert cached(keyed, ALPHA, prefix + tokens(10)) >= 4 * BLOCK
    assert cached(keyed, BETA, prefix + tokens(10)) == 0  # alpha's pin, not beta's
    assert pool_tenants(keyed)["alpha"].num_pinned_blocks == 4
    listed = httpx.get(url + "/tenants", headers=ADMIN).json()
    alpha = next(t for t in listed["pools"][0]["tenants"] if t["tenant"] == "alpha")
    assert alpha["num_pinned_blocks"] == 4 and alpha["weight"] == 2
    metrics = httpx.get(keyed.http_url + "/metrics").text
    assert 'kvserve:tenant_pinned_blocks{model_name=' in metrics and 'tenant="alpha"} 4.0' in metrics
    assert 'kvserve:tenant_requests_total{' in metrics
    got = httpx.get(f"{url}/pins/{pin['pin_id']}", headers=ADMIN)
    assert got.status_code == 200 and got.json()["pools"][0]["num_blocks_held"] == 4
    gone = httpx.delete(f"{url}/pins/{pin['pin_id']}", headers=ADMIN)
    assert gone.status_code == 200 and gone.json()["num_blocks_released"] == 4, gone.text
    assert httpx.get(f"{url}/pins/{pin['pin_id']}", headers=ADMIN).status_code == 404
    assert pool_tenants(keyed)["alpha"].num_pinned_blocks == 0


def test_shared_pin_of_chat_messages(keyed):
    url = keyed.http_url + "/admin/v1"
    system = [{"role": "system", "content": "Shared instructions for every tenant. " * 10}]
    reply = httpx.post(url + "/pins", json={"shared": True, "messages": system}, headers=ADMIN, timeout=120)
    assert reply.status_code == 200, reply.text
    pin = reply.json()
    blocks = pin["pools"][0]["num_blocks"]
    assert blocks >= 2 and pin["pools"][0]["num_blocks_held"] == blocks
    body = {"messages": system + [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0,
            "kv_share_system_prompt": True}
    chat = httpx.post(keyed.http_url + "/v1/chat/completions", json=body, headers=BETA, timeout=120)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK
    assert httpx.delete(f"{url}/pins/{pin['pin_id']}", headers=ADMIN).status_code == 200


# --- (d) gRPC ------------------------------------------------------------------------------------

def test_grpc_carries_tenant_and_cache_terms(keyed):
    prompt = tokens(40)

    def generate(key: str | None, **params) -> gateway_pb2.Usage:
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        with grpc.insecure_channel(keyed.gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                                  params=gateway_pb2.GenerationParams(max_tokens=2, **params))
            replies = list(stub.Generate(request, metadata=metadata, timeout=60))
        return replies[-1].usage

    assert generate("key-alpha", kv_cache_priority=gateway_pb2.KV_CACHE_PRIORITY_LOW,
                    kv_cache_ttl_s=600).cached_tokens == 0
    assert wait_for(lambda: generate("key-alpha").cached_tokens == 32, timeout=5)
    assert generate("key-beta").cached_tokens == 0
    assert generate("key-beta", kv_shared_prefix_tokens=40).cached_tokens == 0  # nobody shared it yet
    assert generate("key-alpha", kv_shared_prefix_tokens=40).cached_tokens == 32  # shared blocks from beta
    for params, word in [({"kv_cache_ttl_s": 0}, "kv_cache_ttl_s"), ({"kv_shared_prefix_tokens": 41},
                                                                    "kv_shared_prefix_tokens"),
                         ({"kv_cache_priority": 9}, "kv_cache_priority")]:
        with pytest.raises(grpc.RpcError) as info:
            generate("key-alpha", **params)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        generate(None)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_tenant_metadata(headed):
    prompt = tokens(40)

    def generate(tenant: str | None) -> int:
        metadata = (("x-kvserve-tenant", tenant),) if tenant else ()
        with grpc.insecure_channel(headed.gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                                  params=gateway_pb2.GenerationParams(max_tokens=2))
            return list(stub.Generate(request, metadata=metadata, timeout=60))[-1].usage.cached_tokens

    generate("blue")
    assert wait_for(lambda: generate("blue") == 32, timeout=5)
    assert generate("red") == 0
    with pytest.raises(grpc.RpcError) as info:
        generate("green")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-kvserve-tenant" in info.value.details()


def test_pin_is_computed_on_every_executor(start_service, tiny_model_dir):
    kvmanager = start_service("kvmanager", "--admin-key", ADMIN_KEY)
    executors = [start_service("executor", "--model", str(tiny_model_dir), "--num-blocks", str(NUM_BLOCKS),
                               timeout=300) for _ in range(2)]
    http_port = free_port()
    start_service("gateway", "--http-port", str(http_port), "--kvmanager-address", kvmanager.address,
                  "--executor-address", ",".join(e.address for e in executors), "--model", str(tiny_model_dir),
                  "--tenants", "alpha", "--admin-key", ADMIN_KEY)
    url = f"http://127.0.0.1:{http_port}"
    assert wait_for(lambda: httpx.get(url + "/health").status_code == 200, timeout=60)
    prefix = tokens(3 * BLOCK + 5)
    reply = httpx.post(url + "/admin/v1/pins", json={"tenant": "alpha", "token_ids": prefix}, headers=ADMIN,
                       timeout=120)
    assert reply.status_code == 200, reply.text
    pools = reply.json()["pools"]
    assert len(pools) == 2 and all(p["num_blocks"] == 3 == p["num_blocks_held"] for p in pools), pools
    body = {"prompt": prefix + tokens(5), "max_tokens": 1}
    miss = httpx.post(url + "/v1/completions", json=body, timeout=60)  # the default tenant: not its pin
    assert miss.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, miss.text
    for _ in range(4):  # wherever the router sends it, alpha hits the pin
        body = {"prompt": prefix + tokens(5), "max_tokens": 1}
        hit = httpx.post(url + "/v1/completions", json=body, headers={"X-Kvserve-Tenant": "alpha"}, timeout=60)
        assert hit.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK, hit.text
