"""kvserve.kv_store: the store tier's entries, on a directory and on a real redis-server.

The shared behaviour runs against both backends (``store`` is parametrized); each backend's
failure modes (a directory that is a file or vanished, a server that is down) have tests of
their own.
"""
from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

from kvserve import kv_store
from kvserve.kv_store import (DirectoryStore, KVStore, RedisStore, StoreEntry, StoreError, describe_url,
                              open_store)
from tests.redis_support import redis_server, redis_url, start_redis  # noqa: F401  (fixtures)

NS = "3f2a9c"


def block(key: bytes) -> tuple[bytes, bytes]:
    """(block_hash, block_key) as the store names entries."""
    return xxhash.xxh3_128_digest(key), key


class RawDirectory:
    """The files behind a DirectoryStore, for tests that damage them."""

    def __init__(self, store: DirectoryStore) -> None:
        self.store = store

    def path(self, namespace: str, block_hash: bytes) -> Path:
        hex_ = block_hash.hex()
        return Path(self.store.root, namespace, hex_[:2], hex_ + ".kvb")

    def read(self, namespace: str, block_hash: bytes) -> bytes | None:
        path = self.path(namespace, block_hash)
        return path.read_bytes() if path.exists() else None

    def write(self, namespace: str, block_hash: bytes, data: bytes, block_key: bytes) -> None:
        path = self.path(namespace, block_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


class RawRedis:
    """The keys behind a RedisStore, for tests that damage them."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url)

    def read(self, namespace: str, block_hash: bytes) -> bytes | None:
        return self.client.get(f"kvserve:kv:{namespace}:{block_hash.hex()}")

    def write(self, namespace: str, block_hash: bytes, data: bytes, block_key: bytes) -> None:
        self.client.set(f"kvserve:kv:{namespace}:{block_hash.hex()}", data)
        self.client.hset(f"kvserve:kv:{namespace}:keys", block_hash.hex(), block_key)


@pytest.fixture(params=["directory", "redis"])
def backend(request, tmp_path):
    """(store, raw access to its bytes) for each backend."""
    if request.param == "directory":
        store = open_store(str(tmp_path / "store"))
        raw = RawDirectory(store)
    else:
        url = request.getfixturevalue("redis_url")
        store = open_store(url)
        raw = RawRedis(url)
    yield store, raw
    store.close()


@pytest.fixture
def store(backend) -> KVStore:
    return backend[0]


# ---------------------------------------------------------------------------------------------
# Both backends


def test_put_get_roundtrip(store):
    entries = {
        block(b"tokens:1,2,3"): b"kv" * 1000,
        block(b""): b"empty key",
        block(bytes(range(256))): b"",
        block(b"big"): os.urandom(1 << 20),
    }
    for (block_hash, key), payload in entries.items():
        store.put(NS, block_hash, key, payload)
    for (block_hash, key), payload in entries.items():
        assert store.get(NS, block_hash) == (key, payload)


def test_put_replaces_and_takes_bytes_like_payloads(store):
    block_hash, key = block(b"k")
    store.put(NS, block_hash, key, b"first")
    store.put(NS, block_hash, key, bytearray(b"second"))
    assert store.get(NS, block_hash) == (key, b"second")
    store.put(NS, block_hash, key, memoryview(b"third"))
    assert store.get(NS, block_hash) == (key, b"third")


def test_missing_entry_is_none(store):
    assert store.get(NS, block(b"never stored")[0]) is None
    assert list(store.list_entries(NS)) == []


def test_namespaces_do_not_see_each_other(store):
    block_hash, key = block(b"shared key")
    store.put("a", block_hash, key, b"in a")
    assert store.get("b", block_hash) is None
    assert list(store.list_entries("b")) == []
    store.delete("b", [block_hash])
    store.put("b", block_hash, key, b"in b")
    assert store.get("a", block_hash) == (key, b"in a")
    assert store.get("b", block_hash) == (key, b"in b")


def test_list_entries_yields_exactly_what_was_put(store):
    blocks = [block(f"key {i}".encode()) for i in range(300)]
    for block_hash, key in blocks:
        store.put(NS, block_hash, key, key * 3)
    store.put("other", *block(b"elsewhere"), b"x")
    listed = list(store.list_entries(NS))
    assert len(listed) == len(blocks)
    assert set(listed) == {StoreEntry(h, k) for h, k in blocks}


def test_delete(store):
    blocks = [block(f"key {i}".encode()) for i in range(5)]
    for block_hash, key in blocks:
        store.put(NS, block_hash, key, b"payload")
    store.delete(NS, (h for h, _ in blocks[:3]))
    store.delete(NS, [blocks[0][0], block(b"never stored")[0]])  # absent ones are fine
    store.delete(NS, [])
    assert [store.get(NS, h) for h, _ in blocks[:3]] == [None] * 3
    assert store.get(NS, blocks[3][0]) == (blocks[3][1], b"payload")
    assert set(store.list_entries(NS)) == {StoreEntry(h, k) for h, k in blocks[3:]}


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1:]


CORRUPTIONS = {
    "flipped payload byte": lambda data: _flip(data, len(data) - 1),
    "flipped key byte": lambda data: _flip(data, 10),
    "flipped checksum byte": lambda data: _flip(data, 5 + 4 + len(b"victim key") + 8),
    "wrong magic": lambda data: b"KVSB\x02" + data[5:],
    "truncated payload": lambda data: data[:-1],
    "truncated header": lambda data: data[:7],
    "trailing byte": lambda data: data + b"\x00",
    "empty": lambda data: b"",
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_corrupt_entry_is_a_miss_and_removed(backend, corrupt):
    store, raw = backend
    block_hash, key = block(b"victim key")
    store.put(NS, block_hash, key, b"payload bytes")
    raw.write(NS, block_hash, corrupt(raw.read(NS, block_hash)), key)
    assert store.get(NS, block_hash) is None
    assert raw.read(NS, block_hash) is None
    assert list(store.list_entries(NS)) == []


def test_entry_under_the_wrong_name_is_a_miss_and_removed(backend):
    store, raw = backend
    good_hash, good_key = block(b"good")
    other_hash, _ = block(b"other")
    store.put(NS, good_hash, good_key, b"payload")
    raw.write(NS, other_hash, raw.read(NS, good_hash), good_key)  # a valid entry, misnamed
    assert store.get(NS, other_hash) is None
    assert raw.read(NS, other_hash) is None
    assert list(store.list_entries(NS)) == [StoreEntry(good_hash, good_key)]
    assert store.get(NS, good_hash) == (good_key, b"payload")


def test_entry_bytes_follow_the_format(backend):
    """The same bytes in both backends: magic, key_len, key, payload_len, checksum, payload."""
    store, raw = backend
    block_hash, key = block(b"format key")
    payload = b"\x00\x01payload"
    store.put(NS, block_hash, key, payload)
    checksum = xxhash.xxh3_64_intdigest(block_hash + key + payload)
    expected = (b"KVSB\x01" + struct.pack("<I", len(key)) + key
                + struct.pack("<QQ", len(payload), checksum) + payload)
    assert raw.read(NS, block_hash) == expected


@pytest.mark.parametrize("namespace", ["", ".", "..", "a/b", "a:b", "../x", "ü", "x" * 129, None])
def test_invalid_namespace_is_a_value_error(store, namespace):
    block_hash, key = block(b"k")
    with pytest.raises(ValueError, match="namespace"):
        store.put(namespace, block_hash, key, b"p")
    with pytest.raises(ValueError, match="namespace"):
        store.get(namespace, block_hash)
    with pytest.raises(ValueError, match="namespace"):
        list(store.list_entries(namespace))


def test_bad_block_hashes_are_value_errors(store):
    block_hash, key = block(b"k")
    with pytest.raises(ValueError, match="16 bytes"):
        store.get(NS, block_hash[:15])
    with pytest.raises(ValueError, match="16 bytes"):
        store.delete(NS, [b"short"])
    with pytest.raises(ValueError, match="not xxh3_128"):
        store.put(NS, block(b"another key")[0], key, b"p")  # get would call it corrupt


# ---------------------------------------------------------------------------------------------
# Directory


def test_directory_is_created_by_the_first_put(tmp_path):
    root = tmp_path / "not" / "yet"
    store = open_store(f"file://{root}")
    assert (store.medium, store.url, store.root) == ("DISK", f"file://{root}", str(root))
    block_hash, key = block(b"k")
    assert store.get(NS, block_hash) is None
    assert list(store.list_entries(NS)) == []
    store.delete(NS, [block_hash])
    assert not root.exists()  # reading never creates it
    store.put(NS, block_hash, key, b"p")
    assert store.get(NS, block_hash) == (key, b"p")
    assert list((root / NS / block_hash.hex()[:2]).iterdir()) == [root / NS / block_hash.hex()[:2]
                                                                   / f"{block_hash.hex()}.kvb"]
    assert list((root / NS / ".tmp").iterdir()) == []


@pytest.mark.parametrize("under", ["", "sub"])
def test_directory_under_a_file_raises_store_error(tmp_path, under):
    """A root that is a file (or lies under one) gives ENOTDIR/EEXIST: an unusable store,
    not a miss. (Tests run as root, where a chmod'ed read-only directory stays writable.)"""
    (tmp_path / "file").write_bytes(b"not a directory")
    store = open_store(str(tmp_path / "file" / under))
    block_hash, key = block(b"k")
    with pytest.raises(StoreError, match="ENOTDIR|EEXIST"):
        store.put(NS, block_hash, key, b"p")
    with pytest.raises(StoreError, match="ENOTDIR"):
        store.get(NS, block_hash)
    with pytest.raises(StoreError, match="ENOTDIR"):
        list(store.list_entries(NS))
    with pytest.raises(StoreError, match="ENOTDIR"):
        store.delete(NS, [block_hash])


def test_vanished_directory_raises_until_a_put_recreates_it(tmp_path):
    """Once the root has existed, its disappearance is a StoreError (an unmounted volume
    must not look like an empty cache); the next put creates it again."""
    root = tmp_path / "store"
    store = open_store(str(root))
    block_hash, key = block(b"k")
    store.put(NS, block_hash, key, b"p")
    shutil.rmtree(root)
    with pytest.raises(StoreError, match="is gone"):
        store.get(NS, block_hash)
    with pytest.raises(StoreError, match="is gone"):
        list(store.list_entries(NS))
    store.put(NS, block_hash, key, b"again")
    assert store.get(NS, block_hash) == (key, b"again")


def test_failed_put_leaves_no_temp_file(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "store"))
    block_hash, key = block(b"k")

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_store.os, "replace", disk_full)
    with pytest.raises(StoreError, match="ENOSPC"):
        store.put(NS, block_hash, key, b"p")
    monkeypatch.undo()
    assert list((tmp_path / "store" / NS / ".tmp").iterdir()) == []
    assert store.get(NS, block_hash) is None


