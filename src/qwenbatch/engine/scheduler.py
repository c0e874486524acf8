"""Token-budget scheduler (vLLM v1 style, one queue, no phases). Pure Python, no torch.

Each step fills ``max_num_batched_tokens`` with the running sequences' tokens first (one per
decoding sequence, the next chunk for a partly prefilled prompt), then prefill chunks of
waiting sequences, up to ``max_num_seqs`` running. When a block cannot be had, the newest
running sequence is preempted by recompute: its blocks are freed and it goes back to the front
of the queue, keeping the tokens it generated.

Waiting sequences are admitted longest-cached-prefix first while the queue is short (SGLang's
policy: what is cached now may be evicted soon), in arrival order once it is long.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qwenbatch.engine.block_manager import BlockManager
from qwenbatch.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed for this sequence this step, starting at num_computed_tokens
    samples: bool  # True when this step reaches the sequence's last token, so a new one is sampled


@dataclass
class SchedulerOutput:
    """What the model runner computes this step, in batch order."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


# Above this many waiting sequences, ordering by cached prefix costs more than it saves.
PREFIX_ORDER_MAX_WAITING = 64


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        # Running sequences first, oldest first, so decodes are never starved by new prompts.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(self._entry(seq, n))
            scheduled_ids.add(seq.seq_id)
            budget -= n
            i += 1
        # Then new prompts (or preempted ones, which were put at the front), chunked to the budget.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self._next_waiting()
            if not seq.block_table:
                self.block_manager.take_cached_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._entry(seq, n))
            budget -= n
        return out

    def _next_waiting(self) -> Sequence:
        """Preempted sequences first; then the longest cached prefix while the queue is short."""
        head = self.waiting[0]
        if head.num_output_tokens > 0 or len(self.waiting) > PREFIX_ORDER_MAX_WAITING:
            return head
        best, best_cached = head, -1
        for seq in self.waiting:
            if seq.num_output_tokens > 0:
                return seq
            cached = self.block_manager.num_cached_tokens(seq)
            if cached > best_cached:
                best, best_cached = seq, cached
        return best

    @staticmethod
    def _entry(seq: Sequence, n: int) -> ScheduledSequence:
        return ScheduledSequence(seq, n, samples=seq.num_computed_tokens + n == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
