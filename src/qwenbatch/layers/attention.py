"""Paged attention over packed variable-length batches: the step's layout and the PyTorch backend.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``. Each
step's tokens arrive packed (no padding in the matmuls), decoding sequences first (one token each),
then prompt chunks. ``StepLayout`` says, in plain Python, where each token's K/V goes and what each
sequence attends to; a backend turns it once per step into its own ``AttentionMetadata`` (index
tensors shared by every layer), whose ``attend`` the model calls in each layer:

- ``TorchAttentionMetadata`` (here): PyTorch's scaled_dot_product_attention, the CPU path;
- ``KernelAttentionMetadata`` (here): our CPU kernels: decodes reading the paged cache in place, bf16 prefill
  chunks in AVX512-BF16 tiles where that was timed faster at load (else as the PyTorch path);
- ``TritonAttentionMetadata`` (layers/triton_backend.py): Triton kernels reading K/V through the
  block tables in place, the CUDA path (and, under TRITON_INTERPRET=1, a CPU test of it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from qwenbatch.layers.cpu_kernels import kernels


@dataclass
class PrefillChunk:
    """One sequence that computes several query tokens this step (a prompt or a prompt chunk)."""

    query_start: int  # first row of this sequence's tokens in the packed batch
    query_len: int  # query tokens this step: the last query_len positions of the context
    context_len: int  # tokens attended to: cached ones plus this step's
    block_table: list[int]  # the sequence's KV blocks, in order


@dataclass
class StepLayout:
    """The packed batch of one step, decodes first: rows [0, len(decode_lens)) decode one token each."""

    block_size: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # flat cache slot receiving each row's K/V
    decode_tables: list[list[int]] = field(default_factory=list)  # per decode row: its block table
    decode_lens: list[int] = field(default_factory=list)  # per decode row: context length, its new token included
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def add_decode(self, token: int, block_table: list[int], context_len: int) -> None:
        pos = context_len - 1
        self.input_ids.append(token)
        self.positions.append(pos)
        self.slot_mapping.append(block_table[pos // self.block_size] * self.block_size + pos % self.block_size)
        self.decode_tables.append(block_table)
        self.decode_lens.append(context_len)

    def add_prefill(self, tokens: list[int], block_table: list[int], start: int) -> None:
        """``tokens`` are the sequence's positions [start, start + len(tokens))."""
        end = start + len(tokens)
        self.prefills.append(PrefillChunk(self.num_tokens, len(tokens), end, block_table))
        self.input_ids.extend(tokens)
        self.positions.extend(range(start, end))
        self.slot_mapping.extend(slots_of(block_table, start, end, self.block_size).tolist())


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Flat cache slots of positions [start, end) of a sequence with ``block_table``."""
    pos = np.arange(start, end)
    return np.asarray(block_table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


class AttentionMetadata(ABC):
    """A step's attention layout in one backend's tensors, built once per step, used by every layer."""

    @abstractmethod
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Write k/v into the cache, attend, and return ``[T, heads * head_dim]``.

        q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim], rows in the step's packed order.
        Causality inside a chunk is bottom-right aligned (its queries are the context's last ones).
        """


