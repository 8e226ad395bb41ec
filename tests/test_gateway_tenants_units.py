"""gateway.tenants and the cache terms, without processes: keys, names, the header, bounded labels."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gateway.metrics import GatewayMetrics
from gateway.params import build_options
from gateway.tenants import (
    ApiKeys, TenantLabels, TenantResolver, check_tenant_name, load_api_keys, parse_tenant_list,
)
from kvserve.errors import InvalidArgument, StartupError


def options(**fields):
    return build_options(max_tokens=1, temperature=0, top_p=None, top_k=None, seed=None, stop=None, **fields)


def test_a_key_names_its_tenant():
    keys = ApiKeys({"k1": "alpha", "k2": "beta", "k0": ""})
    assert keys.tenant_of_header("Bearer k1") == "alpha" and keys.tenant_of_header(b"bearer k2") == "beta"
    assert keys.tenant_of_header("Bearer k0") == "" and keys.matches_header("Bearer k0")
    assert keys.tenant_of_header("Bearer k3") is None and not keys.matches_header("Basic k1")
    assert not keys.matches_header(None) and "k1" not in repr(keys)
    resolver = TenantResolver(keys, ())
    assert resolver.resolve("Bearer k2", "alpha") == "beta"  # the header is ignored with keys


def test_keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"k1": "alpha", "k2": "beta"}))
    keys = load_api_keys(path, "kdefault")
    assert keys.tenant_of_secret("kdefault") == "" and keys.tenants == {"alpha", "beta", ""}
    for content, word in [("[1]", "JSON object"), ("{", "not valid JSON"), ('{"k": "bad name"}', "tenant name"),
                          ('{"k": "shared"}', "reserved"), ('{"k": 5}', "string"), ("{}", "non-empty")]:
        path.write_text(content)
        with pytest.raises(StartupError, match=word) as info:
            load_api_keys(path)
        assert "k\"" not in str(info.value)
    with pytest.raises(StartupError, match="no such file|No such file"):
        load_api_keys(tmp_path / "missing.json")


def test_header_names_a_listed_tenant():
    resolver = TenantResolver(None, parse_tenant_list("red, blue"))
    assert resolver.resolve(None, "red") == "red" and resolver.resolve(None, None) == ""
    assert resolver.resolve(None, " ") == ""
    for header, word in [("green", "unknown tenant"), ("bad name", "tenant name"), ("x" * 65, "tenant name"),
                         ("shared", "reserved"), (".dot", "tenant name")]:
        with pytest.raises(InvalidArgument, match=word) as info:
            resolver.resolve(None, header)
        assert "x-kvserve-tenant" in str(info.value)
    with pytest.raises(InvalidArgument, match="no tenants"):
        TenantResolver().resolve(None, "red")
    with pytest.raises(StartupError):
        parse_tenant_list("ok,no way")
    assert check_tenant_name("t", "shared", allow_shared=True) == "shared"


def test_cache_terms():
    o = options(tenant="a", kv_shared_prefix_tokens=32, kv_cache_ttl_s=1.5, kv_cache_priority="low")
    assert (o.tenant, o.num_shared_tokens, o.cache_ttl_ms, o.cache_priority_low) == ("a", 32, 1500, True)
    assert o.routing_salt != options().routing_salt == ""
    assert options(kv_cache_ttl_s=604800).cache_ttl_ms == 604800_000
    for fields, word in [({"kv_cache_ttl_s": 0}, "kv_cache_ttl_s"), ({"kv_cache_ttl_s": 604801}, "kv_cache_ttl_s"),
                         ({"kv_cache_ttl_s": float("nan")}, "kv_cache_ttl_s"), ({"kv_cache_ttl_s": True}, "kv_cache_ttl_s"),
                         ({"kv_cache_priority": "urgent"}, "kv_cache_priority"),
                         ({"kv_shared_prefix_tokens": -1}, "kv_shared_prefix_tokens"),
                         ({"kv_shared_prefix_tokens": 1.5}, "kv_shared_prefix_tokens")]:
        with pytest.raises(InvalidArgument, match=word):
            options(**fields)


def test_tenant_labels_are_bounded():
    labels = TenantLabels(limit=3)
    assert [labels(t) for t in ["", "a", "b", "c", "a"]] == ["default", "a", "b", "other", "a"]
    metrics = GatewayMetrics("m")
    pool = SimpleNamespace(tenants=[SimpleNamespace(
        tenant=f"t{i}", num_cached_blocks=1, num_pinned_blocks=0, prefix_cache_queries=2, prefix_cache_hits=1,
        num_evictions_caused=0, num_evictions_suffered=0, num_quota_refusals=0, num_store_blocks=0)
        for i in range(70)])
    metrics.on_tenant_stats([pool, pool])
    text = metrics.render().decode()
    cached = [line for line in text.splitlines() if line.startswith("kvserve:tenant_cached_blocks{")]
    assert len(cached) == 65  # 64 names and "other"
    assert 'kvserve:tenant_cached_blocks{model_name="m",tenant="other"} 12.0' in text  # 6 tenants x 2 pools
