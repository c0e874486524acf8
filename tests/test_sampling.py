"""SamplingParams validation, the batched sampler on hand-made logits, and sampling through the engine."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter

import pytest
import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.engine.memory import BLOCK_BOOKKEEPING_BYTES_PER_TOKEN
from qwenbatch.engine.model_runner import kv_cache_bytes_per_token
from qwenbatch.engine.sequence import Sequence
from qwenbatch.layers import sampler
from qwenbatch.layers.cpu_kernels import greedy_tokens, sample_tokens, token_logprobs
from qwenbatch.layers.sampler import SamplerKernels, SamplingRow, sample
from qwenbatch.models.config import ModelConfig

VOCAB = 50


def row(
    params: SamplingParams,
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    generator: torch.Generator | None = None,
    suppressed: tuple[int, ...] = (),
) -> SamplingRow:
    return SamplingRow(
        params, output or [], torch.tensor(sorted(set(prompt or [])), dtype=torch.long), generator, suppressed
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=gen(seed)) * scale


# The sampler's PyTorch path, and the CPU's kernels that take over all of it.
PATHS = {"torch": None, "cpu-kernels": SamplerKernels(greedy_tokens, sample_tokens, token_logprobs)}
paths = pytest.mark.parametrize("kernels", PATHS.values(), ids=PATHS.keys())


def draws(
    logits: torch.Tensor, params: SamplingParams, count: int, seed: int = 0, kernels: SamplerKernels | None = None
) -> Counter:
    """Token frequencies of ``count`` samples from one logits row, one seeded generator for all."""
    g = gen(seed)
    out = sample(logits.expand(count, -1), [row(params, generator=g) for _ in range(count)], kernels)
    return Counter(out.token_ids)


# -- SamplingParams validation --------------------------------------------------------------------

INVALID = [
    ("n", {"n": 0}),
    ("n", {"n": 1.5}),
    ("temperature", {"temperature": -0.5}),
    ("temperature", {"temperature": math.nan}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.1}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.5}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -3.0}),
    ("frequency_penalty", {"frequency_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("repetition_penalty", {"repetition_penalty": math.nan}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 2.0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 10, "max_tokens": 5}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 21}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": [3]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": ["2"]}),
    # One caller's thousands of stop strings or ids would slow every request sharing its steps.
    ("stop", {"stop": [f"s{i}" for i in range(17)]}),
    ("stop", {"stop": ["x" * 1025]}),
    ("stop_token_ids", {"stop_token_ids": list(range(257))}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("repetition_penalty", {"repetition_penalty": 1e999}),
]


@pytest.mark.parametrize(("name", "kwargs"), INVALID, ids=[f"{n}={v}" for n, kw in INVALID for v in [kw[n]]])
def test_invalid_value_raises_naming_the_parameter(name, kwargs):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        SamplingParams(**kwargs)


def test_the_bounds_themselves_are_accepted_and_a_tiny_temperature_is_greedy():
    p = SamplingParams(stop=[f"s{i}" for i in range(16)], stop_token_ids=list(range(256)), repetition_penalty=100)
    assert len(p.stop) == 16 and len(p.stop_token_ids) == 256
    tiny = SamplingParams(temperature=1e-300)  # 0 in float32: dividing by it would give inf logits
    assert tiny.temperature == 0.0 and tiny.greedy
    assert SamplingParams(temperature=1e-4).temperature == 1e-4


def test_valid_values_are_accepted_and_normalised():
    p = SamplingParams(
        n=4,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1.3,
        max_tokens=None,
        min_tokens=3,
        logprobs=20,
        stop="END",
        stop_token_ids=(7, 9),
        seed=0,
    )
    assert p.greedy
    assert p.top_k == 0  # -1 disables top-k, as in vLLM
    assert p.stop == ["END"]
    assert p.stop_token_ids == [7, 9]
    assert p.has_penalties
    assert not SamplingParams().has_penalties


def test_none_stop_lists_are_accepted_as_in_vllm():
    # vLLM's own defaults are stop=None and stop_token_ids=None; drop-in code passes them through.
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert p.stop == []
    assert p.stop_token_ids == []


# -- the sampler on hand-made logits --------------------------------------------------------------


def test_greedy_picks_the_argmax_of_every_row():
    logits = random_logits(8)
    out = sample(logits, [row(SamplingParams(temperature=0)) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.non_finite == [False] * 8
    assert out.logprobs == [None] * 8


@paths
@pytest.mark.parametrize("temperature", [0.1, 1.0, 10.0, 1000.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature, kernels):
    logits = random_logits(16, seed=1, scale=0.5)
    rows = [row(SamplingParams(temperature=temperature, top_k=1), generator=gen(i)) for i in range(16)]
    assert sample(logits, rows, kernels).token_ids == logits.argmax(dim=-1).tolist()


@paths
def test_top_k_samples_only_the_k_best(kernels):
    logits = random_logits(1, seed=2, scale=0.3)[0]
    best3 = set(logits.topk(3).indices.tolist())
    seen = draws(logits, SamplingParams(temperature=1.0, top_k=3), 600, kernels=kernels)
    assert set(seen) == best3


@paths
def test_top_k_and_top_p_keep_the_lower_ids_of_tied_logits(kernels):
    logits = torch.tensor([0.0, 2.0, 2.0, 2.0, 2.0, 1.0]).bfloat16()  # bf16 logits tie often
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=2), 400, kernels=kernels)) == {1, 2}
    # Each of the four tied tokens holds ~0.23 of the mass: top_p 0.5 keeps three, the lowest ids.
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.5), 600, kernels=kernels)) == {1, 2, 3}


@paths
def test_tiny_top_p_keeps_only_the_best_token(kernels):
    logits = random_logits(1, seed=3, scale=0.3)[0]  # nearly flat: without top_p many tokens appear
    seen = draws(logits, SamplingParams(temperature=1.0, top_p=1e-6), 300, kernels=kernels)
    assert set(seen) == {int(logits.argmax())}
    assert len(draws(logits, SamplingParams(temperature=1.0), 300, kernels=kernels)) > 10


@paths
def test_top_p_keeps_the_smallest_set_reaching_p(kernels):
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # 0.4 < 0.5, so the second token is needed; 0.4 + 0.3 >= 0.5, so the third is not.
    seen = draws(logits, SamplingParams(temperature=1.0, top_p=0.5), 600, kernels=kernels)
    assert set(seen) == {0, 1}


@paths
def test_min_p_masks_tokens_below_a_fraction_of_the_best(kernels):
    probs = torch.tensor([0.40, 0.30, 0.15, 0.10, 0.03, 0.02])
    logits = torch.log(probs)
    seen = draws(logits, SamplingParams(temperature=1.0, min_p=0.2), 1000, kernels=kernels)
    # Kept: p >= 0.2 * 0.40 = 0.08, i.e. tokens 0..3; tokens 4 and 5 never appear.
    assert set(seen) == {0, 1, 2, 3}


@paths
def test_temperature_sampling_follows_the_softmax(kernels):
    probs = torch.tensor([0.6, 0.3, 0.1])
    seen = draws(torch.log(probs), SamplingParams(temperature=1.0), 4000, seed=5, kernels=kernels)
    for token, p in enumerate(probs.tolist()):
        assert abs(seen[token] / 4000 - p) < 0.03
    # Temperature 0.5 squares the probabilities: [0.36, 0.09, 0.01] / 0.46.
    seen = draws(torch.log(probs), SamplingParams(temperature=0.5), 4000, seed=6, kernels=kernels)
    assert abs(seen[0] / 4000 - 0.36 / 0.46) < 0.03


def test_the_sample_kernel_draws_the_tokens_of_the_torch_path():
    """Same uniform draws (seeded rows), same tokens: over the real vocabulary's size, bf16 logits (many ties) and
    float32, each cut alone and together; and the same non-finite flags. Where a row's mass is spread over ~10^5
    tokens of ~1e-5 each (the flat rows), the two paths' exp and sums, each within ~1e-7, may move a draw to the
    next kept token."""
    settings = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=1.3, top_k=20, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=2.0, top_p=0.95, min_p=0.01),
        SamplingParams(temperature=0.1, top_k=1000, top_p=0.99),
    ]
    for dtype, scale, may_differ in ((torch.bfloat16, 3.0, 0), (torch.float32, 8.0, 0), (torch.bfloat16, 0.5, 2)):
        logits = (torch.randn(2 * len(settings), 151_936, generator=gen(11)) * scale).to(dtype)
        logits[3, 7] = float("nan")
        logits[5, 0] = float("-inf")

        def rows(count: int) -> list[SamplingRow]:
            return [row(settings[i % len(settings)], generator=gen(100 + i)) for i in range(count)]

        want = sample(logits, rows(len(logits)))
        got = sample(logits, rows(len(logits)), PATHS["cpu-kernels"])
        assert got.non_finite == want.non_finite == [i in (3, 5) for i in range(len(logits))]  # -inf too
        finite = [i for i in range(len(logits)) if i not in (3, 5)]
        differ = [i for i in finite if got.token_ids[i] != want.token_ids[i]]
        assert len(differ) <= may_differ, differ
        assert len(set(want.token_ids)) > logits.shape[0] // 2  # the draws really differ between rows


@pytest.mark.parametrize("scale", [3.0, 0.3])
def test_rows_cut_among_their_best_logits_take_the_tokens_of_the_full_sort(scale, monkeypatch):
    """The PyTorch path finds a row's cut among its best logits (torch.topk) instead of sorting the vocabulary where
    its top_k is at most MOST_TOP_K_WITHOUT_SORT (Qwen's generation configs: 20), or where it has top-p alone and its
    TOP_P_PROBE best hold top_p of the mass; it sorts the other rows and leaves uncut rows as they are. Over the real
    vocabulary's size in bf16, where about half the top-k rows hold more logits equal to their smallest kept value
    than they keep (the lower ids must go first), the same uniform draws (seeded rows) give the tokens of the full
    sort and of the CPU kernel."""
    settings = [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=0.1, top_k=1000, top_p=0.99),
        SamplingParams(temperature=1.5, top_k=200, min_p=0.05),
        SamplingParams(temperature=0.2, top_p=0.9),  # top-p alone: found among the best at scale 3, sorted at 0.3
        SamplingParams(temperature=0.05, top_p=0.95),  # found among the best at both scales
        SamplingParams(temperature=1.0, top_p=0.9),  # sorted: the best 64 hold too little
        SamplingParams(temperature=0.1, top_k=5000, top_p=0.9),  # sorted: top_k past MOST_TOP_K_WITHOUT_SORT
        SamplingParams(temperature=0.8),  # no cut, beside rows that cut
    ]
    logits = (torch.randn(3 * len(settings), 151_936, generator=gen(21)) * scale).bfloat16()

    def draw(kernels: SamplerKernels | None) -> list[int]:
        rows = [row(settings[i % len(settings)], generator=gen(300 + i)) for i in range(len(logits))]
        return sample(logits, rows, kernels).token_ids

    sorted_rows = []
    by_sorting = sampler._cut_by_sorting
    monkeypatch.setattr(sampler, "_cut_by_sorting", lambda x, *a: sorted_rows.append(len(x)) or by_sorting(x, *a))
    among_the_best = draw(None)
    assert sorted_rows == [3 * (2 if scale == 3.0 else 3)]  # the rows marked sorted above, in one call
    assert among_the_best == draw(PATHS["cpu-kernels"])
    monkeypatch.setattr(sampler, "MOST_TOP_K_WITHOUT_SORT", 0)  # every row through the full sort
    monkeypatch.setattr(sampler, "TOP_P_PROBE", 0)
    assert among_the_best == draw(None)
    assert len(set(among_the_best)) > len(logits) // 2  # the draws really differ between rows


@pytest.mark.parametrize(("high", "nucleus_size"), [(45, 43), (66, 62), (68, 64), (69, 65), (80, 74)])
def test_top_p_on_the_kernel_cuts_where_the_torch_path_does_within_and_past_the_64_best(high, nucleus_size):
    """The sample kernel looks for top-p's cut among the 64 best tokens first and bisects over all of them only
    where those hold less than top_p of the mass: rows of ``high`` tokens near logit 0 and the rest of 151,936 at
    -11 (~4% of the mass) draw the PyTorch path's tokens, all from the nucleus, and one past 64 tokens is drawn from
    whole."""
    rows, vocab = 300, 151_936
    logits = torch.full((vocab,), -11.0)
    logits[torch.randperm(vocab, generator=gen(high))[:high]] = torch.rand(high, generator=gen(high + 1)) * 0.1
    probs = torch.softmax(logits.double(), dim=-1)
    ranked = probs.argsort(descending=True, stable=True).tolist()
    nucleus = ranked[: int((probs[ranked].cumsum(0) < 0.9).sum()) + 1]
    assert len(nucleus) == nucleus_size
    params = SamplingParams(temperature=1.0, top_p=0.9)

    def draw(kernels: SamplerKernels | None) -> list[int]:
        return sample(logits.expand(rows, -1), [row(params, generator=gen(i)) for i in range(rows)], kernels).token_ids

    got = draw(PATHS["cpu-kernels"])
    assert got == draw(None)
    assert set(got) <= set(nucleus)
    if nucleus_size > 64:
        assert set(got) & set(nucleus[64:])  # drawn from past the 64 best
    else:
        assert len(set(got)) > nucleus_size // 2


@pytest.mark.parametrize(("top_p", "nucleus_size"), [(0.885, 62), (0.897, 64), (0.91, 66)])
def test_top_p_on_the_kernel_keeps_the_lower_ids_of_logits_tied_across_the_64th(top_p, nucleus_size):
    """bf16 rows of 60 tokens at logit 1 and 20 tied at 0, scattered over 151,936 (the rest at -11): the cut falls
    among the tied ones, before, at and past the 64th token, and keeps their lower ids, as the PyTorch path does."""
    rows, vocab = 300, 151_936
    ids = torch.randperm(vocab, generator=gen(7))[:80]
    logits = torch.full((vocab,), -11.0)
    logits[ids[:60]] = 1.0
    logits[ids[60:]] = 0.0
    logits = logits.bfloat16()
    probs = torch.softmax(logits.double(), dim=-1)
    ranked = probs.argsort(descending=True, stable=True).tolist()
    nucleus = ranked[: int((probs[ranked].cumsum(0) < top_p).sum()) + 1]
    assert len(nucleus) == nucleus_size
    params = SamplingParams(temperature=1.0, top_p=top_p)

    def draw(kernels: SamplerKernels | None) -> list[int]:
        return sample(logits.expand(rows, -1), [row(params, generator=gen(i)) for i in range(rows)], kernels).token_ids

    got = draw(PATHS["cpu-kernels"])
    assert got == draw(None)
    tied_kept = set(nucleus) - set(ids[:60].tolist())
    assert tied_kept == set(sorted(ids[60:].tolist())[: nucleus_size - 60])  # the lowest ids of the tied
    assert set(got) <= set(nucleus) and set(got) & tied_kept


def test_random_rows_beside_greedy_and_penalised_rows_take_the_torch_path_tokens():
    logits = random_logits(5, seed=12).bfloat16()
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=5, presence_penalty=1.0),  # penalised: on the kernel path too
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0),
    ]

    def rows(penalised: bool):
        picked = params if penalised else [p for p in params if not p.has_penalties]
        return [row(p, output=[1, 2], generator=gen(i)) for i, p in enumerate(picked)]

    for penalised in (False, True):
        batch = logits if penalised else logits[[0, 1, 3, 4]]
        assert (
            sample(batch, rows(penalised), PATHS["cpu-kernels"]).token_ids == sample(batch, rows(penalised)).token_ids
        )


def _seeded_sequence(
    seed: int, steps: int = 20, batch_with_others: bool = False, kernels: SamplerKernels | None = None
) -> list[int]:
    logits = random_logits(1, seed=7, scale=0.5)
    params = SamplingParams(temperature=1.0, seed=seed)
    g = gen(seed)
    tokens = []
    for step in range(steps):
        if batch_with_others:  # unseeded and differently seeded neighbours must not disturb this row
            batch = torch.cat([random_logits(1, seed=100 + step), logits, random_logits(1, seed=200 + step)])
            rows = [
                row(SamplingParams(temperature=0.8)),
                row(params, generator=g),
                row(SamplingParams(temperature=1.0, seed=99), generator=gen(99 + step)),
            ]
            tokens.append(sample(batch, rows, kernels).token_ids[1])
        else:
            tokens.append(sample(logits, [row(params, generator=g)], kernels).token_ids[0])
    return tokens


@paths
def test_seeded_rows_reproduce_with_a_fresh_generator_and_differ_across_seeds(kernels):
    first = _seeded_sequence(1234, kernels=kernels)
    assert _seeded_sequence(1234, kernels=kernels) == first
    assert _seeded_sequence(1234, batch_with_others=True, kernels=kernels) == first
    assert _seeded_sequence(4321, kernels=kernels) != first
    assert len(set(first)) > 1  # it really sampled


@paths
def test_non_finite_rows_are_flagged_and_other_rows_still_sample(kernels):
    logits = random_logits(4, seed=8)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1)),
        row(SamplingParams(temperature=0.7, top_k=5), generator=gen(0)),
        row(SamplingParams(temperature=0)),
    ]
    out = sample(logits, rows, kernels)
    assert out.non_finite == [False, True, True, False]
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[3] == int(logits[3].argmax())


@paths
def test_presence_penalty_lowers_generated_tokens_by_a_constant(kernels):
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0, presence_penalty=1.0)
    assert sample(logits, [row(greedy, output=[0])], kernels).token_ids == [1]
    assert sample(logits, [row(greedy, prompt=[0])], kernels).token_ids == [0]  # prompt tokens are not penalised
    # Presence does not grow with the count: 2.0 - 0.4 > 1.5 however often token 0 appeared.
    mild = SamplingParams(temperature=0, presence_penalty=0.4)
    assert sample(logits, [row(mild, output=[0, 0, 0])], kernels).token_ids == [0]
    # A negative penalty encourages repetition.
    encourage = SamplingParams(temperature=0, presence_penalty=-1.0)
    assert sample(logits, [row(encourage, output=[1])], kernels).token_ids == [1]


@paths
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_leave_the_callers_logits_as_they_were(dtype, kernels):
    logits = random_logits(3, seed=13).to(dtype)
    before = logits.clone()
    params = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5)
    rows = [row(params, output=[1, 1, 2], prompt=[3], suppressed=(4,)) for _ in range(3)]
    sample(logits, rows, kernels)
    assert torch.equal(logits, before)


def test_the_kernels_pick_the_torch_path_tokens_for_penalised_and_suppressed_rows():
    """Penalties and suppressed ids reach the sample kernel as ids, which it counts and penalises itself: over the
    real vocabulary's size, in bf16 and float32, greedy and random rows pick the PyTorch path's tokens. Each row's
    history holds its best tokens, so the penalties move its pick: down past the best (the kernel must find the new
    maximum), or, with a negative penalty, up; its prompt shares ids with its output and its suppressed ids, whose
    logits take every penalty once."""
    settings = [
        SamplingParams(temperature=0, presence_penalty=1.5),
        SamplingParams(temperature=0, repetition_penalty=1.3),
        SamplingParams(temperature=0, frequency_penalty=-2.0),  # lifts the second best (its history's token)
        SamplingParams(temperature=0, frequency_penalty=0.7),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
        SamplingParams(temperature=0.7, presence_penalty=0.5, min_p=0.1),
        SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0),  # suppressed ids only
    ]

    def rows(best: list[list[int]]) -> list[SamplingRow]:
        picked = []
        for i, top in enumerate(best):
            params = settings[i % len(settings)]
            spread = [(i * 7919 + j * 104_729) % 151_936 for j in range(300)]
            output = [top[1]] * 3 if params.frequency_penalty < 0 else [top[0], top[0], top[2]]
            prompt = [top[1], top[0], top[3], *spread[30:]]  # shares ids with the output and the suppressed ids
            picked.append(row(params, output + spread[:40], prompt, gen(300 + i), (top[3],)))
        return picked

    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(2 * len(settings), 151_936, generator=gen(21)) * 3).to(dtype)
        best = logits.float().topk(4, dim=-1).indices.tolist()
        want = sample(logits, rows(best))
        got = sample(logits, rows(best), PATHS["cpu-kernels"])
        assert got.token_ids == want.token_ids
        assert got.non_finite == want.non_finite == [False] * len(logits)
        plain = sample(logits, [row(settings[i % len(settings)], generator=gen(300 + i)) for i in range(len(logits))])
        assert sum(a != b for a, b in zip(plain.token_ids, want.token_ids, strict=True)) >= len(logits) // 2


@paths
def test_a_top_k_past_the_tokens_left_samples_among_those_left(kernels):
    """More ids suppressed than the vocabulary less top_k, with a top-k the kernel finds by its bucket search (more
    than 64): top-k keeps every token that is left (the search ends at the lowest bucket there)."""
    logits = (torch.randn(1, 300, generator=gen(23)) * 3).expand(400, -1)
    suppressed = tuple(range(0, 300, 3)) + tuple(range(1, 300, 3))
    g = gen(5)
    rows = [row(SamplingParams(temperature=1.0, top_k=150), suppressed=suppressed, generator=g) for _ in range(400)]
    picked = set(sample(logits, rows, kernels).token_ids)
    assert picked <= set(range(2, 300, 3)) and len(picked) > 10


COUNTS = (0, 1, 5, 20, 20, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logprobs_kernel_returns_the_torch_path_log_probabilities(dtype):
    logits = (torch.randn(6, 151_936, generator=gen(22)) * 4).to(dtype)

    def rows() -> list[SamplingRow]:
        return [row(SamplingParams(temperature=0.8, logprobs=k), generator=gen(i)) for i, k in enumerate(COUNTS)]

    want, got = sample(logits, rows()), sample(logits, rows(), PATHS["cpu-kernels"])
    assert got.token_ids == want.token_ids
    exact = torch.log_softmax(logits.double(), dim=-1)
    for i, count in enumerate(COUNTS):
        assert got.token_ids[i] in got.logprobs[i]
        assert len(got.logprobs[i]) in (count, count + 1)
        for token, value in got.logprobs[i].items():
            assert value == pytest.approx(exact[i, token].item(), abs=5e-6)  # float32 values near 20 are 2e-6 apart
        # The same top values (the PyTorch path's float32 sums differ by up to ~1e-5); in bf16, tied logits may take
        # other ids of the same value.
        assert sorted(got.logprobs[i].values()) == pytest.approx(sorted(want.logprobs[i].values()), abs=3e-5)
        if dtype == torch.float32:
            assert got.logprobs[i].keys() == want.logprobs[i].keys()


def test_the_logprobs_kernel_ranks_tied_logits_by_id_and_pads_past_the_vocabulary():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [float("-inf"), 2.0, float("-inf"), 1.0, float("-inf")]])
    lse = torch.logsumexp(logits, dim=-1)
    chosen, ranks, values, ids = token_logprobs(logits.bfloat16(), torch.tensor([2, 3]), 7)
    assert ids[0, :4].tolist() == [1, 2, 4, 0] and ids[1, :2].tolist() == [1, 3]
    assert chosen.tolist() == pytest.approx([3.0 - lse[0].item(), 1.0 - lse[1].item()], abs=1e-6)
    assert ranks.tolist() == [1, 2]  # a tie ranks as high as its equals: only larger logits count
    assert values[0, :3].tolist() == pytest.approx([3.0 - lse[0].item()] * 3)
    assert values[:, 5:].tolist() == [[float("-inf")] * 2] * 2  # k past the vocabulary of 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logprobs_kernel_equals_the_pytorch_path(dtype):
    from qwenbatch.layers.sampler import _token_logprobs

    logits = (torch.randn(9, 3000, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    targets = torch.tensor([0, 5, 2999, 17, 1000, 1, 2, 3, 4])
    got, want = token_logprobs(logits, targets, 4), _token_logprobs(logits, targets, 4)
    assert got[0].tolist() == pytest.approx(want[0].tolist(), abs=2e-5)
    assert got[1].tolist() == want[1].tolist()
    assert torch.allclose(got[2], want[2], atol=2e-5)
    if dtype == torch.float32:  # in bf16, tied logits may take other ids of the same value
        assert got[3].tolist() == want[3].tolist()
    assert (got[1] == 1 + (logits.float() > logits.float().gather(-1, targets[:, None])).sum(-1)).all()


@paths
def test_each_row_takes_only_its_own_penalties_and_suppressed_ids(kernels):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0]] * 4)
    rows = [
        row(SamplingParams(temperature=0, presence_penalty=1.0), output=[0]),
        row(SamplingParams(temperature=0), output=[0]),
        row(SamplingParams(temperature=0, repetition_penalty=4.0), prompt=[1, 0]),
        row(SamplingParams(temperature=0), suppressed=(0, 1)),
    ]
    assert sample(logits, rows, kernels).token_ids == [1, 0, 2, 2]


@paths
def test_frequency_penalty_grows_with_the_count(kernels):
    logits = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    p = SamplingParams(temperature=0, frequency_penalty=0.4)
    assert sample(logits, [row(p, output=[0])], kernels).token_ids == [0]  # 2.0 - 0.4 = 1.6 > 1.5
    assert sample(logits, [row(p, output=[0, 0])], kernels).token_ids == [1]  # 2.0 - 0.8 = 1.2 < 1.5


@paths
def test_repetition_penalty_pushes_seen_tokens_down_whatever_their_sign(kernels):
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    positive = torch.tensor([[2.0, 1.5, -5.0]])
    assert sample(positive, [row(p, prompt=[0])], kernels).token_ids == [1]  # 2.0 / 2 = 1.0 < 1.5
    negative = torch.tensor([[-1.0, -1.5, -5.0]])
    assert sample(negative, [row(p, output=[0])], kernels).token_ids == [1]  # -1.0 * 2 = -2.0 < -1.5
    assert sample(negative, [row(SamplingParams(temperature=0), output=[0])], kernels).token_ids == [0]


@paths
def test_suppressed_ids_are_never_picked(kernels):
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])
    assert sample(logits, [row(SamplingParams(temperature=0), suppressed=(1,))], kernels).token_ids == [2]
    assert sample(
        logits, [row(SamplingParams(temperature=0.5, top_k=1), suppressed=(1,), generator=gen(0))], kernels
    ).token_ids == [2]
    g = gen(1)
    rows = [row(SamplingParams(temperature=1.0), suppressed=(1, 2), generator=g) for _ in range(500)]
    picked = set(sample(logits.expand(500, -1), rows, kernels).token_ids)
    assert picked <= {0, 3} and 3 in picked


@paths
def test_logprobs_hold_the_sampled_token_and_the_top_k_of_the_raw_logits(kernels):
    logits = random_logits(3, seed=9)
    raw_lp = torch.log_softmax(logits, dim=-1)
    best = logits[0].argmax().item()
    # Row 0 is penalised away from its argmax, so the sampled token is outside the top 1.
    rows = [
        row(SamplingParams(temperature=0, logprobs=1, presence_penalty=2.0), output=[best] * 3),
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=1.0, logprobs=5), generator=gen(0)),
    ]
    lowered = logits.clone()
    lowered[0, best] -= 2.0
    out = sample(logits, rows, kernels)
    assert out.token_ids[0] == int(lowered[0].argmax()) != best
    assert out.logprobs[1] is None
    for i, k in ((0, 1), (2, 5)):
        entry = out.logprobs[i]
        top = raw_lp[i].topk(k).indices.tolist()
        assert set(entry) == set(top) | {out.token_ids[i]}
        for token, value in entry.items():
            assert value == pytest.approx(raw_lp[i, token].item(), abs=1e-5)
    assert set(out.logprobs[0]) == {best, out.token_ids[0]}


@paths
def test_logprobs_zero_returns_only_the_sampled_token(kernels):
    logits = random_logits(1, seed=10)
    out = sample(logits, [row(SamplingParams(temperature=0, logprobs=0))], kernels)
    token = out.token_ids[0]
    assert out.logprobs == [{token: pytest.approx(torch.log_softmax(logits[0], -1)[token].item(), abs=1e-5)}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_greedy_kernel_picks_the_tokens_and_flags_of_the_float32_path(dtype):
    logits = (torch.randn(7, 151_936, generator=gen(3)) * 4).to(dtype)  # bfloat16 rounding makes many ties
    logits[0, 10] = logits[0, 90_000] = 100  # a tie for the best: the first one wins, as argmax has it
    logits[1, 5], logits[2, 0], logits[3, 9] = float("-inf"), float("inf"), float("nan")
    logits[4, 2], logits[4, 8] = float("inf"), float("-inf")
    logits[5, -1] = 100  # the best is the last id
    rows = [row(SamplingParams(temperature=0))] * 7
    want, got = sample(logits, rows), sample(logits, rows, SamplerKernels(greedy=greedy_tokens))
    assert got.non_finite == want.non_finite == [False, True, True, True, True, False, False]
    finite = [i for i, bad in enumerate(want.non_finite) if not bad]
    assert [got.token_ids[i] for i in finite] == [want.token_ids[i] for i in finite]
    assert got.token_ids[0] == 10 and got.token_ids[5] == 151_935
    assert got.logprobs == [None] * 7


@pytest.mark.parametrize("vocab", [5, 256, 300, 1_000])
def test_the_greedy_kernel_takes_the_first_of_tied_maxima_wherever_they_lie(vocab):
    """The kernel finds the maximum, then searches whole blocks of logits for it: the first index holding it must
    win whether the ties share a block, lie in different blocks, or the only best is in the last, partial block."""
    places = [(0, vocab - 1), (3, 4), (vocab - 1,), (vocab // 2, vocab - 2)]
    logits = torch.randn(len(places), vocab, generator=gen(5)).bfloat16()
    for i, at in enumerate(places):
        logits[i, list(at)] = 50.0
    tokens, non_finite = greedy_tokens(logits)
    assert tokens == [min(at) for at in places] == logits.float().argmax(dim=-1).tolist()
    assert non_finite == [False] * len(places)


def test_the_greedy_kernel_is_used_only_when_every_row_is_plain_greedy():
    calls = []

    def kernel(logits):
        calls.append(logits.shape[0])
        return logits.float().argmax(dim=-1).tolist(), [False] * logits.shape[0]

    logits = random_logits(2, seed=4)
    plain = row(SamplingParams(temperature=0))
    for other in (
        row(SamplingParams(temperature=0, logprobs=2)),
        row(SamplingParams(temperature=0, presence_penalty=1.0), output=[3]),
        row(SamplingParams(temperature=0), suppressed=(int(logits[1].argmax()),)),
        row(SamplingParams(temperature=0.8), generator=gen(1)),
    ):
        assert sample(logits, [plain, other], SamplerKernels(greedy=kernel)).token_ids[0] == int(logits[0].argmax())
    assert calls == []  # a row that needs more than the argmax sends the whole step down the float32 path
    assert sample(logits, [plain, plain], SamplerKernels(greedy=kernel)).token_ids == logits.argmax(dim=-1).tolist()
    assert calls == [2]


# -- through the engine ---------------------------------------------------------------------------

PROMPT = "The quick brown fox"
OTHERS = ["Python is a programming language.", "def add(a, b):", "用一句话介绍Python"]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint), dtype="float32", kv_cache_memory=16 * 2**20)


def completion(llm: LLM, prompt, params: SamplingParams):
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs) == params.n
    return out.outputs[0]


def test_seeded_request_is_reproducible_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    first = completion(llm, PROMPT, params).token_ids
    assert completion(llm, PROMPT, params).token_ids == first
    batch = [*OTHERS[:2], PROMPT, OTHERS[2]]
    mixed = [
        SamplingParams(temperature=0.9, max_tokens=5),
        SamplingParams(temperature=1.0, seed=1, max_tokens=10),
        params,
        SamplingParams(temperature=0, max_tokens=3),
    ]
    outs = llm.generate(batch, mixed, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == first
    other_seed = SamplingParams(temperature=1.0, seed=43, max_tokens=8, ignore_eos=True)
    assert completion(llm, PROMPT, other_seed).token_ids != first


def test_n_returns_n_distinct_completions(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.num_output_tokens == 18


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_gives_length_with_exactly_that_many_tokens(llm, max_tokens):
    c = completion(llm, PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert c.finish_reason == "length"
    assert c.stop_reason is None
    assert len(c.token_ids) == max_tokens


def test_a_sequence_hands_the_penalties_every_output_id_once_as_outputs_grow():
    seq = Sequence(0, "r", 0, [1, 2, 3], 3, SamplingParams(), max_tokens=10)
    assert list(seq.output_ids_so_far()) == []
    seq.token_ids += [7, 8]
    assert list(seq.output_ids_so_far()) == [7, 8]
    seq.token_ids.append(7)
    assert list(seq.output_ids_so_far()) == [7, 8, 7] == seq.output_token_ids
    assert list(seq.output_ids_so_far()) == [7, 8, 7]  # read again: nothing added twice


def test_a_repetition_penalty_gives_the_same_tokens_on_the_kernels_as_on_the_pytorch_path(tiny_checkpoint, llm):
    """Through the engine (each request's distinct prompt ids kept for the penalty), with CPU kernels and without."""
    plain = LLM(model=str(tiny_checkpoint), dtype="float32", kv_cache_memory=16 * 2**20, cpu_kernels="off")
    params = [
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8),
        SamplingParams(temperature=0.8, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5, seed=3),
    ]
    for p in params:
        prompts = [PROMPT, *OTHERS]
        ours = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
        assert ours == [o.outputs[0].token_ids for o in plain.generate(prompts, p, use_tqdm=False)]
    unpenalised = SamplingParams(temperature=0, max_tokens=12)
    assert completion(llm, PROMPT, unpenalised).token_ids != completion(llm, PROMPT, params[0]).token_ids


def test_stop_token_id_ends_the_output_with_stop_reason(llm):
    greedy = completion(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)).token_ids
    # A token whose first appearance is a few steps in, so the stop is seen mid-generation.
    at = next(i for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    stop_id = greedy[at]
    c = completion(llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop_id
    assert c.token_ids == greedy[: at + 1]


def test_min_tokens_holds_off_a_stop_token(llm):
    greedy = completion(llm, PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)).token_ids
    stop_id = greedy[0]
    early = completion(llm, PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]))
    assert early.token_ids == [stop_id] and early.finish_reason == "stop"
    held = completion(llm, PROMPT, SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[stop_id]))
    assert len(held.token_ids) >= 4
    assert stop_id not in held.token_ids[:4]


