"""The store tier's orders for one Execute: which blocks to save (with their hashes and keys) and
which stored entries to delete (``kvserve.v1.StoreOrders``). kvmanager makes them, the gateway
carries them, the executor carries them out: one type for all three."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StoreOrders:
    save_block_ids: list[int] = field(default_factory=list)
    save_hashes: list[bytes] = field(default_factory=list)
    save_keys: list[bytes] = field(default_factory=list)
    delete_hashes: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.save_block_ids or self.delete_hashes)

    def extend(self, other) -> None:
        """Adds the orders of a ``StoreOrders``-like object (the protobuf message too)."""
        self.save_block_ids += other.save_block_ids
        self.save_hashes += other.save_hashes
        self.save_keys += other.save_keys
        self.delete_hashes += other.delete_hashes
