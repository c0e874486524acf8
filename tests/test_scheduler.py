"""Scheduler: token budget, decode-first order, chunked prefill, preemption, prefix-aware order, priority;
and a property test that random add/step/abort sequences never leak or double-free a block."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwenbatch.engine.block_manager import BlockManager
from qwenbatch.engine.scheduler import BACKGROUND_MIN_TOKENS, BACKGROUND_PRIORITY, BACKGROUND_STEP_TOKENS, Scheduler
from qwenbatch.engine.sequence import Sequence, SequenceStatus
from qwenbatch.sampling_params import SamplingParams


def make_seq(seq_id: int, n_prompt: int, max_tokens: int = 8, base: int = 0, priority: int = 0) -> Sequence:
    tokens = [base + seq_id * 1000 + i for i in range(n_prompt)]
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, n_prompt, SamplingParams(), max_tokens, priority=priority)


def run_step(sched: Scheduler, next_token: int = 7) -> list[tuple[int, int]]:
    """Schedule, pretend the model ran, append a token to each sampling sequence, finish at max_tokens.

    Checks on the way that no preempted sequence has a better priority than one left running.
    """
    out = sched.schedule()
    for victim in out.preempted:
        assert all(s.priority <= victim.priority for s in sched.running), "preempted before a lower priority"
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
    for s in out.scheduled:
        if s.samples:
            s.seq.token_ids.append(next_token)
            if s.seq.num_output_tokens >= s.seq.max_tokens:
                sched.finish(s.seq)
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


def test_budget_chunks_a_long_prompt_and_decodes_go_first():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(make_seq(0, 3))
    assert run_step(sched) == [(0, 3)]
    sched.add(make_seq(1, 25))
    assert run_step(sched) == [(0, 1), (1, 9)]  # decode first, then a 9-token chunk
    assert run_step(sched) == [(0, 1), (1, 9)]
    assert run_step(sched) == [(0, 1), (1, 7)]  # the last chunk samples
    assert sched.running[1].num_output_tokens == 1


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(make_seq(i, 4))
    assert [sid for sid, _ in run_step(sched)] == [0, 1]
    assert len(sched.waiting) == 1


def test_out_of_blocks_preempts_the_newest_and_requeues_it_first():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(0, 4, max_tokens=20), make_seq(1, 4, max_tokens=20)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # each has 4 prompt tokens + 1 output: 2 blocks needed next
    assert [bm.num_free_blocks] == [2]
    for _ in range(4):
        run_step(sched)
    # a and b each hold 2 blocks; the next boundary needs a third for a: b is preempted.
    run_step(sched)
    assert sched.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_output_tokens == 5  # keeps what it generated


def test_waiting_order_prefers_the_longest_cached_prefix():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    first = Sequence(0, "r0", 0, list(range(12)), 12, SamplingParams(), 1)
    sched.add(first)
    run_step(sched)  # finishes after one token, leaving 2 full blocks cached
    other = make_seq(1, 12, max_tokens=1, base=50_000)
    sharing = Sequence(2, "r2", 0, [*range(8), 99, 98, 97, 96], 12, SamplingParams(), 1)
    sched.add(other)
    sched.add(sharing)
    assert [sid for sid, _ in run_step(sched)] == [2]
    assert sharing.num_computed_tokens == 12 and bm.prefix_cache_hits == 8


# -- priority ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_low", [3, 100], ids=["short-queue", "long-queue"])
def test_a_later_better_priority_sequence_is_admitted_first(num_low):
    sched = Scheduler(BlockManager(1024, 4), max_num_seqs=1, max_num_batched_tokens=100)
    for i in range(num_low):
        sched.add(make_seq(i, 4, max_tokens=1, priority=1))
    sched.add(make_seq(num_low, 4, max_tokens=1, priority=0))
    assert [sid for sid, _ in run_step(sched)] == [num_low]
    assert [sid for sid, _ in run_step(sched)] == [0]  # then arrival order among the rest


def test_priority_goes_before_a_cached_prefix_which_orders_within_a_class():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=100)
    sched.add(Sequence(0, "r0", 0, list(range(12)), 12, SamplingParams(), 1, priority=5))
    run_step(sched)  # leaves 2 full blocks cached
    other = make_seq(1, 12, max_tokens=1, base=50_000, priority=5)
    sharing = Sequence(2, "r2", 0, [*range(8), 99, 98, 97, 96], 12, SamplingParams(), 1, priority=5)
    default = make_seq(3, 12, max_tokens=1, base=60_000)
    better = make_seq(4, 12, max_tokens=1, base=70_000, priority=-1)
    for seq in (other, sharing, default, better):
        sched.add(seq)
    # -1 first, then 0, then the class of 5, where the cached prefix goes before arrival order.
    assert [run_step(sched)[0][0] for _ in range(4)] == [4, 3, 2, 1]
    assert bm.prefix_cache_hits == 8


def test_out_of_blocks_preempts_a_lower_priority_sequence_even_when_it_is_older():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    low, high = make_seq(0, 4, max_tokens=20, priority=1), make_seq(1, 7, max_tokens=20, priority=0)
    sched.add(low)
    run_step(sched)
    sched.add(high)
    for _ in range(2):
        run_step(sched)
    assert sched.num_preemptions == 0 and bm.num_free_blocks == 0
    # high now needs a third block: the older low is preempted (newest-first alone would pick high).
    assert [sid for sid, _ in run_step(sched)] == [1]
    assert sched.num_preemptions == 1 and sched.running == [high] and sched.waiting[0] is low
    assert low.num_computed_tokens == 0 and low.block_table == [] and low.num_output_tokens == 3


def test_a_full_batch_makes_room_for_a_better_priority_but_not_for_an_equal_one():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    old, new = make_seq(0, 4, max_tokens=20, priority=1), make_seq(1, 4, max_tokens=20, priority=1)
    sched.add(old)
    sched.add(new)
    run_step(sched)
    sched.add(make_seq(2, 4, max_tokens=20, priority=1))
    assert [sid for sid, _ in run_step(sched)] == [0, 1]  # equal priority: it waits its turn
    sched.add(make_seq(3, 4, max_tokens=20, priority=0))
    # The better one runs at once; the newest of priority 1 makes room and is not readmitted this step.
    assert run_step(sched) == [(3, 4), (0, 1)]
    assert sched.num_preemptions == 1 and new.status is SequenceStatus.WAITING
    assert [s.seq_id for s in sched.waiting] == [1, 2]
    assert new.num_output_tokens == 2 and new.block_table == []


def test_worse_classes_run_in_the_background_of_the_best_one():
    sched = Scheduler(BlockManager(512, 4), max_num_seqs=64, max_num_batched_tokens=1000)
    batch = [make_seq(i, 4, max_tokens=50, priority=1) for i in range(40)]
    for seq in batch:
        sched.add(seq)
    run_step(sched)  # 40 prefills of 4 tokens, the whole budget theirs
    assert len(run_step(sched)) == 40  # alone, every batch sequence decodes each step
    sched.add(make_seq(100, 30, max_tokens=50, priority=0))
    step = run_step(sched)
    assert step[0] == (100, 30)  # the interactive prefill first...
    assert sum(n for sid, n in step[1:]) == 30  # ...and the background gets as many tokens as it used
    step = run_step(sched)
    assert step[0] == (100, 1) and len(step) == 1 + BACKGROUND_MIN_TOKENS  # a decode: the minimum
    sched.finish(sched.running[0])
    assert len(run_step(sched)) == 40  # the interactive request gone, the batch has the whole budget again


def test_background_steps_are_short_even_alone():
    sched = Scheduler(BlockManager(512, 4), max_num_seqs=8, max_num_batched_tokens=1000)
    sched.add(make_seq(0, 600, max_tokens=4, priority=BACKGROUND_PRIORITY))
    assert run_step(sched) == [(0, BACKGROUND_STEP_TOKENS)]  # a long background prompt in short chunks
    sched.add(make_seq(1, 600, max_tokens=4, priority=0))
    assert run_step(sched)[0] == (1, 600)  # interactive work keeps the whole budget


def test_a_better_priority_preempts_for_blocks_until_it_fits():
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    lows = [make_seq(i, 6, max_tokens=20, priority=2) for i in range(3)]
    for seq in lows:
        sched.add(seq)
    run_step(sched)  # each holds 2 blocks, room for its next decode
    assert bm.num_free_blocks == 0
    sched.add(make_seq(3, 12, max_tokens=1, priority=1))  # needs 3 blocks: the two newest lows go
    assert run_step(sched) == [(3, 12), (0, 1)]
    assert sched.num_preemptions == 2 and list(sched.waiting) == lows[1:]
    # The better one has finished; the lows resume by recompute, 1 from its first block still cached.
    assert run_step(sched) == [(0, 1), (1, 3), (2, 7)]


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 2), st.integers(0, 2)),
            st.tuples(st.just("step")),
            st.tuples(st.just("abort"), st.integers(0, 30)),
        ),
        max_size=80,
    ),
    num_blocks=st.integers(12, 40),
    budget=st.integers(8, 64),
    prefix_caching=st.booleans(),
)
def test_random_operations_never_leak_or_double_free(ops, num_blocks, budget, prefix_caching):
    bm = BlockManager(num_blocks, 4, prefix_caching)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=budget)
    seqs: list[Sequence] = []

    def check() -> None:
        held = [b for s in sched.running for b in s.block_table]
        refs = {}
        for b in held:
            refs[b] = refs.get(b, 0) + 1
        for block in bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
        assert all(not s.block_table for s in sched.waiting)
        assert [s.priority for s in sched.running] == sorted(s.priority for s in sched.running)

    for op in ops:
        if op[0] == "add":
            _, n_prompt, max_tokens, family, priority = op
            if n_prompt + max_tokens > num_blocks * 4:
                continue  # the engine rejects a request that cannot fit even alone (make_request: max_model_len)
            # Prompts of a family share a prefix, so prefix hits happen.
            tokens = [family * 100 + i for i in range(n_prompt)]
            seq = Sequence(
                len(seqs), f"r{len(seqs)}", 0, tokens, n_prompt, SamplingParams(), max_tokens, priority=priority
            )
            seqs.append(seq)
            sched.add(seq)
        elif op[0] == "step":
            run_step(sched)
        elif op[1] < len(seqs) and not seqs[op[1]].is_finished:
            sched.finish(seqs[op[1]])
        check()
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        run_step(sched)
        check()
    assert not sched.has_unfinished()
    assert all(s.is_finished for s in seqs)
    assert bm.num_free_blocks == num_blocks
