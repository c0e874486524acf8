"""Triton paged-attention kernels against a plain float32 PyTorch reference.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is
imported) on CPU tensors; with one they are compiled and run on it. Every cache slot that belongs to
no sequence's context (block 0, which padded block-table entries point to, unassigned blocks, the tail
of each sequence's last block) holds NaN, so a kernel that reads anything outside the context it was
given produces NaN and fails the comparison.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math
from dataclasses import dataclass

import pytest
import triton  # noqa: F401  (a dev dependency: imported plainly, a missing triton fails the file)

from qwenbatch.layers.triton_attention import (
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}  # (atol, rtol)

# (heads, kv_heads, head_dim, block_size): GQA ratios 1, 2, 7 and 8.
CONFIGS = [(2, 2, 32, 16), (4, 2, 64, 32), (14, 2, 64, 16), (8, 1, 128, 32)]
CONFIG_IDS = [f"h{h}kv{kv}d{d}bs{bs}" for h, kv, d, bs in CONFIGS]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["f32", "bf16"]


@dataclass
class PagedContexts:
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim], NaN outside every context
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (a NaN block)
    seq_lens: torch.Tensor  # [B] int32


def make_contexts(
    lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    extra_columns: int = 3,
) -> PagedContexts:
    """Random K/V for contexts of the given lengths in a shared, shuffled block pool.

    The pool's block ids (block 0 excluded: the null block of padded table entries) are a random
    permutation, handed out to the sequences in turn block by block, with spare blocks left unused,
    so every sequence's blocks are scattered and interleaved with the others'.
    """
    blocks_needed = [math.ceil(n / block_size) for n in lens]
    spare = 5
    num_blocks = 1 + sum(blocks_needed) + spare
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables: list[list[int]] = [[] for _ in lens]
    while any(len(t) < n for t, n in zip(tables, blocks_needed, strict=True)):
        for t, n in zip(tables, blocks_needed, strict=True):
            if len(t) < n:
                t.append(pool.pop())
    max_blocks = max(blocks_needed, default=0) + extra_columns
    block_tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)

    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    flat = kv_cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    for b, n in enumerate(lens):
        slots = context_slots(block_tables[b], n, block_size)
        flat[:, slots] = torch.randn(2, n, kv_heads, head_dim, generator=gen).to(dtype)
    return PagedContexts(
        kv_cache=kv_cache.to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
    )


def context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [0, length) of one sequence."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def reference_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """float32 attention of one sequence's queries q [Q, heads, D] (the last Q positions of its context)."""
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    query_len, heads, _ = q.shape
    slots = context_slots(block_table, context_len, block_size)
    k = kv_cache[0].reshape(-1, kv_heads, head_dim)[slots].float()  # [L, kv_heads, D]
    v = kv_cache[1].reshape(-1, kv_heads, head_dim)[slots].float()
    k = k.repeat_interleave(heads // kv_heads, dim=1)  # [L, heads, D]: query head h uses KV head h // group
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = context_len - query_len + torch.arange(query_len, device=q.device)
    k_pos = torch.arange(context_len, device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def reference_decode(q: torch.Tensor, ctx: PagedContexts, scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(ctx.seq_lens.tolist()):
        if n > 0:
            out[b] = reference_attention(q[b : b + 1], ctx.kv_cache, ctx.block_tables[b], n, scale)[0]
    return out


def reference_prefill(
    q: torch.Tensor, ctx: PagedContexts, query_lens: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference [T, heads, D] in float32, query_start_loc [B+1] int32)."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(ctx.seq_lens.tolist()):
        rows = slice(starts[b], starts[b + 1])
        out[rows] = reference_attention(q[rows], ctx.kv_cache, ctx.block_tables[b], n, scale)
    return out, torch.tensor(starts, dtype=torch.int32, device=q.device)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_store_kv_writes_exactly_the_mapped_slots(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 16, 2, 64, 23
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    # K and V as non-contiguous views of one packed projection, as a model produces them.
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=gen).to(dtype)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.tensor([0, 5, 22])] = -1  # padding rows: skipped
    expected = cache.clone()
    flat = expected.view(2, -1, kv_heads, head_dim)
    real = slots >= 0
    flat[0, slots[real]] = k[real]
    flat[1, slots[real]] = v[real]

    cache_dev = cache.to(DEVICE)
    store_kv(k.to(DEVICE), v.to(DEVICE), cache_dev, slots.to(slot_dtype).to(DEVICE))
    assert torch.equal(cache_dev.cpu(), expected)
    assert torch.equal(cache_dev.cpu().view(2, -1, kv_heads, head_dim)[0, slots[real]], k[real])


def test_store_kv_all_padding_leaves_cache_untouched() -> None:
    cache = torch.randn(2, 3, 16, 1, 32, device=DEVICE)
    before = cache.clone()
    k = torch.randn(4, 1, 32, device=DEVICE)
    store_kv(k, k, cache, torch.full((4,), -1, dtype=torch.int32, device=DEVICE))
    assert torch.equal(cache, before)


# --------------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), CONFIGS, ids=CONFIG_IDS)
def test_decode_matches_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    # Short and long contexts: 1, on a block boundary, just past one, a padding row (0), ~2,000.
    medium = int(torch.randint(40, 400, (1,), generator=gen))
    lens = [1, block_size, block_size + 1, 1993, 0, medium]
    ctx = make_contexts(lens, kv_heads, head_dim, block_size, dtype, gen)
    q = (2.0 * torch.randn(len(lens), heads, head_dim, generator=gen)).to(dtype).to(DEVICE)  # peaky softmax
    scale = head_dim**-0.5
    expected = reference_decode(q, ctx, scale)
    # 1: one program per (sequence, KV head); 5: more splits than the short sequences have blocks;
    # None: the shape-derived default (> 1 here); 32 (one config, the interpreter is slow): mostly empty splits.
    for num_splits in (1, 5, None, 32) if heads == kv_heads else (1, 5, None):
        out = paged_decode_attention(q, ctx.kv_cache, ctx.block_tables, ctx.seq_lens, scale, num_splits)
        assert out.shape == q.shape
        assert_matches(out, expected, dtype)
        assert torch.equal(out[4], torch.zeros_like(out[4]))  # the padding row


def test_decode_reads_through_the_block_table() -> None:
    """Pointing one block-table entry at another sequence's block must change that sequence's output
    (the comparison can fail, and not only through NaN)."""
    gen = torch.Generator().manual_seed(7)
    ctx = make_contexts([100, 70], 1, 32, 16, torch.float32, gen)
    q = torch.randn(2, 2, 32, generator=gen).to(DEVICE)
    expected = reference_decode(q, ctx, 1.0)
    wrong = ctx.block_tables.clone()
    wrong[0, 1] = wrong[1, 0]  # a full block of real (finite) K/V, but sequence 1's
    out = paged_decode_attention(q, ctx.kv_cache, wrong, ctx.seq_lens, 1.0, num_splits=2)
    assert torch.isfinite(out).all()
    assert_matches(out[1:], expected[1:], torch.float32)
    with pytest.raises(AssertionError):
        assert_matches(out[:1], expected[:1], torch.float32)


def test_decode_float16() -> None:
    gen = torch.Generator().manual_seed(3)
    ctx = make_contexts([33, 250], 2, 64, 16, torch.float16, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(torch.float16).to(DEVICE)
    out = paged_decode_attention(q, ctx.kv_cache, ctx.block_tables, ctx.seq_lens, 0.125, num_splits=3)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference_decode(q, ctx, 0.125), atol=5e-3, rtol=5e-3)


# --------------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------------


def run_prefill(
    query_lens: list[int], context_lens: list[int], config: tuple[int, int, int, int], dtype: torch.dtype, seed: int
) -> None:
    heads, kv_heads, head_dim, block_size = config
    gen = torch.Generator().manual_seed(seed)
    ctx = make_contexts(context_lens, kv_heads, head_dim, block_size, dtype, gen)
    q = (2.0 * torch.randn(sum(query_lens), heads, head_dim, generator=gen)).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    expected, query_start_loc = reference_prefill(q, ctx, query_lens, scale)
    out = paged_prefill_attention(
        q, ctx.kv_cache, ctx.block_tables, query_start_loc, ctx.seq_lens, scale, max(query_lens)
    )
    assert out.shape == q.shape
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_prefill_fresh_prompts(config: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    """Whole prompts (query_len == context_len): 1, a block boundary, just past one, a few tiles."""
    block_size = config[3]
    lens = [1, block_size, block_size + 1, 150]
    run_prefill(lens, lens, config, dtype, seed=11)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_prefill_mixed_prompts_and_chunks(config: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    """A fresh prompt, 37 query tokens at the end of a 300-token context, a one-token chunk, a chunk
    ending on a block boundary, and a chunk starting just past one."""
    block_size = config[3]
    query_lens = [45, 37, 1, 2 * block_size, 20]
    context_lens = [45, 300, 130, 5 * block_size, 4 * block_size + 1 + 19]
    run_prefill(query_lens, context_lens, config, dtype, seed=12)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prefill_long_contexts(dtype: torch.dtype) -> None:
    """~2,000-token contexts: a whole prompt and a 200-token chunk of a longer one, in one batch."""
    run_prefill([1999, 200], [1999, 2048], (2, 1, 32, 16), dtype, seed=13)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prefill_chunk_offsets_around_tile_edges(dtype: torch.dtype) -> None:
    """Chunks whose first query sits at every position 54..73 (around the 64-key tile edge, block edges
    at 64): the split between unmasked and causally masked key tiles must not let a query see a later key."""
    offsets = list(range(54, 74))
    query_lens = [3 + i % 5 for i in range(len(offsets))]
    context_lens = [off + n for off, n in zip(offsets, query_lens, strict=True)]
    run_prefill(query_lens, context_lens, (2, 1, 32, 16), dtype, seed=16)


def test_prefill_head_dim_128_chunk() -> None:
    run_prefill([37, 64], [300, 64], (4, 2, 128, 16), torch.bfloat16, seed=14)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [16, 256])
def test_smallest_and_largest_head_dim(head_dim: int, dtype: torch.dtype) -> None:
    """head_dim 16 and 256 (other tile sizes: float32 at 256 uses 32-row query and 16-key tiles)."""
    run_prefill([5, 40, 70], [5, 130, 70], (4, 2, head_dim, 16), dtype, seed=17)
    gen = torch.Generator().manual_seed(18)
    ctx = make_contexts([1, 130, 0], 2, head_dim, 16, dtype, gen)
    q = torch.randn(3, 4, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = paged_decode_attention(q, ctx.kv_cache, ctx.block_tables, ctx.seq_lens, head_dim**-0.5, num_splits=3)
    assert_matches(out, reference_decode(q, ctx, head_dim**-0.5), dtype)


def test_prefill_chunk_equals_decode_for_one_query() -> None:
    """A one-token chunk is a decode step: both kernels agree."""
    gen = torch.Generator().manual_seed(15)
    ctx = make_contexts([513, 77], 2, 64, 32, torch.float32, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    prefill = paged_prefill_attention(q, ctx.kv_cache, ctx.block_tables, qsl, ctx.seq_lens, 0.125, 1)
    decode = paged_decode_attention(q, ctx.kv_cache, ctx.block_tables, ctx.seq_lens, 0.125, num_splits=4)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def test_rejects_bad_arguments() -> None:
    cache = torch.zeros(2, 4, 16, 2, 64, device=DEVICE)
    tables = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(3, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(3, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(torch.zeros(3, 4, 48), torch.zeros(2, 4, 16, 2, 48), tables.cpu(), lens.cpu(), 1.0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_decode_attention(torch.zeros(3, 3, 64, device=DEVICE), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.to(torch.bfloat16), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="batch mismatch"):
        paged_decode_attention(q, cache, tables[:2], lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(torch.zeros(3, 4, 32, device=DEVICE), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, cache, tables, torch.zeros(3, dtype=torch.int32, device=DEVICE), lens, 1.0, 1)
    with pytest.raises(ValueError, match="k must be"):
        store_kv(torch.zeros(3, 1, 64, device=DEVICE), q, cache, lens)
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="on cpu"):
            paged_decode_attention(q, cache, tables.cpu(), lens, 1.0)
