"""What the scheduler expects a new prompt to hit in kvmanager's prefix cache, before the Allocate
that creates its sequence says.

A step's token budget counts the tokens it computes. A new sequence's Allocate asks for
``num_new_tokens`` counted after its prefix-cache hit, and the hit is known only from the answer;
a scheduler that asked for the whole prompt and charged it to the budget would leave the hit's
share of the step unused (32 prompts behind one 128-token system prompt: steps of 1,024-1,375
computed tokens where 2,048 were planned). So it remembers the full blocks of the prompts it saw
computed, chained as kvmanager chains them (``kvserve.prefix_hashes``: cache salt, tenant and shared
range included; the root is this gateway's own, since only its own hashes are compared), and plans
each new prompt's chunk after the longest run of them it starts with. A guess that is too high
leaves a prompt's tail to the next step; one too low leaves budget unused, as without a guess.
Neither changes a token: kvmanager's answer decides what is computed.
"""
from __future__ import annotations

from collections.abc import Sequence

from gateway.block_chains import BlockChainIndex
from kvserve.prefix_hashes import BlockExtras, chain_hashes, pack_tokens, root_hash

# Blocks remembered (least recently used forgotten): 64k blocks of 16 are a million prompt tokens,
# more than a CPU pool holds, at ~100 bytes each.
DEFAULT_CAPACITY = 65536


class ComputedPrefixes(BlockChainIndex):
    """The hashes of full prompt blocks this scheduler saw computed."""

    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY):
        if block_size <= 0:
            raise ValueError(f"block_size {block_size} must be > 0")
        super().__init__(capacity)
        self.block_size = block_size
        self._root = root_hash("")

    def hashes(self, token_ids: Sequence[int], num_blocks: int, cache_salt: str = "", tenant: str = "",
               num_shared_tokens: int = 0) -> list[bytes]:
        """The chained hashes of the first ``num_blocks`` full blocks of ``token_ids``."""
        bs = self.block_size
        extras = BlockExtras(cache_salt, "", tenant, num_shared_tokens // bs)
        return chain_hashes(self._root, extras, pack_tokens(token_ids[:num_blocks * bs]), bs, num_blocks)
