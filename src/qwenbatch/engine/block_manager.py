"""KV-cache blocks: allocation and release per sequence. Pure Python, no torch."""

from __future__ import annotations

from collections import deque

from qwenbatch.engine.sequence import Sequence


class BlockManager:
    """A pool of ``num_blocks`` blocks of ``block_size`` token slots each.

    A sequence's ``block_table`` lists its blocks in order; token ``p`` of the sequence lives in
    slot ``block_table[p // block_size] * block_size + p % block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to cover ``num_tokens`` tokens; the caller checked can_allocate."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"need {need} blocks, {len(self.free_blocks)} free")
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(need))

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool."""
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
