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
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

_DOMAIN = b"kvserve.prefix.v1\x00"


def _field(text: str) -> bytes:
    """A length-prefixed UTF-8 string, so that concatenations are unambiguous."""
    data = text.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def root_hash(model_fingerprint: str) -> bytes:
    """The parent hash of every sequence's first block: seeds the chain per model."""
    return xxhash.xxh3_128_digest(_DOMAIN + _field(model_fingerprint))


def extra_keys(cache_salt: str, adapter_id: str) -> bytes:
    """Bytes hashed into every block of a sequence (tenant salt, LoRA adapter)."""
    if not cache_salt and not adapter_id:
        return b""
    return _field(cache_salt) + _field(adapter_id)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int32 bytes (ids are validated 0 <= id < 2^31)."""
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def block_key(parent_hash: bytes, extra: bytes, token_ids: Sequence[int]) -> bytes:
    """What a full block's hash is computed from; the prefix cache keeps it to verify hits."""
    return parent_hash + struct.pack("<I", len(extra)) + extra + pack_tokens(token_ids)


def hash_key(key: bytes) -> bytes:
    """The 16-byte hash of a ``block_key``."""
    return xxhash.xxh3_128_digest(key)