def test_temp_files_are_never_listed_and_old_ones_are_swept(tmp_path):
    store = open_store(str(tmp_path / "store"))
    block_hash, key = block(b"k")
    store.put(NS, block_hash, key, b"p")
    tmp_dir = tmp_path / "store" / NS / ".tmp"
    fresh, stale = tmp_dir / "1-fresh.tmp", tmp_dir / "2-stale.tmp"
    whole = RawDirectory(store).read(NS, block_hash)
    for leftover in (fresh, stale):  # whole entries, as a writer had them just before os.replace
        leftover.write_bytes(whole)
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    assert list(store.list_entries(NS)) == [StoreEntry(block_hash, key)]
    assert fresh.exists() and not stale.exists()


def test_listing_skips_foreign_and_torn_files(tmp_path):
    store = open_store(str(tmp_path / "store"))
    block_hash, key = block(b"k")
    torn_hash, torn_key = block(b"torn")
    store.put(NS, block_hash, key, b"payload")
    store.put(NS, torn_hash, torn_key, b"payload")
    ns_dir = tmp_path / "store" / NS
    entry = ns_dir / block_hash.hex()[:2] / f"{block_hash.hex()}.kvb"
    torn = ns_dir / torn_hash.hex()[:2] / f"{torn_hash.hex()}.kvb"
    torn.write_bytes(torn.read_bytes()[:-3])
    (ns_dir / "README").write_text("not an entry")
    (ns_dir / "zz").mkdir()
    shutil.copy(entry, ns_dir / "zz" / f"{block_hash.hex()}.kvb")  # not a fan-out directory
    shutil.copy(entry, ns_dir / block_hash.hex()[:2] / "short.kvb")
    shutil.copy(entry, ns_dir / block_hash.hex()[:2] / f"{block_hash.hex().upper()}.kvb")
    wrong_dir = "00" if block_hash.hex()[:2] != "00" else "01"
    (ns_dir / wrong_dir).mkdir(exist_ok=True)
    shutil.copy(entry, ns_dir / wrong_dir / f"{block_hash.hex()}.kvb")  # get would never look there
    assert list(store.list_entries(NS)) == [StoreEntry(block_hash, key)]


