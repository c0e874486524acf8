"""Triton kernels for paged attention: writing K/V into the cache, decode and (chunked) prefill.

Cache layout. One layer's cache is ``kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]``
(index 0 = K, 1 = V), contiguous. A token's flat slot is ``block_id * block_size + offset``, so the
K row of (slot, kv_head) starts at element ``(slot * kv_heads + kv_head) * head_dim`` and the V row at
the same offset plus ``num_blocks * block_size * kv_heads * head_dim``. ``block_tables[b, j]`` is the
j-th block id of sequence ``b`` (padded with 0 past its blocks). The kernels read K/V through the
block table in place: every tile of ``BLOCK_N`` context positions looks up the block id of each of
its positions, so a tile may span several (non-adjacent) blocks and no context is gathered into a
padded tensor.

Decode (one query token per sequence) runs in two stages. Stage one has the grid
``(batch, kv_heads, num_splits)``: a program takes one sequence, one KV head and all the query heads
that share it (the GQA group, padded up to a power of two >= 16 so that ``tl.dot`` has tiles >= 16 in
every dimension), so each K/V tile is read once per group. The program covers one contiguous range of
its sequence's context (split ``s`` of ``num_splits`` equal ranges, rounded up to whole tiles) with an
online softmax in float32 and writes its running max (log2 domain), its sum of exponentials and its
un-normalised float32 accumulator to a scratch buffer; a split past the end of its sequence writes
the neutral values (max -inf, sum 0, accumulator 0). Stage two, grid ``(batch, heads)``, rescales the
splits to a common max and normalises. A padding row (``seq_lens[b] == 0``) reads no K/V and gets
zeros. With ``num_splits == 1`` stage one normalises and writes the output itself.

``num_splits`` depends only on shapes (the block table's width times the block size, the batch and
KV-head counts, the device's SM count) and never on the values in ``seq_lens``: the launch grid,
the scratch buffer and the choice of kernels are then fixed for given shapes, so a decode step can
be captured in a CUDA graph and replayed with other lengths, and the wrapper never reads a device
value (no host sync). The ranges themselves adapt to the actual length inside the kernel (a split
covers ``ceil(seq_len / num_splits)`` positions rounded up to a tile), so a short sequence in a wide
table still spreads over the splits it can fill. The default is
``max(1, min(32, ceil(max_blocks * block_size / 256), ceil(4 * SMs / (batch * kv_heads))))``: splits of
at least 256 positions of the widest possible context, and no more than needed to give every SM
about four programs.

Prefill (packed variable-length queries: prompts and prompt chunks) has the grid
``(ceil(max_query_len / BLOCK_M), batch, heads)``. Query ``i`` of sequence ``b`` sits at absolute
position ``seq_lens[b] - query_len_b + i`` (the step's tokens are the last ``query_len_b`` of the
context, whose K/V are already in the cache) and attends to positions ``<=`` its own: the causal mask
is bottom-right aligned, so a chunk sees the whole cached prefix. K/V tiles that every row of the
query tile sees whole are processed without a mask; the tiles on the diagonal are masked; tiles past
the last row's position are never visited. Rows past the sequence's query length are masked out.

All accumulation is in float32; inputs may be float32, bfloat16 or float16. For float32 inputs the
matrix products use ``input_precision="ieee"`` (no TF32), so results match a float32 PyTorch
reference on the GPU too. Under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) a bfloat16
``tl.dot`` multiplies the raw 16-bit patterns as integers, so there (and only there) bfloat16 tiles
are widened to float32 before the product; the values, and the float32 accumulation, are the same.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_HEAD_DIM = 16
_MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634

# Decode split rule (shape-only; see the module docstring).
_MAX_SPLITS = 32
_MIN_TOKENS_PER_SPLIT = 256
_PROGRAMS_PER_SM = 4


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` in float32; IEEE float32 products when IEEE, widened operands when UPCAST (interpreter)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kv_ptr,
    slot_ptr,
    v_offset,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    KV_HEADS: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One program per token: copies its [kv_heads, head_dim] K and V rows into the slot (skips slot < 0)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, KV_HEADS_P)
    d = tl.arange(0, HEAD_DIM)
    # A padding row (slot < 0) masks every head. (Written as a bound, not `& (slot >= 0)`: the interpreter
    # mishandles a scalar bool and-ed with a tensor.)
    mask = h[:, None] < tl.where(slot >= 0, KV_HEADS, 0)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    dst = slot * (KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    tl.store(kv_ptr + dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(kv_ptr + v_offset + dst, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    qk_scale,
    v_offset,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_btb,
    stride_ob,
    stride_oh,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Stage one of decode: one (sequence, KV head, split); all query heads of the group at once."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, GROUP_P)
    g_mask = g < GROUP
    head = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None],
        other=0.0,
    )

    m_i = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_P], dtype=tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_btb
    kv_head_off = kvh * HEAD_DIM
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = (blk * BLOCK_SIZE + pos % BLOCK_SIZE) * (KV_HEADS * HEAD_DIM) + kv_head_off
        k_t = tl.load(kv_ptr + row[None, :] + d[:, None], mask=n_mask[None, :], other=0.0)  # [D, N]
        s = _dot(q, k_t, IEEE, UPCAST) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_ptr + v_offset + row[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )
    else:
        idx = (b * HEADS + head) * NUM_SPLITS + split  # scratch [B, HEADS, NUM_SPLITS(, HEAD_DIM)]
        tl.store(m_ptr + idx, m_i, mask=g_mask)
        tl.store(l_ptr + idx, l_i, mask=g_mask)
        tl.store(acc_ptr + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    """Stage two of decode: one (sequence, head); combines the splits' partial softmax results."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    s_mask = s < NUM_SPLITS
    d = tl.arange(0, HEAD_DIM)
    idx = (b * HEADS + h) * NUM_SPLITS + s
    m = tl.load(m_ptr + idx, mask=s_mask, other=float("-inf"))
    l_s = tl.load(l_ptr + idx, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: a padding row
    w = tl.exp2(m - m_max)  # an empty split (max -inf) weighs 0
    total = tl.sum(w * l_s, 0)
    acc = tl.load(acc_ptr + idx[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    qsl_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    v_offset,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_btb,
    stride_ot,
    stride_oh,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (query tile, sequence, head): online softmax over the paged context, bottom-right causal."""
    q_tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    kvh = h // GROUP

    q_start = tl.load(qsl_ptr + b).to(tl.int32)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    ctx_off = seq_len - q_len  # absolute position of the sequence's first query
    m_start = q_tile * BLOCK_M

    rows = m_start + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = ctx_off + rows
    d = tl.arange(0, HEAD_DIM)
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :] * stride_qd,
        mask=row_mask[:, None],
        other=0.0,
    )

    # Keys [0, kv_end) are seen by some row of this tile; keys [0, full_end) by every row.
    # A tile with no rows (past the query length) visits nothing.
    first_pos = ctx_off + m_start
    kv_end = tl.minimum(first_pos + BLOCK_M, seq_len)
    kv_end = tl.where(m_start < q_len, kv_end, 0)
    full_end = tl.minimum(((first_pos + 1) // BLOCK_N) * BLOCK_N, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_btb
    kv_head_off = kvh * HEAD_DIM

    # Tiles every row sees whole: no mask (all positions < first_pos + 1 <= seq_len).
    for tile in range(0, full_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        blk = tl.load(bt_row + pos // BLOCK_SIZE).to(tl.int64)
        row = (blk * BLOCK_SIZE + pos % BLOCK_SIZE) * (KV_HEADS * HEAD_DIM) + kv_head_off
        k_t = tl.load(kv_ptr + row[None, :] + d[:, None])
        s = _dot(q, k_t, IEEE, UPCAST) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_ptr + v_offset + row[:, None] + d[None, :])
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m_i = m_new

    # Tiles on the diagonal (and the context's ragged end): causal and length mask.
    for tile in range(full_end, kv_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = (blk * BLOCK_SIZE + pos % BLOCK_SIZE) * (KV_HEADS * HEAD_DIM) + kv_head_off
        k_t = tl.load(kv_ptr + row[None, :] + d[:, None], mask=n_mask[None, :], other=0.0)
        s = _dot(q, k_t, IEEE, UPCAST) * qk_scale
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that sees nothing yet (max still -inf) must not produce -inf - -inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(kv_ptr + v_offset + row[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, UPCAST)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


# The interpreter replaces @triton.jit functions by InterpretedFunction objects at decoration time.
_INTERPRETED = not isinstance(_store_kv_kernel, triton.runtime.jit.JITFunction)


# --------------------------------------------------------------------------------------------------
# Checks and launch parameters (host-only: shapes, dtypes, devices; never a device value)
# --------------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Returns (num_blocks, block_size, kv_heads, head_dim) of a valid cache tensor."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if kv_cache.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} not supported (float32, bfloat16, float16)")
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    _check_head_dim(head_dim)
    return num_blocks, block_size, kv_heads, head_dim


def _check_head_dim(head_dim: int) -> None:
    if head_dim < _MIN_HEAD_DIM or head_dim > _MAX_HEAD_DIM or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [{_MIN_HEAD_DIM}, {_MAX_HEAD_DIM}], got {head_dim}")


def _check_device(ref: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, expected {ref.device}")


def _check_index(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def _check_query(q: torch.Tensor, kv_cache: torch.Tensor, kv_heads: int, head_dim: int) -> int:
    """Validates q [*, heads, head_dim] against the cache; returns the GQA group size."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} differs from kv_cache head_dim {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    return heads // kv_heads


def _dot_flags(dtype: torch.dtype) -> tuple[bool, bool]:
    """(IEEE, UPCAST) constexprs for tl.dot on tiles of ``dtype``."""
    return dtype == torch.float32, _INTERPRETED and dtype == torch.bfloat16


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200's SM count: the interpreter follows the same rule as the GPU


def _default_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits for decode from shapes only: enough programs to fill the GPU, each split >= 256 positions."""
    by_length = triton.cdiv(max_context, _MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), max(1, batch * kv_heads))
    return max(1, min(_MAX_SPLITS, by_length, by_occupancy))


# Tile budgets in bytes: a K or V tile of BLOCK_N rows stays within 16 KiB and a prefill Q tile within
# 32 KiB, so the software pipeline's buffers (num_stages of K and V) fit in shared memory for every
# head_dim and dtype (bfloat16 head_dim 128: BLOCK_M 128, BLOCK_N 64; float32 head_dim 128: 64, 32).
_KV_TILE_BYTES = 16 * 1024
_Q_TILE_BYTES = 32 * 1024


def _decode_block_n(head_dim: int, element_size: int) -> int:
    return min(64, _KV_TILE_BYTES // (head_dim * element_size))


def _prefill_config(head_dim: int, element_size: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for prefill; BLOCK_M shrinks for short queries (min 16)."""
    row_bytes = head_dim * element_size
    block_m = min(128, _Q_TILE_BYTES // row_bytes, max(16, _next_pow2(max_query_len)))
    block_n = min(64, _KV_TILE_BYTES // row_bytes)
    warps = 8 if block_m * head_dim >= 128 * 128 else 4
    return block_m, block_n, warps


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V into its cache slot, in place.

    k, v: [T, kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim];
    slot_mapping: [T] int32/int64 flat slots (``block_id * block_size + offset``). A slot < 0 is
    skipped (the padding rows of CUDA graphs), leaving the cache untouched.
    """
    _, _, kv_heads, head_dim = _check_cache(kv_cache)
    if k.dim() != 3 or k.shape[1:] != (kv_heads, head_dim):
        raise ValueError(f"k must be [T, {kv_heads}, {head_dim}], got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)}")
    _check_index("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    _check_device(kv_cache, k=k, v=v, slot_mapping=slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        kv_cache[0].numel(),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        KV_HEADS=kv_heads,
        KV_HEADS_P=_next_pow2(kv_heads),
        HEAD_DIM=head_dim,
        num_warps=1 if kv_heads * head_dim <= 512 else 4,
    )


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q: [B, heads, head_dim]; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 context length (tokens to attend, the
    current token's K/V already stored). ``seq_lens[b] == 0`` marks a padding row: its output is
    zeros and nothing is read. ``num_splits`` (split-K over the context) defaults to a value derived
    from shapes only (``block_tables.shape[1] * block_size``, batch, KV heads), so the call can be
    captured in a CUDA graph. Returns [B, heads, head_dim] in q.dtype.
    """
    _, block_size, kv_heads, head_dim = _check_cache(kv_cache)
    group = _check_query(q, kv_cache, kv_heads, head_dim)
    batch, heads, _ = q.shape
    _check_index("block_tables", block_tables, 2)
    _check_index("seq_lens", seq_lens, 1)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"batch mismatch: q {batch}, block_tables {block_tables.shape[0]}, seq_lens {seq_lens.shape[0]}"
        )
    _check_device(q, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens)
    if num_splits is None:
        num_splits = _default_num_splits(batch, kv_heads, block_tables.shape[1] * block_size, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    out = torch.empty((batch, heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits > 1:
        m_buf = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
        l_buf = torch.empty_like(m_buf)
        acc_buf = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    else:  # stage one writes the output; the scratch pointers are unused
        m_buf = l_buf = acc_buf = out
    ieee, upcast = _dot_flags(q.dtype)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        m_buf,
        l_buf,
        acc_buf,
        scale * _LOG2E,
        kv_cache[0].numel(),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HEADS=heads,
        KV_HEADS=kv_heads,
        GROUP=group,
        GROUP_P=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=_decode_block_n(head_dim, q.element_size()),
        NUM_SPLITS=num_splits,
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=4,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, heads)](
            m_buf,
            l_buf,
            acc_buf,
            out,
            out.stride(0),
            out.stride(1),
            HEADS=heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_P=_next_pow2(num_splits),
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Packed variable-length queries attending to paged K/V (prompts and prompt chunks).

    q: [T, heads, head_dim] packed; kv_cache: [2, num_blocks, block_size, kv_heads, head_dim];
    block_tables: [B, max_blocks] int32; query_start_loc: [B+1] int32 cumulative query starts
    (cu_seqlens); seq_lens: [B] int32 context lengths (cached tokens + this step's; the step's K/V
    already stored in the cache). Query i of sequence b sits at absolute position
    ``seq_lens[b] - query_len_b + i`` and attends causally to positions <= that one (bottom-right
    aligned causal mask, so a chunk sees the whole cached prefix). max_query_len: a Python int
    (host-known) >= every query_len_b; it sizes the grid. Returns [T, heads, head_dim] in q.dtype.
    """
    _, block_size, kv_heads, head_dim = _check_cache(kv_cache)
    group = _check_query(q, kv_cache, kv_heads, head_dim)
    num_tokens, heads, _ = q.shape
    _check_index("block_tables", block_tables, 2)
    _check_index("query_start_loc", query_start_loc, 1)
    _check_index("seq_lens", seq_lens, 1)
    batch = seq_lens.shape[0]
    if block_tables.shape[0] != batch or query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"batch mismatch: seq_lens {batch}, block_tables {block_tables.shape[0]}, "
            f"query_start_loc {query_start_loc.shape[0]} (expected {batch + 1})"
        )
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative Python int, got {max_query_len!r}")
    _check_device(q, kv_cache=kv_cache, block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens)

    out = torch.empty((num_tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0 or num_tokens == 0 or max_query_len == 0:
        return out
    block_m, block_n, warps = _prefill_config(head_dim, q.element_size(), max_query_len)
    ieee, upcast = _dot_flags(q.dtype)
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), batch, heads)](
        q,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E,
        kv_cache[0].numel(),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        KV_HEADS=kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=warps,
    )
    return out


__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
