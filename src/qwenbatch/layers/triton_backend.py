"""The Triton attention backend: a step's layout as block tables and lengths, for the kernels of
layers/triton_attention.py (the CUDA path; on CPU tensors under TRITON_INTERPRET=1)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qwenbatch.layers.attention import AttentionMetadata, StepLayout
from qwenbatch.layers.triton_attention import paged_decode_attention, paged_prefill_attention, store_kv


def block_table_array(tables: list[list[int]], width: int) -> np.ndarray:
    """``tables`` as an int32 [len(tables), width] array, each row padded with block 0 (never read)."""
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    """Rows [0, num_decodes) decode through ``decode_*``; the rest are prefill chunks through ``prefill_*``."""

    slot_mapping: torch.Tensor  # [T] int64; a slot < 0 (a CUDA graph's padding row) stores nothing
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [D, W] int32
    decode_seq_lens: torch.Tensor | None  # [D] int32 context lengths; 0 marks a padding row
    prefill_block_tables: torch.Tensor | None  # [P, W] int32
    prefill_query_start_loc: torch.Tensor | None  # [P + 1] int32, rows counted from the first prefill row
    prefill_seq_lens: torch.Tensor | None  # [P] int32 context lengths
    max_query_len: int = 0

    @classmethod
    def build(cls, layout: StepLayout, device: torch.device) -> TritonAttentionMetadata:
        def put(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        slot_mapping = put(np.asarray(layout.slot_mapping, dtype=np.int64))
        decode_tables = decode_lens = None
        if layout.num_decodes:
            width = max(len(t) for t in layout.decode_tables)
            decode_tables = put(block_table_array(layout.decode_tables, width))
            decode_lens = put(np.asarray(layout.decode_lens, dtype=np.int32))
        prefill_tables = query_start = prefill_lens = None
        max_query_len = 0
        if layout.prefills:
            chunks = layout.prefills
            width = max(len(p.block_table) for p in chunks)
            prefill_tables = put(block_table_array([p.block_table for p in chunks], width))
            starts = np.zeros(len(chunks) + 1, dtype=np.int32)
            np.cumsum([p.query_len for p in chunks], out=starts[1:])
            query_start = put(starts)
            prefill_lens = put(np.asarray([p.context_len for p in chunks], dtype=np.int32))
            max_query_len = max(p.query_len for p in chunks)
        return cls(
            slot_mapping,
            layout.num_decodes,
            decode_tables,
            decode_lens,
            prefill_tables,
            query_start,
            prefill_lens,
            max_query_len,
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        store_kv(k, v, kv_cache, self.slot_mapping)
        d = self.num_decodes
        if self.prefill_seq_lens is None:  # a pure decode step (what CUDA graphs capture): no copy
            out = paged_decode_attention(q, kv_cache, self.decode_block_tables, self.decode_seq_lens, scale)
            return out.view(num_tokens, -1)
        out = torch.empty_like(q)
        if d:
            out[:d] = paged_decode_attention(q[:d], kv_cache, self.decode_block_tables, self.decode_seq_lens, scale)
        out[d:] = paged_prefill_attention(
            q[d:],
            kv_cache,
            self.prefill_block_tables,
            self.prefill_query_start_loc,
            self.prefill_seq_lens,
            scale,
            self.max_query_len,
        )
        return out.view(num_tokens, -1)