def test_open_store_directory_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_store("relative/dir").root == str(tmp_path / "relative" / "dir")
    assert open_store("relative/dir").url == "relative/dir"
    assert open_store(str(tmp_path / "abs")).root == str(tmp_path / "abs")
    assert open_store(f"file://{tmp_path}/with%20space").root == f"{tmp_path}/with space"
    assert open_store("file://localhost/srv/kv").root == "/srv/kv"


@pytest.mark.parametrize("url", ["", "   ", "ftp://x", "http://host/dir", "s3://bucket/x",
                                 "file://host/dir", "file:relative"])
def test_open_store_rejects_other_urls(url):
    with pytest.raises(ValueError) as raised:
        open_store(url)
    message = str(raised.value)
    assert "\n" not in message and ("file:///" in message)


def test_describe_url_hides_passwords():
    assert describe_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert describe_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert describe_url("rediss://h:1/0?password=pw&ssl_cert_reqs=none") == \
        "rediss://h:1/0?password=***&ssl_cert_reqs=none"
    assert "pw" not in describe_url("redis://:pw@h:notaport/0")
    for plain in ("redis://h:1/0", "/abs/dir", "relative/dir", "file:///abs/dir", "unix:///tmp/r.sock"):
        assert describe_url(plain) == plain


