"""The store tier's byte storage: KV block bytes kept outside any one process.

Two services share it: the executor writes a block's KV bytes (``put``) and reads them back
on a prefix hit (``get``); after a restart the kvmanager lists what is stored
(``list_entries``) to rebuild its index. ``open_store(url)`` picks the backend:

* a directory (``file:///abs/dir``, ``/abs/dir`` or ``relative/dir``): ``DirectoryStore``,
  one file per entry at ``<root>/<namespace>/<hash_hex[:2]>/<hash_hex>.kvb``;
* Redis (``redis://host:port/db``, ``rediss://...``, ``unix:///path.sock``): ``RedisStore``.
  It speaks the Redis protocol through redis-py, which serves Redis and Valkey alike (Valkey
  kept the protocol and commands), so nothing here is specific to either.

Every entry, in either backend, is the same bytes::

    b"KVSB\\x01" | key_len u32 LE | key | payload_len u64 LE | checksum u64 LE | payload

with ``checksum = xxh3_64(block_hash + key + payload)``. An entry counts only when the
magic, the lengths (the exact total size) and the checksum match and its name
``block_hash`` equals ``xxh3_128(key)`` (kvmanager's block hash of that key). Anything else
(a torn write, a flipped bit, bytes stored under another block's name) is corrupt: ``get``
answers a miss and deletes it, best effort. A stored block is a cache entry, so losing one
costs a recomputation, never a wrong answer.

Why the directory store does not fsync: a write goes to a temporary file that
``os.replace`` moves into place, so no reader ever sees a half-written file under an entry's
name while the machine is up; after a power loss a file may still be torn, and the checksum
turns it into a miss. fsync per block would put a disk flush on the executor's write path
to protect data that is only a cache.

Failures of the store itself (an I/O error, a full or read-only disk, a vanished directory,
a Redis server that is down) raise ``StoreError``; callers treat it as a miss but count it
apart from one. The module imports neither torch nor grpc, and redis only when a Redis URL
is opened, so both services (and tools) can use it without those.
"""
from __future__ import annotations

import errno
import io
import os
import re
import secrets
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

import xxhash

MAGIC = b"KVSB\x01"
HASH_BYTES = 16
MAX_KEY_BYTES = 1 << 20
_PREFIX = struct.Struct("<5sI")  # magic, key_len
_LENGTHS = struct.Struct("<QQ")  # payload_len, checksum
_NAMESPACE = re.compile(r"[0-9A-Za-z_.-]{1,128}")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_REDIS_SCHEMES = ("redis", "rediss", "unix")
_ACCEPTED = ("expected a directory (file:///abs/dir, /abs/dir or relative/dir) or a Redis URL "
             "(redis://host:port/db, rediss://host:port/db, unix:///path/to/redis.sock)")


class StoreError(Exception):
    """A store operation failed (I/O error, server down, disk full, read-only...)."""


@dataclass(frozen=True)
class StoreEntry:
    """One stored block, as ``list_entries`` reports it (without its payload)."""

    block_hash: bytes  # 16 bytes: xxh3_128(block_key)
    block_key: bytes


# ---------------------------------------------------------------------------------------------
# Entry bytes


def block_hash_of(block_key: bytes) -> bytes:
    """The name an entry with this key is stored under: ``xxh3_128(block_key)``."""
    return xxhash.xxh3_128_digest(block_key)


def _checksum(block_hash: bytes, block_key: bytes, payload: bytes) -> int:
    """``xxh3_64(block_hash + key + payload)``, streamed so that the payload is not copied."""
    digest = xxhash.xxh3_64()
    digest.update(block_hash)
    digest.update(block_key)
    digest.update(payload)
    return digest.intdigest()


def _encode_header(block_hash: bytes, block_key: bytes, payload: bytes) -> bytes:
    """Everything of an entry before its payload."""
    return b"".join((
        _PREFIX.pack(MAGIC, len(block_key)), block_key,
        _LENGTHS.pack(len(payload), _checksum(block_hash, block_key, payload)),
    ))


def _read_header(stream: BinaryIO) -> tuple[bytes, int, int, int] | None:
    """(key, payload_len, checksum, header_size) from the start of an entry, or None when
    what is there cannot be a header (short, wrong magic, absurd key length)."""
    prefix = stream.read(_PREFIX.size)
    if len(prefix) != _PREFIX.size:
        return None
    magic, key_len = _PREFIX.unpack(prefix)
    if magic != MAGIC or key_len > MAX_KEY_BYTES:
        return None
    key = stream.read(key_len)
    lengths = stream.read(_LENGTHS.size)
    if len(key) != key_len or len(lengths) != _LENGTHS.size:
        return None
    payload_len, checksum = _LENGTHS.unpack(lengths)
    return key, payload_len, checksum, _PREFIX.size + key_len + _LENGTHS.size


