"""pack_step: a scheduled step as one packed batch, decodes first, with each token's exact cache slot
(block_table[p // block_size] * block_size + p % block_size), position, and the rows that sample."""

from __future__ import annotations

from qwenbatch.engine.model_runner import pack_step
from qwenbatch.engine.scheduler import ScheduledSequence, SchedulerOutput
from qwenbatch.engine.sequence import Sequence
from qwenbatch.layers.attention import PrefillChunk
from qwenbatch.sampling_params import SamplingParams

BS = 4


def make_seq(seq_id: int, prompt: list[int], output: list[int], block_table: list[int], computed: int) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, [*prompt, *output], len(prompt), SamplingParams(), 16)
    seq.block_table = block_table
    seq.num_computed_tokens = computed
    return seq


def scheduled(seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
    """As the scheduler marks it: the step samples when it reaches the sequence's last token."""
    return ScheduledSequence(seq, num_new_tokens, samples=seq.num_computed_tokens + num_new_tokens == seq.num_tokens)


def test_a_mixed_step_packs_decodes_first_with_exact_slots_positions_and_sample_rows():
    # A mid-prompt chunk: positions 6-8 of a 10-token prompt, across blocks 3 and 9.
    chunk = make_seq(0, list(range(100, 110)), [], [7, 3, 9], computed=6)
    # A decode: its 7th token (position 6) is new; the 5 prompt tokens and the first output are cached.
    decode_a = make_seq(1, list(range(200, 205)), [205, 206], [1, 8], computed=6)
    # A prompt's last chunk after a 4-token cached prefix: positions 4, 5 in block 6; it samples.
    last_chunk = make_seq(2, list(range(300, 306)), [], [2, 6], computed=4)
    # A decode at position 3, the end of its only block.
    decode_b = make_seq(3, [400, 401, 402], [403], [0], computed=3)
    sched = SchedulerOutput(
        [scheduled(chunk, 3), scheduled(decode_a, 1), scheduled(last_chunk, 2), scheduled(decode_b, 1)]
    )
    assert [s.samples for s in sched.scheduled] == [False, True, True, True]

    step = pack_step(sched, BS)
    layout, sample_rows = step.layout, step.sample_rows

    assert layout.input_ids == [206, 403, 106, 107, 108, 304, 305]
    assert layout.positions == [6, 3, 6, 7, 8, 4, 5]
    assert layout.slot_mapping == [8 * 4 + 2, 0 * 4 + 3, 3 * 4 + 2, 3 * 4 + 3, 9 * 4 + 0, 6 * 4 + 0, 6 * 4 + 1]
    assert layout.decode_tables == [[1, 8], [0]]
    assert layout.decode_lens == [7, 4]
    assert layout.prefills == [PrefillChunk(2, 3, 9, [7, 3, 9]), PrefillChunk(5, 2, 6, [2, 6])]
    # In scheduling order, each sampling sequence's row: decode_a's, last_chunk's last token, decode_b's.
    assert sample_rows == [0, 6, 1]
    # In scheduling order, each sequence's first row (where a prompt chunk's logprobs start).
    assert step.first_rows == [2, 0, 5, 1]


def test_a_prompt_in_two_chunks_samples_only_after_the_last():
    prompt = list(range(50, 59))  # 9 tokens, blocks 5, 1, 4
    seq = make_seq(0, prompt, [], [5, 1, 4], computed=0)
    step = pack_step(SchedulerOutput([scheduled(seq, 5)]), BS)
    layout, sample_rows = step.layout, step.sample_rows
    assert (layout.input_ids, layout.positions) == (prompt[:5], [0, 1, 2, 3, 4])
    assert layout.slot_mapping == [20, 21, 22, 23, 4]
    assert layout.prefills == [PrefillChunk(0, 5, 5, [5, 1, 4])]
    assert sample_rows == []

    seq.num_computed_tokens = 5
    step = pack_step(SchedulerOutput([scheduled(seq, 4)]), BS)
    layout, sample_rows = step.layout, step.sample_rows
    assert (layout.input_ids, layout.positions) == (prompt[5:], [5, 6, 7, 8])
    assert layout.slot_mapping == [5, 6, 7, 16]
    assert layout.prefills == [PrefillChunk(0, 4, 9, [5, 1, 4])]
    assert sample_rows == [3]


def test_a_prompt_cached_up_to_its_last_token_is_packed_as_a_decode_row():
    seq = make_seq(0, list(range(9)), [], [3, 0, 2], computed=8)
    step = pack_step(SchedulerOutput([scheduled(seq, 1)]), BS)
    layout, sample_rows = step.layout, step.sample_rows
    assert (layout.input_ids, layout.positions, layout.slot_mapping) == ([8], [8], [2 * 4 + 0])
    assert (layout.decode_tables, layout.decode_lens, layout.prefills) == ([[3, 0, 2]], [9], [])
    assert sample_rows == [0]


def test_a_one_token_prompt_is_a_prefill_and_samples():
    seq = make_seq(0, [42], [], [6], computed=0)
    step = pack_step(SchedulerOutput([scheduled(seq, 1)]), BS)
    layout, sample_rows = step.layout, step.sample_rows
    assert (layout.input_ids, layout.positions, layout.slot_mapping) == ([42], [0], [24])
    assert layout.num_decodes == 0
    assert layout.prefills == [PrefillChunk(0, 1, 1, [6])]
    assert sample_rows == [0]


def test_a_one_token_mid_prompt_chunk_is_a_decode_row_that_samples_nothing():
    # A budget of one token left mid-prompt: position 5 of 9; a decode row (one query after a prefix) that
    # must not sample, beside a real decode that must.
    chunk = make_seq(0, list(range(10, 19)), [], [4, 7, 1], computed=5)
    decode = make_seq(1, [60, 61], [62], [3], computed=2)
    step = pack_step(SchedulerOutput([scheduled(chunk, 1), scheduled(decode, 1)]), BS)
    layout, sample_rows = step.layout, step.sample_rows
    assert (layout.input_ids, layout.positions, layout.slot_mapping) == ([15, 62], [5, 2], [7 * 4 + 1, 3 * 4 + 2])
    assert (layout.decode_lens, layout.prefills) == ([6, 3], [])
    assert sample_rows == [1]
