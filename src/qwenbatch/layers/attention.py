"""Paged attention over packed variable-length batches (CPU path).

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``. Each
step's tokens arrive packed (no padding in the matmuls); ``AttentionMetadata`` says where each
token's K/V is written and which cached slots each sequence attends to. The index tensors are
built once per step by the model runner and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One sequence that computes several query tokens this step (a prompt or a prompt chunk)."""

    query_start: int  # first row of this sequence's tokens in the packed batch
    query_len: int  # number of query tokens this step
    context_len: int  # tokens attended to: cached ones plus this step's
    # Flat cache slots of all context tokens, or None when the whole context is this step's
    # tokens (a fresh prompt): then the K/V just computed are used without a gather.
    kv_slots: torch.Tensor | None


@dataclass
class AttentionMetadata:
    """Per-step attention layout shared by all layers."""

    slot_mapping: torch.Tensor  # [T] flat cache slot that receives each packed token's K/V
    prefills: list[PrefillSpan]
    # Sequences decoding one token this step, attended in one padded call:
    decode_rows: torch.Tensor | None  # [D] their rows in the packed batch
    decode_kv_slots: torch.Tensor | None  # [D, L_max] flat slots of each one's context, padded with a real slot
    decode_mask: torch.Tensor | None  # [D, 1, 1, L_max] True where a slot is real context


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write k/v into the cache, attend, and return ``[T, heads * head_dim]``.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]. Grouped-query attention is handled
    by SDPA's ``enable_gqa``; causality inside a chunk is bottom-right aligned (the chunk's
    queries are the last ``query_len`` positions of the context).
    """
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    k_flat = kv_cache[0].view(-1, kv_heads, head_dim)
    v_flat = kv_cache[1].view(-1, kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)

    out = torch.empty_like(q)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        if span.kv_slots is None:
            kk, vv = k[rows], v[rows]
        else:
            kk, vv = k_flat[span.kv_slots], v_flat[span.kv_slots]
        if span.query_len == span.context_len:
            mask, causal = None, True
        else:
            mask, causal = _chunk_causal_mask(span.query_len, span.context_len, q.device), False
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),
            kk.transpose(0, 1),
            vv.transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.transpose(0, 1)

    if meta.decode_rows is not None:
        qd = q[meta.decode_rows][:, :, None, :]  # [D, heads, 1, head_dim]
        kd = k_flat[meta.decode_kv_slots].transpose(1, 2)  # [D, kv_heads, L, head_dim]
        vd = v_flat[meta.decode_kv_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[meta.decode_rows] = o[:, :, 0, :]
    return out.view(num_tokens, heads * head_dim)


def _chunk_causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Bool mask [query_len, context_len]: query i sees context positions <= context_len - query_len + i."""
    offset = context_len - query_len
    q_pos = torch.arange(query_len, device=device)[:, None] + offset
    k_pos = torch.arange(context_len, device=device)[None, :]
    return k_pos <= q_pos
