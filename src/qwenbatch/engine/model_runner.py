"""Owns the KV cache; packs a scheduled step into one flat batch, runs the model and the sampler.

Only this module knows the device: the same scheduler output runs on the CPU (PyTorch attention,
oneDNN linears) or on CUDA (Triton attention, decode steps replayed as CUDA graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from qwenbatch.engine.scheduler import ScheduledSequence, SchedulerOutput
from qwenbatch.layers.attention import (
    AttentionMetadata,
    KernelAttentionMetadata,
    StepLayout,
    TorchAttentionMetadata,
)
from qwenbatch.layers.cpu_kernels import greedy_tokens, mask_to_allowed, sample_tokens, token_logprobs
from qwenbatch.layers.cpu_kernels import kernels as cpu_kernel_module
from qwenbatch.layers.moe import run_experts_eagerly
from qwenbatch.layers.opaque_attention import step_attention
from qwenbatch.layers.prefill_choice import OURS, SDPA
from qwenbatch.layers.sampler import NO_PROMPT_IDS, SamplerKernels, SamplingRow, prompt_logprobs, sample
from qwenbatch.loader.kernels import ModelKernels
from qwenbatch.models.config import ModelConfig
from qwenbatch.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits are held at once (256 x a 152k vocabulary: 156 MB)


@dataclass
class PromptLogprobsChunk:
    """The prompt logprobs of positions [start, start + len(logprobs)) of one sequence: per position, {token id:
    logprob} of the next prompt token and the top ones, and that token's rank."""

    start: int
    logprobs: list[dict[int, float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """One sampled token per generating sequence that sampled this step, in scheduling order, one score per
    scoring sequence that finished its prompt, and the prompt logprobs of this step's chunks, by sequence id."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    non_finite: list[bool]  # the sequence's logits held NaN/inf
    # Per score-only sequence, in scheduling order: P(yes) (rerank) or its embedding (embed: float32 [hidden], CPU).
    pooled: list[float] | list[torch.Tensor] = field(default_factory=list)
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x KV heads x head_dim x element size."""
    return cfg.kv_bytes_per_token * torch.tensor([], dtype=dtype).element_size()


@dataclass
class PackedStep:
    """A scheduled step as one flat batch: its layout (decoding sequences first), per sampling sequence in
    scheduling order the row whose hidden state it samples from, and per scheduled index the row of its first
    token."""

    layout: StepLayout
    sample_rows: list[int]
    first_rows: list[int]


def pack_step(sched: SchedulerOutput, block_size: int) -> PackedStep:
    """Pack ``sched``'s tokens: decodes first, then prefill chunks."""
    layout = StepLayout(block_size)
    first_rows = [0] * len(sched.scheduled)
    prefills = []
    for i, s in enumerate(sched.scheduled):
        seq, start = s.seq, s.seq.num_computed_tokens
        if s.num_new_tokens == 1 and start > 0:
            first_rows[i] = layout.num_tokens
            layout.add_decode(seq.token_ids[start], seq.block_table, start + 1)
        else:
            prefills.append(i)
    for i in prefills:
        s = sched.scheduled[i]
        start = s.seq.num_computed_tokens
        first_rows[i] = layout.num_tokens
        layout.add_prefill(s.seq.token_ids[start : start + s.num_new_tokens], s.seq.block_table, start)
    sample_rows = [first_rows[i] + s.num_new_tokens - 1 for i, s in enumerate(sched.scheduled) if s.samples]
    return PackedStep(layout, sample_rows, first_rows)


class ModelRunner:
    """Runs steps of one model on one device; ``allocate_kv_cache`` must be called before ``execute``."""

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kernels: ModelKernels,
        attention_backend: str = "torch",
        score_weight: torch.Tensor | None = None,
        embeds: bool = False,
    ) -> None:
        """``model`` as ``loader.prepare_kernels`` laid it out (``kernels``); ``score_weight``: the reranker's
        two LM-head rows ("no", "yes") in float32, taken before the layout changed; ``embeds``: score-only
        sequences return their normalized last hidden state instead (an embedding model)."""
        self.score_weight = score_weight
        self.embeds = embeds
        self.linear_kernels = kernels.linear_kernels  # recorded in the log and in bench JSON
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self._graphs = None
        self._sampler_kernels = (
            SamplerKernels(greedy_tokens, sample_tokens, token_logprobs, mask_to_allowed)
            if kernels.cpu_kernels
            else None
        )
        # --compile: one graph per step shape class, symbolic in the token count; weights frozen into it.
        self._compiled = None
        if kernels.compiled:
            run_experts_eagerly(model)
            self._compiled = torch.compile(model, dynamic=True, options={"freezing": True})
        # Which kernels run prefill and decode attention, recorded in the log and in bench JSON.
        self.decode_attention = attention_backend
        if attention_backend == "triton":
            from qwenbatch.layers.triton_backend import TritonAttentionMetadata

            self._build_metadata: Callable[[StepLayout, torch.device], AttentionMetadata] = (
                TritonAttentionMetadata.build
            )
            self.prefill_attention = "triton"
        elif kernels.cpu_kernels:
            own_prefill = kernels.prefill_attention.kernel == OURS
            self._build_metadata = partial(KernelAttentionMetadata.build, own_prefill=own_prefill)
            self.prefill_attention = kernels.prefill_attention.describe()
            self.decode_attention = f"cpu-kernels ({cpu_kernel_module().decode_attention_isa()})"
        else:
            self._build_metadata = TorchAttentionMetadata.build
            self.prefill_attention = SDPA
        logger.info(
            "attention: %s backend, decode %s, prefill %s, on %s; linears: %s",
            attention_backend,
            self.decode_attention,
            self.prefill_attention,
            device,
            self.linear_kernels,
        )

    def _new_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (2, num_blocks, self.block_size, self.cfg.num_key_value_heads, self.cfg.head_dim)
        # Uninitialised on purpose: zero-filling gigabytes costs seconds of page faults at start-up,
        # and every slot is written before it is read (decode padding points at real slots).
        return [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.cfg.num_hidden_layers)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self._new_kv_caches(num_blocks)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            num_blocks * self.block_size * kv_cache_bytes_per_token(self.cfg, self.dtype) / 2**30,
        )

    @torch.inference_mode()
    def sequence_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits [len(token_ids), vocab] at every position of one sequence, run as one prefill in
        scratch KV blocks (the pool and its cached prefixes are not touched): for accuracy checks."""
        blocks = -(-len(token_ids) // self.block_size)
        layout = StepLayout(self.block_size)
        layout.add_prefill(list(token_ids), list(range(blocks)), 0)
        hidden = self._forward(layout, self._new_kv_caches(blocks))
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def profile_step_peak(self, num_tokens: int, num_sample_rows: int) -> int:
        """CUDA: the bytes a worst-case step allocates beyond what is held now: one prefill of ``num_tokens``
        tokens (with a KV cache just big enough for it), then the logits and a top-p sampler's scratch for
        ``num_sample_rows`` rows."""
        blocks = -(-num_tokens // self.block_size)
        caches = self._new_kv_caches(blocks)
        layout = StepLayout(self.block_size)
        layout.add_prefill([0] * num_tokens, list(range(blocks)), 0)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        held = torch.cuda.memory_allocated(self.device)
        hidden = self._forward(layout, caches)
        rows = torch.arange(num_sample_rows, device=self.device) % num_tokens
        worst = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)
        sample(
            self.model.compute_logits(hidden[rows]),
            [SamplingRow(worst, [], NO_PROMPT_IDS, None, ())] * num_sample_rows,
        )
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - held
        del hidden, caches
        torch.cuda.empty_cache()  # start-up only: let the KV pool have what the profile step cached
        return peak

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """CUDA: capture decode steps for the batch-size ladder (see engine/cuda_graphs.py)."""
        from qwenbatch.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes

        self.model.reserve_positions(max_model_len, self.device)
        max_blocks = -(-max_model_len // self.block_size)

        def forward(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            return self.model(ids, positions, self.kv_caches, meta)

        with torch.inference_mode():
            self._graphs = DecodeGraphs(forward, graph_batch_sizes(max_num_seqs), max_blocks, self.device)

    def _forward(self, layout: StepLayout, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        self.model.reserve_positions(max(layout.positions) + 1, self.device)
        if self._graphs is not None and kv_caches is self.kv_caches:
            hidden = self._graphs.run(layout)
            if hidden is not None:
                return hidden
        meta = self._build_metadata(layout, self.device)
        ids = torch.tensor(layout.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(layout.positions, dtype=torch.long, device=self.device)
        if self._compiled is not None:
            with step_attention(meta) as opaque:
                return self._compiled(ids, positions, kv_caches, opaque)
        return self.model(ids, positions, kv_caches, meta)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, rows: list[SamplingRow]) -> ModelRunnerOutput:
        """Run one step; ``rows`` describes, in order, each scheduled sequence that samples."""
        packed = pack_step(sched, self.block_size)
        hidden = self._forward(packed.layout, self.kv_caches)
        sampling = [s.seq for s in sched.scheduled if s.samples]
        generate_rows = [r for r, seq in zip(packed.sample_rows, sampling, strict=True) if not seq.score_only]
        score_rows = [r for r, seq in zip(packed.sample_rows, sampling, strict=True) if seq.score_only]
        out = ModelRunnerOutput([], [], [])
        if generate_rows:
            sampled = sample(self.model.compute_logits(hidden[generate_rows]), rows, self._sampler_kernels)
            out.token_ids, out.logprobs, out.non_finite = sampled.token_ids, sampled.logprobs, sampled.non_finite
        if score_rows:
            out.pooled = self._embeddings(hidden[score_rows]) if self.embeds else self._scores(hidden[score_rows])
        for i, s in enumerate(sched.scheduled):
            if s.seq.prompt_logprobs_from is not None:
                out.prompt_logprobs[s.seq.seq_id] = self._prompt_logprobs(hidden, packed.first_rows[i], s)
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, first_row: int, s: ScheduledSequence) -> PromptLogprobsChunk:
        """The logprobs of the prompt tokens that this chunk's positions predict, from those not computed before
        (a sequence preempted mid-prompt computes its chunks again)."""
        seq, start = s.seq, s.seq.num_computed_tokens
        begin = max(start, seq.prompt_logprobs_from)
        end = min(start + s.num_new_tokens, seq.num_prompt_tokens - 1)  # the last prompt position predicts output
        chunk = PromptLogprobsChunk(begin, [], [])
        k = seq.params.prompt_logprobs
        kernel = self._sampler_kernels.logprobs if self._sampler_kernels else None
        for lo in range(begin, end, PROMPT_LOGPROBS_ROWS):
            hi = min(lo + PROMPT_LOGPROBS_ROWS, end)
            logits = self.model.compute_logits(hidden[first_row + lo - start : first_row + hi - start])
            targets = seq.token_ids[lo + 1 : hi + 1]
            entries, ranks = prompt_logprobs(logits, targets, k, kernel)
            chunk.logprobs += entries
            chunk.ranks += ranks
        return chunk

    def _embeddings(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Each row's final hidden state (after the last norm) L2-normalized in float32, on the CPU: last-token
        pooling. Tensors, not lists: a Python float list of 1,024 values holds 8x the memory of its 4 KB."""
        return list(torch.nn.functional.normalize(hidden.float(), dim=-1).cpu())

    def _scores(self, hidden: torch.Tensor) -> list[float]:
        """P(yes) from a float32 softmax over the logits of "no" and "yes" only (two LM-head rows)."""
        if self.score_weight is None:
            raise ValueError("this engine was not built for scoring (task rerank)")
        logits = hidden.float() @ self.score_weight.T
        return torch.log_softmax(logits, dim=-1)[:, 1].exp().tolist()