def _read_entry(stream: BinaryIO, size: int, block_hash: bytes) -> tuple[bytes, bytes] | None:
    """(block_key, payload) of a valid entry of ``size`` bytes named ``block_hash``, else None."""
    header = _read_header(stream)
    if header is None:
        return None
    key, payload_len, checksum, header_size = header
    if header_size + payload_len != size:
        return None
    payload = stream.read(payload_len)
    if len(payload) != payload_len or _checksum(block_hash, key, payload) != checksum:
        return None
    if block_hash_of(key) != block_hash:
        return None
    return key, payload


# ---------------------------------------------------------------------------------------------
# Arguments and URLs


def check_namespace(namespace: str) -> str:
    """``namespace`` when it is 1-128 of [0-9a-zA-Z_.-] (and not "." or ".."), else ValueError.
    It becomes a directory name and part of Redis keys, hence the narrow alphabet."""
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace) or namespace in (".", ".."):
        raise ValueError(f"invalid KV store namespace {namespace!r}: expected 1-128 characters "
                         "of [0-9a-zA-Z_.-] (not '.' or '..')")
    return namespace


def _check_hash(block_hash: bytes) -> str:
    """The hex name of a 16-byte block hash (ValueError otherwise)."""
    if not isinstance(block_hash, (bytes, bytearray)) or len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {block_hash!r:.60}")
    return bytes(block_hash).hex()


def _check_put(block_hash: bytes, block_key: bytes) -> str:
    """The hex name of an entry about to be written; rejects one that ``get`` would call corrupt."""
    hash_hex = _check_hash(block_hash)
    if len(block_key) > MAX_KEY_BYTES:
        raise ValueError(f"a block key is at most {MAX_KEY_BYTES} bytes, got {len(block_key)}")
    if block_hash_of(block_key) != block_hash:
        raise ValueError(f"block hash {hash_hex} is not xxh3_128 of its block key")
    return hash_hex


def describe_url(url: str) -> str:
    """``url`` with any password (in the user part or a ``password=`` query) shown as "***"."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # unparsable (a bad port, a broken IPv6 host): hide the whole user part
        return re.sub(r"://[^/?#]*@", "://***@", url)
    netloc = parts.netloc
    if password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    query = re.sub(r"(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing to hide: keep it exactly as given
    return parts._replace(netloc=netloc, query=query).geturl()


def _url_passwords(url: str) -> list[str]:
    """The secrets a URL carries, to scrub from error messages."""
    try:
        parts = urlsplit(url)
        found = [parts.password] + re.findall(r"(?:^|&)password=([^&]*)", parts.query)
    except ValueError:
        return []
    return sorted({s for p in found if p for s in (p, unquote(p))}, key=len, reverse=True)


def _file_url_root(url: str) -> str:
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/"):
        raise ValueError(f"invalid KV store URL {url!r}: a file URL names an absolute "
                         "directory, as in file:///abs/dir")
    return path


def open_store(url: str) -> KVStore:
    """The store a URL names (see the module docstring for the forms); ValueError for any
    other form. Nothing is connected or created here: an absent directory or a Redis server
    that is down fails (or is created) on first use."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"empty KV store URL: {_ACCEPTED}")
    match = _SCHEME.match(url)
    if match is None:
        return DirectoryStore(os.path.abspath(os.path.expanduser(url)), url=url)
    scheme = match.group(1).lower()
    if scheme == "file":
        return DirectoryStore(_file_url_root(url), url=url)
    if scheme in _REDIS_SCHEMES:
        return RedisStore(url)
    raise ValueError(f"unsupported KV store URL {describe_url(url)!r}: {_ACCEPTED}")


# ---------------------------------------------------------------------------------------------
# The interface


