"""Block manager on a tiny pool: exact block ids, ref counts, prefix hits and eviction order."""

from __future__ import annotations

from qwenbatch.engine.block_manager import BlockManager
from qwenbatch.engine.sequence import Sequence
from qwenbatch.sampling_params import SamplingParams

BS = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens), SamplingParams(), 16)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a new sequence: take its cached prefix, allocate the rest."""
    cached = bm.take_cached_prefix(seq)
    bm.allocate(seq, seq.num_tokens)
    return cached


def test_allocation_hands_out_blocks_in_order_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a, b = make_seq(0, list(range(10))), make_seq(1, list(range(100, 105)))
    admit(bm, a)
    admit(bm, b)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    bm.free(a)
    assert bm.num_free_blocks == 6
    # Nothing can be hit, so the freed blocks are handed out again before the never-used 5, 6, 7.
    assert list(bm.free_queue) == [2, 1, 0, 5, 6, 7]


def test_growing_a_sequence_adds_a_block_only_at_a_boundary():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(0, [1, 2, 3])
    admit(bm, seq)
    assert seq.block_table == [0]
    seq.token_ids.append(4)
    bm.allocate(seq, 4)
    assert seq.block_table == [0]
    seq.token_ids.append(5)
    bm.allocate(seq, 5)
    assert seq.block_table == [0, 1]


def test_shared_prefix_hits_full_blocks_and_counts_references():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prefix = list(range(8))
    a = make_seq(0, [*prefix, 50, 51])
    b = make_seq(1, [*prefix, 60])
    assert admit(bm, a) == 0
    assert admit(bm, b) == 8
    assert a.block_table[:2] == b.block_table[:2] == [0, 1]
    assert b.block_table[2] == 3  # its own tail block
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10 + 9, 8)


def test_the_last_prompt_token_is_always_recomputed():
    bm = BlockManager(num_blocks=10, block_size=BS)
    tokens = list(range(8))  # exactly two full blocks
    admit(bm, make_seq(0, tokens))
    again = make_seq(1, tokens)
    assert admit(bm, again) == 4  # the second block holds the last token, so it is not taken
    assert again.num_computed_tokens == 4


def test_freed_blocks_keep_their_hash_until_evicted_lru_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(0, list(range(9)))  # blocks 0, 1 full; 2 partial
    admit(bm, a)
    bm.free(a)
    # The partial tail to the front, the never-used 3, then the cached blocks tail first.
    assert list(bm.free_queue) == [2, 3, 1, 0]
    # Same prefix again: blocks 0 and 1 come back from the free queue; the tail reuses block 2.
    a2 = make_seq(1, list(range(9)))
    assert admit(bm, a2) == 8
    assert a2.block_table == [0, 1, 2]
    bm.free(a2)
    # A different prompt needing 3 blocks evicts from the front: 2 (partial), then 3, then 1.
    c = make_seq(2, list(range(100, 112)))
    assert admit(bm, c) == 0
    assert c.block_table == [2, 3, 1]
    assert bm.num_cached_tokens(make_seq(3, list(range(9)))) == 4  # block 0 survives; block 1 was evicted


def test_eviction_order_partial_tails_first_newest_first_then_cached_blocks_lru_tail_first():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(0, list(range(6)))  # block 0 full, 1 partial
    b = make_seq(1, list(range(100, 106)))  # block 2 full, 3 partial
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    # Partial tails at the front, the last freed first; never-used blocks; cached blocks, least recently freed first.
    assert list(bm.free_queue) == [3, 1, 4, 5, 6, 7, 0, 2]
    everything = make_seq(2, list(range(200, 232)))  # 8 blocks: the whole pool
    assert admit(bm, everything) == 0
    assert everything.block_table == [3, 1, 4, 5, 6, 7, 0, 2]


def test_a_multi_block_prefix_is_evicted_from_its_tail_and_its_head_stays_a_hit():
    bm = BlockManager(num_blocks=6, block_size=BS)
    prompt = list(range(13))  # blocks 0, 1, 2 full; 3 partial
    a = make_seq(0, prompt)
    admit(bm, a)
    bm.free(a)
    assert list(bm.free_queue) == [3, 4, 5, 2, 1, 0]
    other = make_seq(1, list(range(100, 116)))  # 4 blocks: the partial tail, the unused ones, then prefix block 2
    admit(bm, other)
    assert other.block_table == [3, 4, 5, 2]
    bm.free(other)
    again = make_seq(2, prompt)
    assert admit(bm, again) == 8  # blocks 0 and 1 still hit; block 2 was evicted
    assert again.block_table[:2] == [0, 1]


def test_a_shared_prefix_block_is_queued_only_when_its_last_holder_frees_it():
    bm = BlockManager(num_blocks=6, block_size=BS)
    prefix = list(range(8))
    a, b = make_seq(0, [*prefix, 50]), make_seq(1, [*prefix, 60])
    admit(bm, a)
    admit(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [0, 1, 3])
    bm.free(a)
    assert list(bm.free_queue) == [2, 4, 5]  # only a's own partial tail
    bm.free(b)
    assert list(bm.free_queue) == [3, 2, 4, 5, 1, 0]
    c = make_seq(2, [*prefix, 70])
    assert admit(bm, c) == 8
    assert c.block_table == [0, 1, 3]


def test_a_scored_pairs_own_blocks_are_reused_first_and_its_shared_prefix_stays_cached():
    bm = BlockManager(num_blocks=10, block_size=BS)
    prefix = list(range(8))  # blocks 0 and 1, taken by the second pair
    a, b = make_seq(0, [*prefix, *range(50, 59)]), make_seq(1, [*prefix, *range(60, 69)])
    a.score_only = b.score_only = True
    admit(bm, a)
    admit(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2, 3, 4], [0, 1, 5, 6, 7])
    bm.free(a)
    bm.free(b)
    # Each pair's own blocks, the last freed first, before the never-used 8 and 9; the prefix at the back.
    assert list(bm.free_queue) == [7, 6, 5, 4, 3, 2, 8, 9, 1, 0]
    assert bm.num_cached_tokens(make_seq(2, [*prefix, *range(60, 69)])) == 16  # still hits until reused
    c = make_seq(3, [*prefix, *range(70, 79)])
    c.score_only = True
    assert admit(bm, c) == 8
    assert c.block_table == [0, 1, 7, 6, 5]


def test_a_full_block_whose_hash_another_block_holds_is_reused_first(monkeypatch):
    import qwenbatch.engine.block_manager as bm_module

    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=6, block_size=BS)
    admit(bm, make_seq(0, [1, 2, 3, 4, 5]))  # block 0 holds hash 42
    other = make_seq(1, [9, 9, 9, 9, 5])
    admit(bm, other)
    assert other.block_table == [2, 3]  # block 2 is full, but no lookup can find it
    bm.free(other)
    assert list(bm.free_queue) == [3, 2, 4, 5]


def test_a_hash_collision_is_caught_by_the_token_check(monkeypatch):
    import qwenbatch.engine.block_manager as bm_module

    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=6, block_size=BS)
    admit(bm, make_seq(0, [1, 2, 3, 4, 5]))
    other = make_seq(1, [9, 9, 9, 9, 5])
    assert admit(bm, other) == 0
    assert other.block_table == [2, 3]


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(bm, make_seq(0, list(range(9))))
    b = make_seq(1, list(range(9)))
    assert admit(bm, b) == 0
    assert bm.prefix_cache_hits == 0
    assert b.block_table == [3, 4, 5]


def test_blocks_registered_in_the_same_step_are_shared_at_once():
    """Two prompts admitted in one step: the second reuses blocks the first fills in that step."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(0, [*list(range(12)), 7]), make_seq(1, [*list(range(12)), 8])
    admit(bm, a)
    assert admit(bm, b) == 12
    assert b.block_table[:3] == a.block_table[:3]
