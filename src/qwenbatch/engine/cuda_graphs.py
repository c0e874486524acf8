"""Decode steps replayed as CUDA graphs.

A decode step of a small model on a GPU is short enough that launching its few hundred kernels
from Python costs more than running them. So the engine captures the model's forward once per
batch size of a ladder (1, 2, 4, 8, steps of 8 up to 256, then of 16 up to 512, as vLLM's) and replays it: a step of n
sequences runs the graph of the smallest rung >= n, its extra rows padding (no K/V stored: slot
-1; nothing attended: length 0). A graph reads its inputs from fixed addresses, so every step's
inputs are copied into persistent buffers first (``DecodeBuffers``), and the attention metadata
the graph was captured with views those buffers. Steps with prefill chunks, and batches over the
largest rung, run eagerly.

The ladder and the buffer filling are plain torch and run on CPU (tests); capture and replay need CUDA.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from qwenbatch.layers.attention import StepLayout
from qwenbatch.layers.triton_backend import TritonAttentionMetadata, block_table_array

logger = logging.getLogger(__name__)

GRAPH_MAX_BATCH = 512
_LADDER = (1, 2, 4, 8, *range(16, 256, 8), *range(256, GRAPH_MAX_BATCH + 1, 16))


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The rungs captured for an engine running at most ``max_num_seqs`` sequences a step: those below it
    and the first at or above it (capped at GRAPH_MAX_BATCH)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    cap = min(max_num_seqs, GRAPH_MAX_BATCH)
    top = next(size for size in _LADDER if size >= cap)
    return [size for size in _LADDER if size <= top]


def padded_batch_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The rung a step of ``num_seqs`` decodes runs at, or None when it is over the largest (run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeBuffers:
    """The persistent inputs of captured decode steps, for up to ``max_batch`` rows."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)

    def metadata(self, size: int) -> TritonAttentionMetadata:
        """Attention metadata of a ``size``-row decode step that views these buffers."""
        return TritonAttentionMetadata(
            self.slot_mapping[:size], size, self.block_tables[:size], self.seq_lens[:size], None, None, None
        )

    def fill(self, layout: StepLayout, size: int) -> None:
        """Copy a pure-decode ``layout`` into rows [0, size); rows past its sequences become padding.

        Block-table columns past the step's longest table keep stale ids: a row reads only the
        blocks its length covers.
        """
        n = layout.num_decodes
        if layout.prefills or not 0 < n <= size:
            raise ValueError(f"a {size}-row decode graph cannot run a step of {n} decodes and prefill chunks")
        if size > self.input_ids.shape[0]:
            raise ValueError(f"{size} rows exceed the buffers' {self.input_ids.shape[0]}")
        pad = size - n
        width = max(len(t) for t in layout.decode_tables)
        tables = block_table_array(layout.decode_tables + [[]] * pad, width)
        self.input_ids[:size].copy_(torch.tensor(layout.input_ids + [0] * pad))
        self.positions[:size].copy_(torch.tensor(layout.positions + [0] * pad))
        self.slot_mapping[:size].copy_(torch.tensor(layout.slot_mapping + [-1] * pad))
        self.seq_lens[:size].copy_(torch.tensor(layout.decode_lens + [0] * pad, dtype=torch.int32))
        self.block_tables[:size, :width].copy_(torch.from_numpy(tables))


Forward = Callable[[torch.Tensor, torch.Tensor, TritonAttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """One captured forward per rung; ``run`` replays the right one for a pure-decode step."""

    def __init__(self, forward: Forward, sizes: list[int], max_blocks: int, device: torch.device) -> None:
        self.sizes = sizes
        self.buffers = DecodeBuffers(max(sizes), max_blocks, device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        pool = None
        # Largest first: the smaller graphs then fit in the memory pool the largest one reserved.
        for size in reversed(sizes):
            ids, positions = self.buffers.input_ids[:size], self.buffers.positions[:size]
            meta = self.buffers.metadata(size)
            forward(ids, positions, meta)  # warm-up: compiles the Triton kernels for this shape
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = forward(ids, positions, meta)
            pool = graph.pool()
            self._graphs[size] = graph
        logger.info("captured decode CUDA graphs for batch sizes %s", ", ".join(map(str, sizes)))

    def run(self, layout: StepLayout) -> torch.Tensor | None:
        """Hidden states ``[num_decodes, hidden]`` of a pure-decode step, or None when no rung fits it."""
        size = padded_batch_size(layout.num_decodes, self.sizes)
        if size is None or layout.prefills:
            return None
        self.buffers.fill(layout, size)
        self._graphs[size].replay()
        return self._outputs[size][: layout.num_decodes]
