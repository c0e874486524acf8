"""The CPU path's paged attention (TorchAttentionMetadata) against a float64 softmax over exactly the keys
each query may see: a prompt chunk after a cached prefix, a fresh prompt, decodes of different lengths
padded to the longest, and all of them in one packed step.

Every cache slot outside the sequences' contexts holds NaN (block 0 included, so padding that pointed
at slot 0 would show), so attention that reads any other slot, or pads with a non-finite slot, turns
the output into NaN and fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from qwenbatch.layers.attention import StepLayout, TorchAttentionMetadata, slots_of

BS = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # GQA: query heads 0, 1 read KV head 0; heads 2, 3 read KV head 1
SCALE = HEAD_DIM**-0.5
CPU = torch.device("cpu")


@dataclass
class Seq:
    """One sequence of a step: ``cached`` positions already in the cache, ``new`` query tokens after them."""

    table: list[int]
    cached: int
    new: int
    q: torch.Tensor  # [new, HEADS, HEAD_DIM]
    k: torch.Tensor  # [cached + new, KV_HEADS, HEAD_DIM]: the whole context's keys
    v: torch.Tensor


def make_step(specs: list[tuple[list[int], int, int]], num_blocks: int) -> tuple[StepLayout, torch.Tensor, list[Seq]]:
    """A step of sequences (block table, cached, new), decodes (new == 1 after a prefix) listed first;
    the cache holds each one's cached K/V and NaN everywhere else."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.full((2, num_blocks, BS, KV_HEADS, HEAD_DIM), float("nan"), dtype=torch.float64)
    layout = StepLayout(BS)
    seqs = []
    for table, cached, new in specs:
        n = cached + new
        seq = Seq(
            table,
            cached,
            new,
            torch.randn(new, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64),
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64),
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64),
        )
        slots = torch.from_numpy(slots_of(table, 0, cached, BS))
        flat_k, flat_v = cache[0].view(-1, KV_HEADS, HEAD_DIM), cache[1].view(-1, KV_HEADS, HEAD_DIM)
        flat_k[slots], flat_v[slots] = seq.k[:cached], seq.v[:cached]
        if new == 1 and cached > 0:
            layout.add_decode(0, table, n)
        else:
            layout.add_prefill([0] * new, table, cached)
        seqs.append(seq)
    return layout, cache, seqs


def run_step(layout: StepLayout, cache: torch.Tensor, seqs: list[Seq]) -> torch.Tensor:
    """The step's attention output, [T, HEADS, HEAD_DIM], rows in packed order."""
    meta = TorchAttentionMetadata.build(layout, CPU)
    q = torch.cat([s.q for s in seqs])
    k = torch.cat([s.k[s.cached :] for s in seqs])
    v = torch.cat([s.v[s.cached :] for s in seqs])
    return meta.attend(q, k, v, cache, SCALE).view(-1, HEADS, HEAD_DIM)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query row [HEADS, HEAD_DIM] attending to exactly ``keys``/``values`` [L, KV_HEADS, HEAD_DIM]."""
    out = torch.empty_like(q)
    for h in range(HEADS):
        kv = h // (HEADS // KV_HEADS)
        scores = keys[:, kv] @ q[h] * SCALE
        weights = torch.exp(scores - scores.max())
        out[h] = (weights / weights.sum()) @ values[:, kv]
    return out


def assert_each_query_sees_its_prefix_only(out: torch.Tensor, seqs: list[Seq]) -> None:
    """Query j of a sequence (position cached + j) sees exactly positions 0 .. cached + j."""
    row = 0
    for s in seqs:
        for j in range(s.new):
            visible = s.cached + j + 1
            expected = reference(s.q[j], s.k[:visible], s.v[:visible])
            torch.testing.assert_close(out[row], expected, rtol=1e-12, atol=1e-12)
            row += 1
    assert row == out.shape[0]


def test_a_chunk_after_a_cached_prefix_sees_the_prefix_and_the_chunk_up_to_itself():
    # Positions 0-5 cached in blocks 6, 2 (the second half full); the chunk is positions 6-10, over blocks 2 and 4.
    layout, cache, seqs = make_step([([6, 2, 4], 6, 5)], num_blocks=8)
    assert_each_query_sees_its_prefix_only(run_step(layout, cache, seqs), seqs)


def test_a_fresh_prompt_is_causal():
    layout, cache, seqs = make_step([([3, 1], 0, 7)], num_blocks=5)
    assert_each_query_sees_its_prefix_only(run_step(layout, cache, seqs), seqs)


SHORT, MID, LONG = ([3], 1, 1), ([7, 1], 5, 1), ([5, 2, 8], 8, 1)  # decodes at contexts 2, 6, 9


@pytest.mark.parametrize(
    "specs",
    [[SHORT, MID, LONG], [LONG, SHORT, MID], [([3, 7], 4, 1), ([1, 5], 4, 1)]],
    ids=["shortest-first", "longest-first", "equal-lengths"],
)
def test_decodes_of_different_lengths_attend_only_to_their_own_context(specs):
    # Block 0 and blocks 4, 6, 9 belong to nobody: NaN, as are the unused tails of each last block.
    layout, cache, seqs = make_step(specs, num_blocks=10)
    assert layout.num_decodes == len(specs)
    out = run_step(layout, cache, seqs)
    assert torch.isfinite(out).all()
    assert_each_query_sees_its_prefix_only(out, seqs)


def test_a_mixed_step_attends_each_row_to_its_own_sequence_and_writes_each_row_to_its_slot():
    specs = [
        ([9], 2, 1),  # a decode at position 2
        ([4, 11, 6], 10, 1),  # a decode at position 10: the longest decode, so the other one is padded
        ([2, 7], 0, 6),  # a fresh prompt
        ([10, 3, 5], 5, 4),  # a chunk: positions 5-8 after 5 cached
    ]
    layout, cache, seqs = make_step(specs, num_blocks=12)
    out = run_step(layout, cache, seqs)
    assert_each_query_sees_its_prefix_only(out, seqs)
    flat_k, flat_v = cache[0].view(-1, KV_HEADS, HEAD_DIM), cache[1].view(-1, KV_HEADS, HEAD_DIM)
    for s in seqs:
        slots = torch.from_numpy(slots_of(s.table, 0, s.cached + s.new, BS))
        assert torch.equal(flat_k[slots], s.k)
        assert torch.equal(flat_v[slots], s.v)
    # Nothing else was written: every slot outside the contexts is still NaN.
    written = sum(s.cached + s.new for s in seqs)
    assert int((~torch.isnan(flat_k[:, 0, 0])).sum()) == written