def test_module_imports_without_torch_grpc_or_redis():
    code = ("import sys, kvserve.kv_store; "
            "print(sorted(m for m in ('torch', 'grpc', 'redis', 'executor', 'kvmanager', 'gateway') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# Redis


def test_open_store_redis_forms(redis_url):
    store = open_store(redis_url)
    assert isinstance(store, RedisStore) and (store.medium, store.url) == ("REDIS", redis_url)
    assert "secret" not in repr(open_store("redis://:secret@127.0.0.1:1/0"))
    assert isinstance(open_store("unix:///tmp/nowhere.sock"), RedisStore)  # nothing connects yet


def _raises_quickly(call) -> StoreError:
    start = time.monotonic()
    with pytest.raises(StoreError) as raised:
        call()
    assert time.monotonic() - start < 5
    return raised.value


def test_redis_down_raises_store_error_then_recovers(tmp_path):
    server = start_redis(tmp_path)
    try:
        store = open_store(server.url)
        block_hash, key = block(b"k")
        store.put(NS, block_hash, key, b"before")
        server.stop()
        for call in (lambda: store.put(NS, block_hash, key, b"p"), lambda: store.get(NS, block_hash),
                     lambda: list(store.list_entries(NS)), lambda: store.delete(NS, [block_hash])):
            assert f"127.0.0.1:{server.port}" in str(_raises_quickly(call))
        server.restart()  # no persistence: the old entry is gone, the store works again
        assert store.get(NS, block_hash) is None
        store.put(NS, block_hash, key, b"after")
        assert store.get(NS, block_hash) == (key, b"after")
        server.kill()
        _raises_quickly(lambda: store.get(NS, block_hash))
    finally:
        server.stop()


def test_redis_errors_never_show_the_password(tmp_path):
    """Neither a refused login nor a refused connection puts the URL's password in the error.
    (A server without auth accepts any password, so this one requires another.)"""
    server = start_redis(tmp_path, "--requirepass", "the-real-one")
    try:
        block_hash, key = block(b"k")
        wrong_auth = open_store(f"redis://:secret@127.0.0.1:{server.port}/0")
        error = _raises_quickly(lambda: wrong_auth.get(NS, block_hash))
        assert "secret" not in str(error) and ":***@" in str(error)
        assert open_store(f"redis://:the-real-one@127.0.0.1:{server.port}/0").get(NS, block_hash) is None
    finally:
        server.stop()
    nobody_home = open_store(f"redis://:secret@127.0.0.1:{server.port}/0?password=secret2")
    error = _raises_quickly(lambda: nobody_home.put(NS, block_hash, key, b"p"))
    assert "secret" not in str(error) and "Connection" in str(error)


def test_redis_listing_skips_index_fields_without_an_entry(redis_url):
    """An entry string evicted by a maxmemory policy leaves its index field behind."""
    import redis

    store = open_store(redis_url)
    kept, evicted = block(b"kept"), block(b"evicted")
    for block_hash, key in (kept, evicted):
        store.put(NS, block_hash, key, b"p")
    redis.Redis.from_url(redis_url).delete(f"kvserve:kv:{NS}:{evicted[0].hex()}")
    assert list(store.list_entries(NS)) == [StoreEntry(*kept)]
    assert store.get(NS, evicted[0]) is None


def test_identity_is_made_once_and_tells_stores_apart(tmp_path, redis_url):
    """Two handles on one store read one id; two stores (even behind the same kind of URL) differ."""
    from kvserve.kv_store import open_store

    first, again, other = open_store(str(tmp_path / "a")), open_store(str(tmp_path / "a")), open_store(str(tmp_path / "b"))
    assert first.identity() == again.identity() == first.identity() != other.identity()
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.endswith(".tmp")]
    with open_store(redis_url) as one, open_store(redis_url) as two:
        assert one.identity() == two.identity() and len(one.identity()) == 32
