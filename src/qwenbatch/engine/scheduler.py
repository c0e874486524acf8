"""Token-budget scheduler (vLLM v1 style, one queue, no phases). Pure Python, no torch.

Every sequence has an integer ``priority`` (vLLM's convention: lower is served earlier, default 0).
A step walks the priority classes, best first, filling ``max_num_batched_tokens``. Within a class:

- its running sequences come first, oldest first (one token per decoding sequence, the next chunk
  for a partly prefilled prompt), so decodes are never starved by new prompts of the same class;
- then its waiting sequences, chunked to the budget, while fewer than ``max_num_seqs`` run:
  preempted ones first, then the longest cached prefix while the class's queue is short (SGLang's
  policy: what is cached now may be evicted soon), in arrival order once it is long. When one cannot
  be admitted, nothing behind it is (first come, first served).

When a block cannot be had, the newest sequence of the worst running class is preempted by
recompute: its blocks are freed and it goes back to the front of its class's queue, keeping the
tokens it generated. As running sequences are visited best class first, a sequence never loses its
blocks to one of lower priority. A waiting sequence that finds no free seat or no blocks preempts,
the same way, running sequences of strictly lower priority until it fits (vLLM's priority policy);
never of equal priority, so with one priority everything is first come, first served as before.
After a preemption for blocks nothing more is admitted in that step; after one for a better-priority
sequence, nothing of the victim's priority or lower, so a victim is not readmitted at once.

Worse classes run in the background of the best one: together they get at most as many tokens in a
step as the best class used (and at least BACKGROUND_MIN_TOKENS), so on a compute-bound CPU, where a
step takes time in proportion to its tokens, a batch job cannot make an interactive request's steps
much slower; with no better class present a class has the whole budget, except background work
(priority >= BACKGROUND_PRIORITY), whose steps never exceed BACKGROUND_STEP_TOKENS, so that a request
arriving meanwhile waits for a short step only.

Cost of a step, for R running and W waiting sequences in C priority classes: O(R * C + C log C) to
list the classes (waiting sequences are counted per priority, not scanned) and visit the running
ones; per admission, a scan of the waiting queue up to the class's first sequence (the head when all
share one priority, O(W) at worst), plus the cached-prefix scan of a class of at most
PREFIX_ORDER_MAX_WAITING sequences, as before.
"""

from __future__ import annotations

import bisect
import math
import operator
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


@dataclass
class _Step:
    """The state of one ``Scheduler.schedule`` call."""

    out: SchedulerOutput
    budget: int  # tokens left to schedule
    # Waiting sequences of this priority value or higher are not admitted any more in this step.
    admit_below: float = math.inf

    def schedule(self, seq: Sequence, n: int) -> None:
        self.out.scheduled.append(ScheduledSequence(seq, n, samples=seq.num_computed_tokens + n == seq.num_tokens))
        self.budget -= n


# While sequences of a better class are scheduled, the worse classes together get at most as many
# tokens as the best class used, and at least this many: a step's time on a CPU grows with its rows
# (the default model here: 120 ms for 1 decode row, 160 ms for 4, 290 ms for 17), so a background batch
# job slows an interactive request's decode steps by about a third, and still moves.
BACKGROUND_MIN_TOKENS = 4
# Priority 1 and worse is background work (the Batch API's lines): together at most this many tokens a
# step even alone, so a request that arrives waits for a short step (~2 s here), not a full 2,048-token
# one (~20 s); a GEMM of 256 rows already runs near this CPU's peak rate.
BACKGROUND_PRIORITY = 1
BACKGROUND_STEP_TOKENS = 256

# Above this many waiting sequences of a class, ordering by cached prefix costs more than it saves.
PREFIX_ORDER_MAX_WAITING = 64

