"""A bounded index of block chains: keys of full KV blocks, each standing for its block and every
block before it, least recently used forgotten. What the gateway knows of prefixes before kvmanager
says: the router's prompts still being prefilled on an executor (``gateway.routing``) and the
scheduler's prompts computed whole (``gateway.computed_prefixes``). A key it holds wrongly costs a
misroute or a step, never a token: kvmanager decides every hit."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable


class BlockChainIndex:
    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity {capacity} must be > 0")
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def record(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def num_leading(self, keys: Iterable[Hashable], refresh: bool = False) -> int:
        """How many of ``keys``, from the first, are held; ``refresh``: those become the most
        recently used."""
        count = 0
        for key in keys:
            if key not in self._keys:
                break
            if refresh:
                self._keys.move_to_end(key)
            count += 1
        return count

    def __len__(self) -> int:
        return len(self._keys)
