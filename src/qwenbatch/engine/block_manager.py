"""KV-cache blocks with automatic prefix caching. Pure Python, no torch.

A full block is identified by a hash chaining its parent's hash and its own token ids, so equal
prefixes map to equal hash chains. New blocks are handed out from the front of one free queue.
Freed blocks keep their hash and contents: a later request with the same prefix takes them back
(a hit) until they are handed out as fresh blocks (evicted). The queue's order is vLLM v1's:

- a sequence's blocks are freed tail first, so the end of a prefix is evicted before its head;
- a freed block no lookup can find goes to the front, to be reused before any cached block: a
  partial tail (vLLM: a block without a hash), or a full block whose hash another block already
  holds (here ``cached`` maps a hash to one block, so such a duplicate can never be hit);
- a scored pair's blocks that no other sequence took go to the front too, still cached: a (query,
  document) pair is scored once, so its document's blocks would only hold fresh memory back from
  reuse, and every block first handed out costs the kernel a page fault and zeroing (~2 MB a block of
  a 0.6B reranker's K/V: up to half of a short scoring job here, BENCHMARKS.md); the query's prefix,
  taken by the query's other pairs, stays cached;
- a freed cached block goes to the back (least recently freed is evicted first).

With prefix caching off no block can be hit, so every freed block goes to the front.
A hit is verified against the stored token ids, so a hash collision can never serve wrong K/V.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from qwenbatch.engine.sequence import Sequence


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered for reuse
    token_ids: tuple[int, ...] = ()  # the tokens behind block_hash, to verify hits
    taken: bool = False  # a prefix-cache hit gave it to another sequence since it was handed out


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """The hash of a full block: its parent's hash and its tokens (Python's tuple hash of ints is stable)."""
    return hash((parent, token_ids))


class BlockManager:
    """A pool of ``num_blocks`` blocks of ``block_size`` token slots.

    A sequence's ``block_table`` lists its blocks in order; token ``p`` lives in slot
    ``block_table[p // block_size] * block_size + p % block_size``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; OrderedDict gives O(1) removal on a cache hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, found in the cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    # -- prefix cache -------------------------------------------------------------------------------

    def _full_block_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Hashes of ``seq``'s first ``num_tokens // block_size`` blocks, memoised on the sequence."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return hashes[: num_tokens // bs]

    def num_cached_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of ``seq`` the cache holds now (the last token never counts; none while its
        prompt's logprobs are wanted)."""
        if not self.enable_prefix_caching or seq.prompt_logprobs_from is not None:
            return 0
        count = 0
        for i, h in enumerate(self._full_block_hashes(seq, seq.num_tokens - 1)):
            block_id = self.cached.get(h)
            if block_id is None or not self._matches(block_id, seq, i):
                break
            count += self.block_size
        return count

    def _matches(self, block_id: int, seq: Sequence, index: int) -> bool:
        bs = self.block_size
        return self.blocks[block_id].token_ids == tuple(seq.token_ids[index * bs : (index + 1) * bs])

    def take_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence without blocks: reuse its cached prefix, set num_computed_tokens, return it."""
        num_cached = self.num_cached_tokens(seq)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached
        for h in seq.block_hashes[: num_cached // self.block_size]:
            block = self.blocks[self.cached[h]]
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
            block.taken = True
            seq.block_table.append(block.block_id)
        seq.num_computed_tokens = num_cached
        return num_cached

    # -- allocation ---------------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that its first ``num_tokens`` tokens have slots."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_queue)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` slots for its first ``num_tokens`` tokens, and register the blocks this fills.

        Blocks are registered as soon as they are allocated full: their K/V are written in this
        step's forward before any attention reads them, so a request scheduled later in the same
        step can already share them.
        """
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_queue):
            raise RuntimeError(f"need {need} blocks, {len(self.free_queue)} free")
        for _ in range(need):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached contents
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash, block.token_ids = None, ()
            block.ref_count, block.taken = 1, False
            seq.block_table.append(block_id)
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, num_tokens)

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        bs = self.block_size
        hashes = self._full_block_hashes(seq, num_tokens)
        for i in range(seq.num_registered_blocks, len(hashes)):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = hashes[i]
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self.cached.setdefault(hashes[i], block.block_id)
        seq.num_registered_blocks = max(seq.num_registered_blocks, len(hashes))

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks in the free queue's order (module docstring): tail blocks first;
        blocks that cannot be hit, and a scored pair's blocks no one else took, to the front, in that
        order; cached blocks to the back."""
        uncached: list[int] = []  # to the front
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self.free_queue[block_id] = None
            hittable = block.block_hash is not None and self.cached.get(block.block_hash) == block_id
            one_shot = seq.score_only and not block.taken
            if not hittable or one_shot:
                uncached.append(block_id)
        for block_id in reversed(uncached):
            self.free_queue.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_registered_blocks = 0