_priority = operator.attrgetter("priority")


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # by priority, then oldest first: the last is the next victim
        self._num_waiting: dict[int, int] = {}  # waiting sequences per priority value (no zeros)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._count_waiting(seq, 1)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """This step's batch: each priority class, best first, its running then its waiting sequences."""
        step = _Step(SchedulerOutput(), self.max_num_batched_tokens)
        capped = False
        for rank, priority in enumerate(sorted({seq.priority for seq in self.running} | self._num_waiting.keys())):
            if rank == 1:  # the worse classes run in the background of the best one
                used = self.max_num_batched_tokens - step.budget
                step.budget = min(step.budget, max(BACKGROUND_MIN_TOKENS, used))
            if priority >= BACKGROUND_PRIORITY and not capped:  # background work keeps its steps short
                step.budget, capped = min(step.budget, BACKGROUND_STEP_TOKENS), True
            self._schedule_running(step, priority)
            self._admit_waiting(step, priority)
        return step.out

    def _schedule_running(self, step: _Step, priority: int) -> None:
        """The class's running sequences, oldest first, each its next tokens within the budget.

        Out of blocks, ``running[-1]`` is preempted until they fit: the newest of the worst class,
        never of a better class than this one, and this sequence itself when it is that newest.
        """
        for seq in [s for s in self.running if s.priority == priority]:
            if step.budget <= 0 or seq.status is not SequenceStatus.RUNNING:
                return  # out of budget, or preempted below as the newest of the worst class
            n = min(seq.num_tokens - seq.num_computed_tokens, step.budget)
            while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, step)
                step.admit_below = -math.inf
                if victim is seq:
                    return
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            step.schedule(seq, n)

    def _admit_waiting(self, step: _Step, priority: int) -> None:
        """Admit the class's waiting sequences in ``_next_waiting`` order while budget, seats and blocks last."""
        while step.budget > 0 and priority < step.admit_below and self._num_waiting.get(priority):
            if not self._admit(self._next_waiting(priority), step):
                step.admit_below = -math.inf  # it keeps its place: nothing behind it goes first
                return

    def _next_waiting(self, priority: int) -> Sequence:
        """The class's next sequence: a preempted one first; then the longest cached prefix while
        the class has at most PREFIX_ORDER_MAX_WAITING waiting, arrival order once it has more."""
        members = (seq for seq in self.waiting if seq.priority == priority)
        head = next(members)
        if head.num_output_tokens > 0 or self._num_waiting[priority] > PREFIX_ORDER_MAX_WAITING:
            return head
        best, best_cached = head, self.block_manager.num_cached_tokens(head)
        for seq in members:
            if seq.num_output_tokens > 0:
                return seq
            cached = self.block_manager.num_cached_tokens(seq)
            if cached > best_cached:
                best, best_cached = seq, cached
        return best

    def _admit(self, seq: Sequence, step: _Step) -> bool:
        """Start ``seq`` with its first chunk, preempting lower-priority running sequences for a seat
        or blocks if need be; False, with ``seq`` still waiting and holding no blocks, if it cannot."""
        while len(self.running) >= self.max_num_seqs:
            if not self._preempt_for(seq, step):
                return False
        if not seq.block_table:
            self.block_manager.take_cached_prefix(seq)
        n = min(seq.num_tokens - seq.num_computed_tokens, step.budget)
        while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
            if not self._preempt_for(seq, step):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                return False
        self._remove_waiting(seq)
        self.block_manager.allocate(seq, seq.num_computed_tokens + n)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_priority)
        step.schedule(seq, n)
        return True

    def _preempt_for(self, seq: Sequence, step: _Step) -> bool:
        """Preempt ``running[-1]`` to make room for ``seq`` if its priority is strictly lower; else False.

        The victim's class has not been visited yet in this step, so it holds nothing scheduled.
        """
        victim = self.running[-1] if self.running else None
        if victim is None or victim.priority <= seq.priority:
            return False
        self._preempt(victim, step)
        step.admit_below = min(step.admit_below, victim.priority)
        return True

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._count_waiting(seq, 1)
        step.out.preempted.append(seq)
        self.num_preemptions += 1

    def _remove_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self._count_waiting(seq, -1)

    def _count_waiting(self, seq: Sequence, delta: int) -> None:
        count = self._num_waiting.get(seq.priority, 0) + delta
        if count:
            self._num_waiting[seq.priority] = count
        else:
            del self._num_waiting[seq.priority]

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self._remove_waiting(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
