"""Owns the KV cache; packs a scheduled step into one flat batch, runs the model and the sampler."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from qwenbatch.engine.scheduler import SchedulerOutput
from qwenbatch.layers.attention import AttentionMetadata, PrefillSpan
from qwenbatch.layers.linear import onednn_available, pack_linears
from qwenbatch.layers.sampler import SamplingRow, sample
from qwenbatch.models.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    """One sampled token per generating sequence that sampled this step, in scheduling order, and one
    score per scoring sequence that finished its prompt."""

    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    non_finite: list[bool]  # the sequence's logits held NaN/inf
    scores: list[float] = field(default_factory=list)  # P(yes), per score-only sequence, in scheduling order


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x KV heads x head_dim x element size."""
    return cfg.kv_bytes_per_token * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        score_token_ids: tuple[int, int] | None = None,
    ) -> None:
        # The reranker's two LM-head rows ("no", "yes"), in float32, taken before packing changes the layout.
        self.score_weight = None
        if score_token_ids is not None:
            self.score_weight = model.lm_head.weight.detach()[list(score_token_ids)].float().clone()
        if onednn_available(dtype, device):
            pack_linears(model)
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # Uninitialised on purpose: zero-filling gigabytes costs seconds of page faults at start-up,
        # and every slot is written before it is read (decode padding points at real slots).
        self.kv_caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB",
            num_blocks,
            block_size,
            num_blocks * block_size,
            num_blocks * block_size * kv_cache_bytes_per_token(cfg, dtype) / 2**30,
        )

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def _prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        prefills: list[PrefillSpan] = []
        decode_rows: list[int] = []
        decode_ctx: list[tuple[list[int], int]] = []
        sample_rows: list[int] = []
        row = 0
        for s in sched.scheduled:
            seq, n = s.seq, s.num_new_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            slots.append(self._slots(seq.block_table, start, end))
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_ctx.append((seq.block_table, end))
            else:
                kv_slots = None if start == 0 else self._slots(seq.block_table, 0, end)
                prefills.append(PrefillSpan(row, n, end, kv_slots))
            row += n
            if s.samples:
                sample_rows.append(row - 1)
        meta = AttentionMetadata(torch.cat(slots), prefills, None, None, None)
        if decode_rows:
            max_len = max(length for _, length in decode_ctx)
            kv = torch.empty(len(decode_rows), max_len, dtype=torch.long)
            mask = torch.zeros(len(decode_rows), 1, 1, max_len, dtype=torch.bool)
            for i, (table, length) in enumerate(decode_ctx):
                kv[i, :length] = self._slots(table, 0, length)
                # Padding repeats the sequence's first slot: masked out, but finite (0 x NaN is NaN).
                kv[i, length:] = table[0] * self.block_size
                mask[i, ..., :length] = True
            meta.decode_rows = torch.tensor(decode_rows)
            meta.decode_kv_slots = kv
            meta.decode_mask = mask
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        return ids, torch.cat(positions).to(self.device), meta, sample_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, rows: list[SamplingRow]) -> ModelRunnerOutput:
        """Run one step; ``rows`` describes, in order, each scheduled sequence that samples."""
        ids, positions, meta, sample_rows = self._prepare(sched)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        sampling = [s.seq for s in sched.scheduled if s.samples]
        generate_rows = [r for r, seq in zip(sample_rows, sampling, strict=True) if not seq.score_only]
        score_rows = [r for r, seq in zip(sample_rows, sampling, strict=True) if seq.score_only]
        out = ModelRunnerOutput([seq.seq_id for seq in sampling if not seq.score_only], [], [], [])
        if generate_rows:
            sampled = sample(self.model.compute_logits(hidden[generate_rows]), rows)
            out.token_ids, out.logprobs, out.non_finite = sampled.token_ids, sampled.logprobs, sampled.non_finite
        if score_rows:
            out.scores = self._scores(hidden[score_rows])
        return out

    def _scores(self, hidden: torch.Tensor) -> list[float]:
        """P(yes) from a float32 softmax over the logits of "no" and "yes" only (two LM-head rows)."""
        if self.score_weight is None:
            raise ValueError("this engine was not built for scoring (task rerank)")
        logits = hidden.float() @ self.score_weight.T
        return torch.log_softmax(logits, dim=-1)[:, 1].exp().tolist()