@pytest.fixture(scope="module")
def eos_checkpoint(tiny_qwen2, tmp_path_factory):
    """A copy of the tiny model whose generation_config lists greedy's first token as a second eos.

    Real Qwen checkpoints list several eos ids there (<|im_end|> and <|endoftext|>).
    """
    probe = LLM(model=str(tiny_qwen2), dtype="float32", kv_cache_memory=16 * 2**20)
    first = completion(probe, PROMPT, SamplingParams(temperature=0, max_tokens=1)).token_ids[0]
    folder = tmp_path_factory.mktemp("tiny-eos") / "model"
    shutil.copytree(tiny_qwen2, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, first]}))
    return folder, first


def test_min_tokens_delays_eos(eos_checkpoint):
    folder, eos = eos_checkpoint
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=16 * 2**20)
    assert eos in llm.tokenizer.eos_token_ids
    early = completion(llm, PROMPT, SamplingParams(temperature=0, max_tokens=10))
    assert early.token_ids == [eos]
    assert early.finish_reason == "stop"
    assert early.stop_reason is None  # eos, not a stop token or string
    held = completion(llm, PROMPT, SamplingParams(temperature=0, max_tokens=10, min_tokens=5))
    assert len(held.token_ids) >= 5
    assert eos not in held.token_ids[:5]
    ignored = completion(llm, PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 10


# -- the NaN guard (float16) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm16(tiny_qwen2):
    # Two KV blocks only, so a later request surely reuses the blocks a failed one left behind.
    per_token = kv_cache_bytes_per_token(ModelConfig.from_folder(tiny_qwen2), torch.float16)
    per_token += BLOCK_BOOKKEEPING_BYTES_PER_TOKEN
    return LLM(model=str(tiny_qwen2), dtype="float16", kv_cache_memory=2 * 16 * per_token, block_size=16)


def test_float16_overflow_fails_the_request_with_a_clear_error(llm16):
    params = SamplingParams(temperature=0, max_tokens=5)
    norm = llm16.engine.runner.model.model.norm.weight
    saved = norm.data.clone()
    try:
        norm.data.fill_(6e4)  # the final hidden states overflow float16 in the LM head
        outs = llm16.generate([PROMPT, OTHERS[0]], params, use_tqdm=False)
    finally:
        norm.data.copy_(saved)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "error"
        assert "float16" in c.error
        assert "bfloat16" in c.error
        assert c.token_ids == []
    engine = llm16.engine
    assert not engine.has_unfinished()
    assert engine.num_unfinished_requests == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    c = completion(llm16, PROMPT, params)
    assert c.finish_reason == "length" and c.error is None and len(c.token_ids) == 5


def test_non_finite_activations_fail_only_the_affected_request(llm16):
    tok = llm16.tokenizer
    poisoned = tok.encode(OTHERS[0])[0]
    assert poisoned not in tok.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=5)
    clean = [PROMPT, OTHERS[2]]
    expected = [completion(llm16, p, params).token_ids for p in clean]
    emb = llm16.engine.runner.model.model.embed_tokens.weight  # untied in Qwen2: the LM head is unchanged
    saved = emb.data[poisoned].clone()
    try:
        emb.data[poisoned] = float("inf")
        outs = llm16.generate([PROMPT, OTHERS[0]], params, use_tqdm=False)
    finally:
        emb.data[poisoned] = saved
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[0].outputs[0].token_ids == expected[0]
    assert outs[1].outputs[0].finish_reason == "error"
    assert "float16" in outs[1].outputs[0].error
    # The failed request's KV blocks hold NaN; requests that reuse them must not see it.
    assert llm16.engine.block_manager.num_blocks == 2
    outs = llm16.generate(clean, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_every_kind_of_non_finite_logit_is_flagged():
    logits = random_logits(5, seed=9) * 50  # large but finite logits stay finite
    logits[1, 3] = float("-inf")
    logits[2, 0], logits[2, 7] = float("inf"), float("-inf")  # they would cancel to NaN in a sum: still flagged
    logits[3, 1] = float("nan")
    out = sample(logits, [row(SamplingParams(temperature=0))] * 5)
    assert out.non_finite == [False, True, True, True, False]