class KVStore(ABC):
    """Entries (block hash -> block key + payload) in namespaces that never see each other.

    Implementations are safe to share between threads; several processes may use one store
    at once (an entry is written whole or not at all)."""

    url: str  # the URL it was opened from, as given (may hold a password: log describe_url(url))
    medium: str  # "DISK" or "REDIS"

    @abstractmethod
    def put(self, namespace: str, block_hash: bytes, block_key: bytes, payload: bytes) -> None:
        """Stores (or replaces) an entry. ``block_hash`` must be ``xxh3_128(block_key)``
        (ValueError otherwise). Raises StoreError when the store cannot take it."""

    @abstractmethod
    def get(self, namespace: str, block_hash: bytes) -> tuple[bytes, bytes] | None:
        """(block_key, payload) of a valid entry; None when there is none or it is corrupt (a
        corrupt one is deleted, best effort). StoreError when the store cannot be read."""

    @abstractmethod
    def delete(self, namespace: str, block_hashes: Iterable[bytes]) -> None:
        """Removes these entries; absent ones are fine. StoreError on an I/O failure."""

    @abstractmethod
    def list_entries(self, namespace: str) -> Iterator[StoreEntry]:
        """Every entry that looks complete (its payload's checksum is left to ``get``).
        Raises StoreError (possibly midway) when the store cannot be read."""

    @abstractmethod
    def identity(self) -> str:
        """A random id the store keeps with its entries, made by the first caller: two
        executors see one store exactly when they read the same id, whatever URLs they use
        (one path can name two disks, in two containers). StoreError when unreachable."""

    def close(self) -> None:
        """Releases connections; the store is not used afterwards."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({describe_url(self.url)!r})"


# ---------------------------------------------------------------------------------------------
# Directory


_ENTRY_NAME = re.compile(r"[0-9a-f]{32}\.kvb")
_FANOUT_NAME = re.compile(r"[0-9a-f]{2}")
_TMP_DIR = ".tmp"
_IDENTITY_FILE = ".kvserve-store-id"
TMP_MAX_AGE_S = 3600.0  # a temp file this old belongs to a writer that died


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno, "OSError") if exc.errno else type(exc).__name__


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class DirectoryStore(KVStore):
    """One file per entry under a root directory (local disk or a shared mount).

    The root is created by the first ``put``, so opening a directory that does not exist yet
    works, and reading from it is a miss. Once the root has been seen, its disappearance
    (an unmounted volume, a deleted directory) is a StoreError rather than a miss, so that
    callers notice; the next ``put`` creates it again."""

    medium = "DISK"

    def __init__(self, root: str, *, url: str | None = None) -> None:
        self.root = os.path.abspath(root)
        self.url = url if url is not None else self.root
        self._root_seen = os.path.isdir(self.root)

    def _namespace_dir(self, namespace: str) -> str:
        return os.path.join(self.root, check_namespace(namespace))

    def _entry_path(self, namespace: str, hash_hex: str) -> str:
        return os.path.join(self._namespace_dir(namespace), hash_hex[:2], hash_hex + ".kvb")

    def _error(self, op: str, exc: OSError) -> StoreError:
        return StoreError(f"KV store {op} in {self.root} failed: {_errno_name(exc)}: {exc}")

    def _check_root(self, op: str) -> None:
        """After a path under the root was not found: a StoreError if the root itself went away."""
        if os.path.isdir(self.root):
            self._root_seen = True
        elif self._root_seen:
            raise StoreError(f"KV store {op} failed: the directory {self.root} is gone")

    def put(self, namespace: str, block_hash: bytes, block_key: bytes, payload: bytes) -> None:
        hash_hex = _check_put(block_hash, block_key)
        final = self._entry_path(namespace, hash_hex)
        tmp_dir = os.path.join(self._namespace_dir(namespace), _TMP_DIR)
        header = _encode_header(block_hash, block_key, payload)
        tmp = os.path.join(tmp_dir, f"{os.getpid()}-{secrets.token_hex(8)}.tmp")
        try:
            os.makedirs(tmp_dir, exist_ok=True)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            with open(tmp, "xb") as out:
                out.write(header)
                out.write(payload)
            os.replace(tmp, final)
        except OSError as exc:
            _remove_quietly(tmp)
            raise self._error("put", exc) from exc
        self._root_seen = True

    def identity(self) -> str:
        path = os.path.join(self.root, _IDENTITY_FILE)
        tmp = f"{path}.{os.getpid()}-{secrets.token_hex(8)}.tmp"
        try:
            os.makedirs(self.root, exist_ok=True)
            with open(tmp, "x") as out:
                out.write(secrets.token_hex(16))
            try:
                os.link(tmp, path)  # whole or not at all, and never over another's: the first one wins
            except FileExistsError:
                pass
            finally:
                _remove_quietly(tmp)
            with open(path) as fh:
                return fh.read().strip()
        except OSError as exc:
            raise self._error("identity", exc) from exc

    def get(self, namespace: str, block_hash: bytes) -> tuple[bytes, bytes] | None:
        path = self._entry_path(namespace, _check_hash(block_hash))
        try:
            with open(path, "rb") as stream:
                stat = os.fstat(stream.fileno())
                entry = _read_entry(stream, stat.st_size, bytes(block_hash))
        except FileNotFoundError:
            self._check_root("get")
            return None
        except OSError as exc:
            raise self._error("get", exc) from exc
        self._root_seen = True
        if entry is None:
            self._discard(path, stat)
        return entry

    @staticmethod
    def _discard(path: str, read: os.stat_result) -> None:
        """Deletes a corrupt entry unless a writer has replaced the file since it was read
        (``os.replace`` makes a new inode), so that a good entry is not lost to the race."""
        try:
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (read.st_dev, read.st_ino):
                os.remove(path)
        except OSError:
            pass

    def delete(self, namespace: str, block_hashes: Iterable[bytes]) -> None:
        for block_hash in block_hashes:
            try:
                os.remove(self._entry_path(namespace, _check_hash(block_hash)))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise self._error("delete", exc) from exc

    def list_entries(self, namespace: str) -> Iterator[StoreEntry]:
        ns_dir = self._namespace_dir(namespace)
        self._sweep_tmp(os.path.join(ns_dir, _TMP_DIR))
        for fanout in self._subdirs(ns_dir):
            for name in self._entry_names(os.path.join(ns_dir, fanout)):
                if not name.startswith(fanout):
                    continue  # not where get would look for it
                key = self._listed_key(os.path.join(ns_dir, fanout, name))
                if key is not None:
                    yield StoreEntry(bytes.fromhex(name[:32]), key)

    def _subdirs(self, ns_dir: str) -> list[str]:
        """The namespace's fan-out directory names ("00".."ff"); none when it does not exist."""
        try:
            with os.scandir(ns_dir) as found:
                return sorted(e.name for e in found if _FANOUT_NAME.fullmatch(e.name) and e.is_dir())
        except FileNotFoundError:
            self._check_root("list")
            return []
        except OSError as exc:
            raise self._error("list", exc) from exc

    def _entry_names(self, fanout_dir: str) -> list[str]:
        try:
            with os.scandir(fanout_dir) as found:
                return sorted(e.name for e in found if _ENTRY_NAME.fullmatch(e.name))
        except FileNotFoundError:  # removed while listing
            return []
        except OSError as exc:
            raise self._error("list", exc) from exc

    @staticmethod
    def _listed_key(path: str) -> bytes | None:
        """The block key of a file that looks like a whole entry (header only: no payload read).
        A file that cannot be read is skipped like a torn one: ``get`` would miss it too."""
        try:
            with open(path, "rb") as stream:
                size = os.fstat(stream.fileno()).st_size
                header = _read_header(stream)
        except OSError:
            return None
        if header is None:
            return None
        key, payload_len, _, header_size = header
        return key if header_size + payload_len == size else None

    @staticmethod
    def _sweep_tmp(tmp_dir: str) -> None:
        """Removes temp files that writers which crashed left behind (best effort)."""
        cutoff = time.time() - TMP_MAX_AGE_S
        try:
            with os.scandir(tmp_dir) as found:
                stale = [e.path for e in found if e.is_file() and e.stat().st_mtime < cutoff]
        except OSError:
            return
        for path in stale:
            _remove_quietly(path)