@dataclass
class _TorchPrefill:
    rows: slice
    query_len: int
    context_len: int
    # Flat slots of the whole context, or None for a fresh prompt: its K/V are this step's own.
    kv_slots: torch.Tensor | None


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """PyTorch's scaled_dot_product_attention per prefill chunk, and one padded call for all decodes."""

    slot_mapping: torch.Tensor  # [T]
    prefills: list[_TorchPrefill]
    num_decodes: int
    decode_kv_slots: torch.Tensor | None  # [D, L_max] flat slots of each one's context, padded with a real slot
    decode_mask: torch.Tensor | None  # [D, 1, 1, L_max] True where a slot is real context

    @classmethod
    def build(cls, layout: StepLayout, device: torch.device, gather_decodes: bool = True) -> TorchAttentionMetadata:
        bs = layout.block_size
        prefills = [
            _TorchPrefill(
                slice(p.query_start, p.query_start + p.query_len),
                p.query_len,
                p.context_len,
                None
                if p.query_len == p.context_len
                else torch.from_numpy(slots_of(p.block_table, 0, p.context_len, bs)).to(device),
            )
            for p in layout.prefills
        ]
        kv_slots = mask = None
        if layout.num_decodes and gather_decodes:
            max_len = max(layout.decode_lens)
            slots = np.empty((layout.num_decodes, max_len), dtype=np.int64)
            valid = np.zeros((layout.num_decodes, 1, 1, max_len), dtype=bool)
            for i, (table, length) in enumerate(zip(layout.decode_tables, layout.decode_lens, strict=True)):
                slots[i, :length] = slots_of(table, 0, length, bs)
                # Padding repeats the sequence's first slot: masked out, but finite (0 x NaN is NaN).
                slots[i, length:] = table[0] * bs
                valid[i, ..., :length] = True
            kv_slots, mask = torch.from_numpy(slots).to(device), torch.from_numpy(valid).to(device)
        slot_mapping = torch.tensor(layout.slot_mapping, dtype=torch.long, device=device)
        return cls(slot_mapping, prefills, layout.num_decodes, kv_slots, mask)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        num_tokens, heads, head_dim = q.shape
        kv_heads = k.shape[1]
        k_flat = kv_cache[0].view(-1, kv_heads, head_dim)
        v_flat = kv_cache[1].view(-1, kv_heads, head_dim)
        k_flat.index_copy_(0, self.slot_mapping, k)
        v_flat.index_copy_(0, self.slot_mapping, v)

        out = torch.empty_like(q)
        for span in self.prefills:
            self._prefill_span(span, q, k, v, k_flat, v_flat, scale, out)

        if self.num_decodes:
            out[: self.num_decodes] = self._decode(q[: self.num_decodes], k_flat, v_flat, kv_cache, scale)
        return out.view(num_tokens, heads * head_dim)

    def _prefill_span(
        self,
        span: _TorchPrefill,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """One chunk's attention into ``out[span.rows]``: its queries against its whole context, this step's own
        K/V for a fresh prompt, else the context's slots of the cache (k_flat, v_flat), bottom-right causal."""
        rows = span.rows
        if span.kv_slots is None:
            kk, vv = k[rows], v[rows]
        else:
            kk, vv = k_flat[span.kv_slots], v_flat[span.kv_slots]
        out[rows] = sdpa_chunk_attention(q[rows], kk, vv, scale)

    def _decode(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The decoding rows' attention, [D, heads, head_dim]."""
        d, heads, head_dim = q.shape
        kv_heads = k_flat.shape[1]
        # The query heads of one KV head attend together as one KV head's queries (GQA folded):
        # [D, kv_heads, group, head_dim] against [D, kv_heads, L, head_dim], no repeated K/V.
        qd = q.reshape(d, kv_heads, heads // kv_heads, head_dim)
        kd = k_flat[self.decode_kv_slots].transpose(1, 2)  # [D, kv_heads, L, head_dim]
        vd = v_flat[self.decode_kv_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, scale=scale)
        return o.reshape(d, heads, head_dim)


@dataclass
class KernelAttentionMetadata(TorchAttentionMetadata):
    """As TorchAttentionMetadata, but decoding rows read K/V through their block tables in place, in our
    CPU kernel (layers/cpu_kernels.py): no per-step gather of each context into a padded tensor; and, with
    ``own_prefill``, prefill chunks run in our prefill kernel (bf16 or float32, where layers/prefill_choice.py
    timed it faster than SDPA's flash kernel on this CPU)."""

    decode_block_tables: torch.Tensor | None = None  # int32 [D, max_blocks], padded with block 0
    decode_lens: torch.Tensor | None = None  # int32 [D]
    own_prefill: bool = False

    @classmethod
    def build(cls, layout: StepLayout, device: torch.device, own_prefill: bool = False) -> KernelAttentionMetadata:
        base = TorchAttentionMetadata.build(layout, device, gather_decodes=False)
        tables = lens = None
        if layout.num_decodes:
            width = max(len(t) for t in layout.decode_tables)
            padded = np.zeros((layout.num_decodes, width), dtype=np.int32)
            for i, table in enumerate(layout.decode_tables):
                padded[i, : len(table)] = table
            tables = torch.from_numpy(padded)
            lens = torch.tensor(layout.decode_lens, dtype=torch.int32)
        return cls(base.slot_mapping, base.prefills, base.num_decodes, None, None, tables, lens, own_prefill)

    def _prefill_span(
        self,
        span: _TorchPrefill,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        rows = span.rows
        if not self.own_prefill:
            super()._prefill_span(span, q, k, v, k_flat, v_flat, scale, out)
        elif span.kv_slots is None:
            kernels().prefill_attention(q[rows], k[rows], v[rows], scale, out=out[rows])
        else:  # the cached context read in place, no gather
            kernels().prefill_attention(q[rows], k_flat, v_flat, scale, span.kv_slots, out[rows])

    def _decode(
        self, q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return kernels().paged_decode_attention(q, kv_cache, self.decode_block_tables, self.decode_lens, scale)


def sdpa_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Bottom-right causal attention of a chunk's q [Lq, heads, d] on its context k, v [Lk, kv_heads, d] with
    PyTorch's SDPA, on its flash kernel. Returns [Lq, heads, d]."""
    q_len, k_len = q.shape[0], k.shape[0]
    # 4-D with a batch of one: 3-D inputs send SDPA down its math path on the CPU (materialised
    # scores: 19x slower at 2,048 tokens), 4-D ones to its flash kernel.
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_len == k_len:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
    elif q_len >= SPLIT_CHUNK_MIN_QUERIES and q.device.type == "cpu":
        o = _prefix_then_causal(q4, k4, v4, k_len - q_len, scale)
    else:
        mask = _chunk_causal_mask(q_len, k_len, q.device)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


# A chunk of at least this many queries after a cached prefix runs as two flash calls without a mask (the prefix,
# then the chunk's own keys causally), merged by their log-sum-exps: under a bottom-right mask the flash kernel
# computes, then masks, the chunk's upper triangle, which its causal mode skips. Measured (bf16, GQA 14/2,
# 2 cores): 2,048 queries on 4,096 keys 262 -> 190 ms, 1,024 on 2,048 69 -> 54 ms; at 512 on 2,560 the two are
# even, and at 100 on 1,100 the split is slower.
SPLIT_CHUNK_MIN_QUERIES = 1024


def _prefix_then_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Bottom-right causal attention of q [1, heads, L, d] on k, v [1, kv_heads, prefix_len + L, d] (CPU)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_prefix, lse_prefix = flash(q, k[:, :, :prefix_len], v[:, :, :prefix_len], 0.0, False, scale=scale)
    o_own, lse_own = flash(q, k[:, :, prefix_len:], v[:, :, prefix_len:], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse_prefix, lse_own)
    w_prefix, w_own = (lse_prefix - lse).exp().unsqueeze(-1), (lse_own - lse).exp().unsqueeze(-1)
    return (o_prefix.float() * w_prefix + o_own.float() * w_own).to(q.dtype)


def _chunk_causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Bool mask [query_len, context_len]: query i sees context positions <= context_len - query_len + i."""
    offset = context_len - query_len
    q_pos = torch.arange(query_len, device=device)[:, None] + offset
    k_pos = torch.arange(context_len, device=device)[None, :]
    return k_pos <= q_pos
