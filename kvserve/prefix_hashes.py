"""Prefix hashes of full blocks.

Choice: **xxh3-128** (the ``xxhash`` package), chained as vLLM v1 does:

    root              = xxh3_128(b"kvserve.prefix.v1\\0" + model_fingerprint)
    hash(block i)     = xxh3_128(hash(block i-1) | extra keys | token ids of block i)

Why xxh3-128 and not sha256:

* It sits on the scheduler's hot path (every full block of every prompt is
  hashed once), where a non-cryptographic hash costs a fraction of sha256 or
  blake2b (docs/kvmanager.md has the numbers), and 128 bits make an *accidental*
  collision negligible (birthday bound ~ n^2 / 2^129: 10^12 blocks give ~10^-15).
* It is deterministic across processes, machines and restarts: no seed from
  the process (Python's ``hash()`` is salted per process), token ids are packed
  little-endian int32, strings are UTF-8 with length prefixes (no ambiguity
  between "ab"+"c" and "a"+"bc").
* It is *not* collision resistant against an adversary who crafts prompts. We
  therefore never trust the hash alone: the prefix cache stores, per cached block,
  the exact key the hash was computed from (parent hash, extra keys, token ids)
  and a hit is accepted only when the key is equal (``BlockPool.lookup``). Walking
  the chain from the root and verifying every block means a hit's entire prefix is
  token-for-token identical, so a collision can only cost a cache miss, never
  another prompt's KV.

The module sits in the shared package, not in kvmanager's: the gateway's scheduler chains the
prompts it saw computed the same way (``gateway/computed_prefixes.py``), and services never import
each other. Clients that route (a gateway asking ``LookupPrefix``) can hash a prompt once with
``prefix_block_hashes`` and send the hashes instead of (or with) the token ids: the
bytes hashed are the same as here, so the hashes equal the ones in ``BlockStored``
events and in the pool.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

_DOMAIN = b"kvserve.prefix.v1\x00"
_U32 = struct.Struct("<I").pack
HASH_BYTES = 16
MAX_TOKEN_ID = (1 << 31) - 1


def _field(text: str) -> bytes:
    """A length-prefixed UTF-8 string, so that concatenations are unambiguous."""
    data = text.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def root_hash(model_fingerprint: str) -> bytes:
    """The parent hash of every sequence's first block: seeds the chain per model."""
    return xxhash.xxh3_128_digest(_DOMAIN + _field(model_fingerprint))


# The hash namespace of a prompt's shareable range: blocks every tenant may hit.
SHARED_NAMESPACE = "shared"
DEFAULT_TENANT = "default"


def extra_keys(cache_salt: str, adapter_id: str, namespace: str = "") -> bytes:
    """Bytes hashed into a block besides its tokens: the request's cache salt, the LoRA
    adapter and the tenant (or ``SHARED_NAMESPACE``). The default tenant adds nothing, so
    its hashes are those of a deployment without tenants."""
    if namespace == DEFAULT_TENANT:
        namespace = ""
    if not namespace:
        return _field(cache_salt) + _field(adapter_id) if cache_salt or adapter_id else b""
    return _field(cache_salt) + _field(adapter_id) + _field(namespace)


