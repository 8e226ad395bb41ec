"""Pinned prefixes of one pool: blocks that are never evicted while pinned.

A pin names the chained hashes of a prefix's full blocks (for a tenant, or in the shared
namespace). Each of them that is cached is held by the pin — one reference, so it is
never free and never evicted; each that is not cached yet is held the moment it is
published (a client computes the prefix once, as any prompt: ``KVPool._publish``
calls ``on_published``). Pinned blocks count against their tenant's quota like any cached
block. An invalidated pool (executor restart, reset) releases what its pins held: their KV
may be gone; the pins wait for the prefix to be computed again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmanager.block_pool import BlockPool, KVCacheBlock
from kvmanager.tenants import TenantLedger


@dataclass
class Pin:
    pin_id: int
    ledger: TenantLedger
    hashes: list[bytes]
    held: dict[bytes, KVCacheBlock] = field(default_factory=dict)


class PoolPins:
    def __init__(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.pins: dict[int, Pin] = {}
        self._waiting: dict[bytes, set[int]] = {}  # hash not held yet -> pins waiting for it
        self.generation = 0  # + 1 whenever every pin lets go (invalidation)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks the pins of this pool will hold once computed (a block two pins name counts twice)."""
        return sum(len(pin.hashes) for pin in self.pins.values())

    def pinned_blocks_of(self, ledger: TenantLedger) -> int:
        return sum(len(pin.hashes) for pin in self.pins.values() if pin.ledger is ledger)

    def add(self, pin: Pin) -> None:
        """Holds the pin's cached blocks now; the others when published."""
        self.pins[pin.pin_id] = pin
        cached = self.block_pool.cached_blocks
        for block_hash in pin.hashes:
            block = cached.get(block_hash)
            if block is not None and block.owner is pin.ledger:
                self._hold(pin, block_hash, block)
            else:
                self._waiting.setdefault(block_hash, set()).add(pin.pin_id)

    def remove(self, pin_id: int) -> int:
        """Releases what the pin holds; returns how many blocks."""
        pin = self.pins.pop(pin_id)
        for block_hash in pin.hashes:
            waiting = self._waiting.get(block_hash)
            if waiting is not None:
                waiting.discard(pin_id)
                if not waiting:
                    del self._waiting[block_hash]
        return self._release(pin)

    def on_published(self, block_hash: bytes, block: KVCacheBlock) -> None:
        waiting = self._waiting.get(block_hash)
        if waiting is None:
            return
        for pin_id in list(waiting):
            pin = self.pins[pin_id]
            if block.owner is pin.ledger:
                waiting.discard(pin_id)
                self._hold(pin, block_hash, block)
        if not waiting:
            del self._waiting[block_hash]

    def on_invalidated(self) -> None:
        """The pool's KV may be gone: every pin lets go and waits for its prefix again."""
        self.generation += 1
        for pin in self.pins.values():
            self._release(pin)
            for block_hash in pin.hashes:
                self._waiting.setdefault(block_hash, set()).add(pin.pin_id)

    def _hold(self, pin: Pin, block_hash: bytes, block: KVCacheBlock) -> None:
        self.block_pool.touch((block,))
        block.num_pins += 1
        pin.ledger.num_pinned += 1
        pin.held[block_hash] = block

    def _release(self, pin: Pin) -> int:
        blocks = list(pin.held.values())
        for block in blocks:
            block.num_pins -= 1
        pin.ledger.num_pinned -= len(blocks)
        pin.held.clear()
        self.block_pool.free_blocks(reversed(blocks))
        return len(blocks)