# ---------------------------------------------------------------------------------------------
# Redis


_KEY_PREFIX = "kvserve:kv"
_IDENTITY_KEY = "kvserve:kv-store-id"
_INDEX_FIELD = re.compile(rb"[0-9a-f]{32}")
_LIST_BATCH = 512


class RedisStore(KVStore):
    """Entries as Redis strings, with a hash per namespace naming every stored block's key.

    Keys: ``kvserve:kv:{namespace}:{hash_hex}`` holds the entry bytes and the hash
    ``kvserve:kv:{namespace}:keys`` maps hash_hex -> block key; both change in one MULTI/EXEC,
    so ``list_entries`` reads the index without touching payloads. Give the server a
    ``maxmemory-policy`` that never evicts the ``keys`` hash (``noeviction`` or a
    ``volatile-*`` one): an evicted entry string only costs a miss (``list_entries`` skips
    index fields whose entry is gone), an evicted index loses the listing.

    Timeouts are 2 s, and a command is retried once, at once, on a connection error (a
    pooled connection that died with a server restart), so a server that is down fails a
    call within about 4 s."""

    medium = "REDIS"

    def __init__(self, url: str) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ValueError(f"KV store URL {describe_url(url)!r} needs the redis package "
                             "(pip install 'redis>=5')") from exc
        self.url = url
        self._errors = (redis.exceptions.RedisError, OSError)
        self._secrets = _url_passwords(url)
        self._client = redis.Redis.from_url(
            url, socket_timeout=2, socket_connect_timeout=2,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)))

    @staticmethod
    def _entry_key(namespace: str, hash_hex: str) -> str:
        return f"{_KEY_PREFIX}:{check_namespace(namespace)}:{hash_hex}"

    @staticmethod
    def _index_key(namespace: str) -> str:
        return f"{_KEY_PREFIX}:{check_namespace(namespace)}:keys"

    @contextmanager
    def _translated(self, op: str) -> Iterator[None]:
        """Redis and socket errors as StoreError, naming the server without its password."""
        try:
            yield
        except self._errors as exc:
            message = f"KV store {op} on {describe_url(self.url)} failed: {type(exc).__name__}: {exc}"
            for secret in self._secrets:
                message = message.replace(secret, "***")
            raise StoreError(message) from exc

    def put(self, namespace: str, block_hash: bytes, block_key: bytes, payload: bytes) -> None:
        hash_hex = _check_put(block_hash, block_key)
        value = _encode_header(block_hash, block_key, payload) + payload
        with self._translated("put"):
            pipe = self._client.pipeline(transaction=True)
            pipe.set(self._entry_key(namespace, hash_hex), value)
            pipe.hset(self._index_key(namespace), hash_hex, bytes(block_key))
            pipe.execute()

    def identity(self) -> str:
        with self._translated("identity"):
            self._client.set(_IDENTITY_KEY, secrets.token_hex(16), nx=True)
            return self._client.get(_IDENTITY_KEY).decode()

    def get(self, namespace: str, block_hash: bytes) -> tuple[bytes, bytes] | None:
        hash_hex = _check_hash(block_hash)
        with self._translated("get"):
            data = self._client.get(self._entry_key(namespace, hash_hex))
        if data is None:
            return None
        entry = _read_entry(io.BytesIO(data), len(data), bytes(block_hash))
        if entry is None:
            self._discard(namespace, hash_hex, data)
        return entry

    def _discard(self, namespace: str, hash_hex: str, corrupt: bytes) -> None:
        """Deletes a corrupt entry, unless a writer replaced it since it was read (WATCH makes
        the transaction fail then). Best effort: errors are swallowed."""
        entry_key = self._entry_key(namespace, hash_hex)
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.watch(entry_key)
                if pipe.get(entry_key) != corrupt:
                    return
                pipe.multi()
                pipe.delete(entry_key)
                pipe.hdel(self._index_key(namespace), hash_hex)
                pipe.execute()
        except self._errors:
            pass

    def delete(self, namespace: str, block_hashes: Iterable[bytes]) -> None:
        names = [_check_hash(h) for h in block_hashes]
        if not names:
            return
        with self._translated("delete"):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(*(self._entry_key(namespace, name) for name in names))
            pipe.hdel(self._index_key(namespace), *names)
            pipe.execute()

    def list_entries(self, namespace: str) -> Iterator[StoreEntry]:
        index_key = self._index_key(namespace)
        seen: set[bytes] = set()  # HSCAN may return a field twice while the hash is rehashed
        cursor = 0
        while True:
            with self._translated("list"):
                cursor, fields = self._client.hscan(index_key, cursor, count=_LIST_BATCH)
                fields = {f: k for f, k in fields.items() if f not in seen and _INDEX_FIELD.fullmatch(f)}
                present = self._present(namespace, list(fields))
            for field, key in fields.items():
                seen.add(field)
                if present[field]:
                    yield StoreEntry(bytes.fromhex(field.decode()), key)
            if cursor == 0:
                return

    def _present(self, namespace: str, fields: list[bytes]) -> dict[bytes, bool]:
        """Which indexed entries still have their bytes (one round trip for the batch)."""
        if not fields:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for field in fields:
            pipe.exists(self._entry_key(namespace, field.decode()))
        return dict(zip(fields, (bool(n) for n in pipe.execute())))

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