class BlockExtras:
    """What a sequence hashes into each of its blocks: the first ``num_shared_blocks``
    in the shared namespace (one system prompt cached once for every tenant), the rest
    in its tenant's. ``tail(i)`` is block i's ``key_prefix`` after the parent hash."""

    __slots__ = ("private", "shared", "num_shared_blocks", "_private_tail", "_shared_tail")

    def __init__(self, cache_salt: str = "", adapter_id: str = "", tenant: str = "", num_shared_blocks: int = 0):
        self.private = extra_keys(cache_salt, adapter_id, tenant)
        self.shared = extra_keys(cache_salt, adapter_id, SHARED_NAMESPACE) if num_shared_blocks else self.private
        self.num_shared_blocks = num_shared_blocks if self.shared != self.private else 0
        self._private_tail = key_prefix(b"", self.private)
        self._shared_tail = key_prefix(b"", self.shared)

    def of_block(self, i: int) -> bytes:
        return self.shared if i < self.num_shared_blocks else self.private

    def tail(self, i: int) -> bytes:
        return self._shared_tail if i < self.num_shared_blocks else self._private_tail


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (ids are validated 0 <= id < 2^31).

    A protobuf repeated field (or a numpy array) goes through numpy, which reads it
    without a Python object per token (~5 us for 4096 tokens, against ~200 us for
    ``struct.pack(*field)``); a list goes through one ``struct.pack``."""
    if type(token_ids) is not list and hasattr(token_ids, "__array__"):
        return np.asarray(token_ids, dtype="<i4").tobytes()
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def checked_pack_tokens(token_ids: Sequence[int]) -> bytes | None:
    """``pack_tokens``, or None when an id is outside 0..2^31-1 (the caller reports it)."""
    if type(token_ids) is not list and hasattr(token_ids, "__array__"):
        array = np.asarray(token_ids)
        if array.size and (array.min() < 0 or array.max() > MAX_TOKEN_ID):
            return None
        return array.astype("<i4", copy=False).tobytes()
    if token_ids and (min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID):
        return None
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def key_prefix(parent_hash: bytes, extra: bytes) -> bytes:
    """The bytes of a ``block_key`` before the token ids."""
    return parent_hash + _U32(len(extra)) + extra


def block_key(parent_hash: bytes, extra: bytes, token_ids: Sequence[int]) -> bytes:
    """What a full block's hash is computed from; the prefix cache keeps it to verify hits:
    ``parent hash (16 bytes) | len(extra) as u32 LE | extra | token ids as int32 LE``."""
    return parent_hash + _U32(len(extra)) + extra + pack_tokens(token_ids)


# The 16-byte hash of a ``block_key`` (the C function itself: no Python frame per block).
hash_key = xxhash.xxh3_128_digest


def split_key(key: bytes) -> tuple[bytes, bytes, bytes]:
    """A ``block_key``'s (parent hash, extra keys, packed token ids)."""
    (extra_len,) = struct.unpack_from("<I", key, HASH_BYTES)
    start = HASH_BYTES + 4
    return key[:HASH_BYTES], key[start:start + extra_len], key[start + extra_len:]


def _fields_of_extra(extra: bytes) -> list[str]:
    fields = []
    offset = 0
    while offset < len(extra):
        (length,) = struct.unpack_from("<I", extra, offset)
        fields.append(extra[offset + 4:offset + 4 + length].decode("utf-8"))
        offset += 4 + length
    return fields


def adapter_of_extra(extra: bytes) -> str:
    """The adapter id inside ``extra_keys(cache_salt, adapter_id, namespace)``."""
    fields = _fields_of_extra(extra)
    return fields[1] if len(fields) > 1 else ""


def namespace_of_extra(extra: bytes) -> str:
    """The tenant (or ``SHARED_NAMESPACE``) a block was hashed for: ``DEFAULT_TENANT`` when none."""
    fields = _fields_of_extra(extra)
    return fields[2] if len(fields) > 2 else DEFAULT_TENANT


def chain_hashes(parent_hash: bytes, extras: BlockExtras, packed_tokens: bytes, block_size: int,
                 num_blocks: int) -> list[bytes]:
    """The chained hashes of the first ``num_blocks`` full blocks of ``packed_tokens``
    (``pack_tokens`` output), the first one's parent being ``parent_hash``."""
    step = 4 * block_size
    digest = xxhash.xxh3_128_digest
    hashes = []
    for i in range(num_blocks):
        offset = i * step
        parent_hash = digest(parent_hash + extras.tail(i) + packed_tokens[offset:offset + step])
        hashes.append(parent_hash)
    return hashes


def prefix_block_hashes(model_fingerprint: str, block_size: int, token_ids: Sequence[int],
                        cache_salt: str = "", adapter_id: str = "", tenant: str = "",
                        num_shared_tokens: int = 0) -> list[bytes]:
    """The hashes a prompt's lookup walks: its first ``(len(token_ids) - 1) // block_size``
    full blocks (a hit always leaves the last prompt token to compute), as a pool
    registered with ``model_fingerprint`` and ``block_size`` hashes them. What a gateway
    sends as ``PrefixQuery.block_hashes`` (with ``hashes_block_size`` and
    ``hashes_model_fingerprint``) so that the kvmanager does not hash the prompt again."""
    num_blocks = max(0, (len(token_ids) - 1) // block_size)
    packed = pack_tokens(token_ids)
    extras = BlockExtras(cache_salt, adapter_id, tenant, num_shared_tokens // block_size)
    return chain_hashes(root_hash(model_fingerprint), extras, packed, block_size, num_blocks)
