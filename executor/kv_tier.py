"""Moving KV blocks between this executor's paged cache and its KV store (the store tier).

kvmanager decides what moves (load orders with an admission, saves and deletes with a
step); this module only moves bytes. A block's entry is its raw bytes in the cache's own
layout, every layer's K then V, so a load is a byte copy back: only executors whose
blocks are byte-compatible may share entries, which the namespace guarantees
(``store_namespace``: model fingerprint, dtypes including quantization and KV cache
dtype, attention backend, device type, per-layer block shapes).

A load that misses (absent, torn or corrupt entry, store unreachable) is reported, never
papered over: its sequence is not run (``ModelRunner`` drops it), so no token is ever
computed over KV that is not there.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from executor.attention.base import KVCache
from kvserve.kv_store import KVStore, StoreError
from kvserve.logs import get_logger

log = get_logger("executor.kv_tier")

# The default --kv-store-capacity: bytes of KV the store may hold for this namespace.
DEFAULT_STORE_CAPACITY_BYTES = 8 << 30


def store_namespace(store_id: str, model_fingerprint: str, precision: str, backend: str, device_type: str,
                    kv_caches: list[KVCache], block_size: int) -> str:
    """Names the entries this executor can read and write: equal exactly when two executors use
    the same store (``KVStore.identity``, not its URL: one path can name two disks) and their
    blocks are byte-compatible and computed alike."""
    key_cache, value_cache = kv_caches[0]
    layout = "|".join(str(part) for part in (
        store_id, model_fingerprint, precision, backend, device_type, block_size, len(kv_caches),
        key_cache.dtype, tuple(key_cache.shape[1:]), value_cache.dtype, tuple(value_cache.shape[1:])))
    return xxhash.xxh3_128_hexdigest(layout.encode())


class BlockMover:
    """Reads blocks of ``kv_caches`` into store entries and writes entries back."""

    def __init__(self, store: KVStore, namespace: str, kv_caches: list[KVCache]):
        self.store = store
        self.namespace = namespace
        self.kv_caches = kv_caches
        # Bytes of one block in each cache tensor, in entry order (layer by layer, K then V).
        self._part_bytes = [t[0].numel() * t.element_size() for kv in kv_caches for t in kv]
        self.bytes_per_block = sum(self._part_bytes)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for kv in self.kv_caches for t in kv]

    def save(self, block_ids: Sequence[int], hashes: Sequence[bytes], keys: Sequence[bytes]) -> list[bool]:
        """Writes each block under its hash; whether each was written whole."""
        if not block_ids:
            return []
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self._tensors()[0].device)
        # rows: [num_blocks, bytes_per_block] uint8 on the host, each one entry's payload
        rows = torch.cat([t.index_select(0, ids).reshape(len(block_ids), -1).view(torch.uint8)
                          for t in self._tensors()], dim=1).cpu().numpy()
        done = []
        for row, block_hash, key in zip(rows, hashes, keys):
            try:
                self.store.put(self.namespace, block_hash, key, row.tobytes())
                done.append(True)
            except (StoreError, ValueError) as exc:  # ValueError: a hash that is not its key's
                log.warning("kv_store_save_failed", reason=str(exc))
                done.append(False)
        return done

    def load(self, block_ids: Sequence[int], hashes: Sequence[bytes]) -> list[bytes]:
        """Copies each entry into its block; returns the hashes that missed (their blocks are
        left as they were)."""
        payloads, found_ids, missing = [], [], []
        for block_id, block_hash in zip(block_ids, hashes):
            entry = self._get(block_hash)
            if entry is None or len(entry[1]) != self.bytes_per_block:
                missing.append(block_hash)
                continue
            payloads.append(entry[1])
            found_ids.append(block_id)
        if found_ids:
            self._write_blocks(found_ids, payloads)
        return missing

    def _get(self, block_hash: bytes) -> tuple[bytes, bytes] | None:
        try:
            return self.store.get(self.namespace, block_hash)
        except StoreError as exc:
            log.warning("kv_store_load_failed", reason=str(exc))
            return None

    def _write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        tensors = self._tensors()
        device = tensors[0].device
        # rows: [num_blocks, bytes_per_block] uint8
        rows = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(block_ids), -1).to(device)
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        offset = 0
        for tensor, size in zip(tensors, self._part_bytes):
            part = rows[:, offset:offset + size].contiguous().view(tensor.dtype).view(len(block_ids), *tensor.shape[1:])
            tensor.index_copy_(0, ids, part)
            offset += size

    def delete(self, hashes: Sequence[bytes]) -> None:
        try:
            self.store.delete(self.namespace, hashes)
        except StoreError as exc:  # an entry left behind is unfindable already; the index evicts again
            log.warning("kv_store_delete_failed", reason=str(exc), num_hashes=len(hashes))
