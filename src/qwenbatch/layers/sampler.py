"""Batched sampling: penalties, min_tokens, greedy, temperature, top-k/top-p/min-p, per-request seeds."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from itertools import accumulate, chain

import numpy as np
import torch

from qwenbatch.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs about one sampling sequence this step."""

    params: SamplingParams
    output_token_ids: Sequence[int]  # generated so far (a list, or an int64 array), where penalties read them
    prompt_ids: torch.Tensor  # the prompt's distinct ids, sorted (int64, CPU), where the repetition penalty reads them
    generator: torch.Generator | None  # per-request RNG when the request has a seed
    suppressed_token_ids: tuple[int, ...]  # eos/stop ids banned until min_tokens is reached
    # A structured output's tokens allowed next, asked for only when the sampler needs them (on a GPU, while the
    # step's forward runs): int32 words (CPU), bit t % 32 of word t // 32 set where token t may come; the others'
    # logits are -inf to the sampler and to the logprobs (as vLLM's). None: any token.
    allowed_token_bits: Callable[[], torch.Tensor] | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} for the sampled token and the top-k, or None if not asked.
    logprobs: list[dict[int, float] | None]
    # Per row: True when the raw logits held NaN or inf (the request must fail).
    non_finite: list[bool]


NO_PROMPT_IDS = torch.empty(0, dtype=torch.long)  # a SamplingRow's prompt ids where no penalty reads them

# Each row's argmax and whether it holds an inf or a NaN, from logits as the model returns them, in one pass.
GreedyKernel = Callable[[torch.Tensor], tuple[list[int], list[bool]]]
# A copy of logits [R, vocab] at -inf where int32 bits [R, words] are clear, and each row's non-finite flag.
MaskKernel = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[bool]]]


@dataclass(frozen=True)
class RowSettings:
    """How each of R rows samples, one value a row: temperature (float32; 0 for the argmax), top_k (int64; 0 is off,
    and at most the vocabulary), top_p and min_p (float32), and the uniform draw in [0, 1) (float64)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    uniform: torch.Tensor


@dataclass(frozen=True)
class RowPenalties:
    """What penalties and suppressed ids ask of R rows, as int64 ids on the CPU cut into rows by ``*_starts`` [R + 1]
    (row r's prompt ids are ``prompt_ids[prompt_starts[r]:prompt_starts[r + 1]]``): the logits at the prompt's
    distinct ids and at the output's ids (each as often as generated; rows with penalties only) scaled by the
    repetition penalty (float32 [R]: divided where positive, multiplied where not), those at the output's ids from
    the row's own logit and then lowered by frequency x count + presence (float64 [R]), and those at the suppressed
    ids set to -inf. A prompt is long and its ids are the same every step: they stay ids."""

    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    prompt_starts: torch.Tensor
    prompt_ids: torch.Tensor
    output_starts: torch.Tensor
    output_ids: torch.Tensor
    suppressed_starts: torch.Tensor
    suppressed_ids: torch.Tensor


@dataclass(frozen=True)
class LogitEdits:
    """RowPenalties as the PyTorch path applies them to the logits of R rows on their device, in two steps. First row
    r's logits at its prompt's ids, ``repeated_ids[repeated_starts[r]:repeated_starts[r + 1]]``, are scaled by its
    repetition penalty ``repetition[r]``. Then its logits at its output's and its suppressed ids,
    ``ids[starts[r]:starts[r + 1]]``, take ``values``: float32, computed from the row's own logits with every penalty
    applied. (The CPU kernel computes the same values from RowPenalties itself.)"""

    repetition: torch.Tensor  # float32 [R]
    repeated_starts: torch.Tensor  # int64 [R + 1]
    repeated_ids: torch.Tensor  # int64
    starts: torch.Tensor  # int64 [R + 1]
    ids: torch.Tensor  # int64 [E]
    values: torch.Tensor  # float32 [E]

    @staticmethod
    def rows_of(starts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The row of each of ``ids``, a list cut into rows by ``starts``. (The output's size given: on a GPU,
        repeat_interleave would otherwise wait for the device to learn it.)"""
        counts = starts[1:] - starts[:-1]
        return torch.repeat_interleave(torch.arange(len(counts), device=starts.device), counts, output_size=len(ids))

    def apply(self, logits: torch.Tensor) -> None:
        """Edit float32 ``logits`` [R, vocab] in place, as the kernels do in theirs."""
        rows = self.rows_of(self.repeated_starts, self.repeated_ids)
        seen, factor = logits[rows, self.repeated_ids], self.repetition[rows]
        logits[rows, self.repeated_ids] = torch.where(seen > 0, seen / factor, seen * factor)
        logits[self.rows_of(self.starts, self.ids), self.ids] = self.values


# Each row's token as _sample_random draws it (at temperature 0: its argmax) from logits [R, vocab] in the model's
# dtype or float32 after its penalties, and whether the row itself holds an inf or a NaN.
SampleKernel = Callable[[torch.Tensor, RowSettings, RowPenalties], tuple[torch.Tensor, torch.Tensor]]
# From logits [R, vocab] in the model's dtype or float32, one target token id a row (int64 [R]) and k: each target's
# log-probability (float32 [R]) and rank (int64 [R]: 1 + how many logits are larger), and each row's k largest logits
# as log-probabilities [R, k] with their ids [R, k] (as _token_logprobs).
LogprobsKernel = Callable[
    [torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
]


@dataclass(frozen=True)
class SamplerKernels:
    """Kernels that take over the PyTorch path below on their device, with the same tokens (the CPU's:
    layers/cpu_kernels.py): ``greedy`` for greedy rows without penalties or suppressed ids, ``sample`` for every
    other row (with its penalties and suppressed ids), ``logprobs`` for the rows that ask for
    log-probabilities, ``mask`` for a structured output's disallowed tokens. Without ``sample``, every row but a
    step of plain greedy rows takes the PyTorch path."""

    greedy: GreedyKernel | None = None
    sample: SampleKernel | None = None
    logprobs: LogprobsKernel | None = None
    mask: MaskKernel | None = None


def sample(logits: torch.Tensor, rows: list[SamplingRow], kernels: SamplerKernels | None = None) -> SamplerOutput:
    """Pick one token per row of ``logits`` [B, vocab] (left as they are); work is skipped when no row needs it.

    Log-probabilities are those of the model's raw distribution, before penalties, as vLLM returns them (after a
    structured output's mask). A row's non-finite flag is that of its logits as the model returned them.
    """
    kernels = kernels or SamplerKernels()
    constrained = [i for i, r in enumerate(rows) if r.allowed_token_bits is not None]
    raw_non_finite: list[bool] = []
    if constrained:
        logits, raw_non_finite = _masked_to_allowed(logits, rows, constrained, kernels.mask)
    # OpenAI's logit_bias moves the draw, not the logprobs (vLLM's order too).
    biased = _with_logit_bias(logits, rows) if any(r.params.logit_bias for r in rows) else logits
    if kernels.greedy is not None and all(r.params.greedy and _plain(r) for r in rows):
        token_ids, non_finite = kernels.greedy(biased)
        out = SamplerOutput(token_ids, [None] * len(rows), non_finite)
    else:
        if kernels.sample is not None:
            token_ids, non_finite = _tokens_on_kernels(biased, rows, kernels)
        else:
            token_ids, non_finite = _tokens_on_torch(biased, rows)
        out = SamplerOutput(token_ids, _logprobs(logits, rows, token_ids, kernels.logprobs), non_finite)
    for i, flag in zip(constrained, raw_non_finite, strict=True):
        out.non_finite[i] = flag  # the mask's -inf are not the model's
    return out


def _with_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of ``logits`` with each row's ``logit_bias`` added at its token ids."""
    at = [(i, token, bias) for i, r in enumerate(rows) for token, bias in (r.params.logit_bias or {}).items()]
    row_ids, token_ids, biases = zip(*at, strict=True)
    biased = logits.clone()
    index = (torch.tensor(row_ids, device=logits.device), torch.tensor(token_ids, device=logits.device))
    biased.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)
    return biased


def token_bits(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """``token_ids`` as allowed-token bits (``SamplingRow.allowed_token_bits``' form): int32 [ceil(vocab_size /
    32)], bit t % 32 of word t // 32 set for each t."""
    allowed = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.bool)
    allowed[torch.tensor(list(token_ids), dtype=torch.long)] = True
    return (allowed.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(dim=-1).to(torch.int32)


def _masked_to_allowed(
    logits: torch.Tensor, rows: list[SamplingRow], constrained: list[int], kernel: MaskKernel | None
) -> tuple[torch.Tensor, list[bool]]:
    """A copy of ``logits`` where each of the ``constrained`` rows keeps only the logits of its allowed tokens (the
    others -inf), and those rows' non-finite flags from the logits as they were: on ``kernel`` where given, else
    each byte of a row's bits selects eight addends (0 or -inf) from a table (7.8 ms at 64 rows of 151,936 bf16
    logits on 2 cores, where expanding the bits by shifts and a masked_fill took 43)."""
    device, vocab = logits.device, logits.shape[-1]
    index = torch.tensor(constrained, device=device)
    picked = logits if len(constrained) == len(rows) else logits.index_select(0, index)
    bits = torch.stack([rows[i].allowed_token_bits() for i in constrained]).to(device)
    if kernel is not None:
        allowed, raw_non_finite = kernel(picked, bits)
    else:
        raw_non_finite = (~torch.isfinite(picked.sum(dim=-1, dtype=torch.float32))).tolist()
        addends = _blocked_addends(logits.dtype, device)[bits.view(torch.uint8).long()]
        allowed = picked + addends.view(len(constrained), -1)[:, :vocab]
    if len(constrained) == len(rows):
        return allowed, raw_non_finite
    masked = logits.clone()
    masked[index] = allowed
    return masked, raw_non_finite


@functools.lru_cache(maxsize=8)
def _blocked_addends(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte of allowed-token bits, what its eight tokens' logits gain (0 where the bit is set,
    -inf where not; the bits of a little-endian int32 word, lowest first)."""
    allowed = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
    return torch.where(allowed.bool(), 0.0, float("-inf")).to(dtype=dtype, device=device)


def _plain(row: SamplingRow) -> bool:
    """Whether the row needs no logprobs, penalties or suppressed tokens: its token is all it needs."""
    return row.params.logprobs is None and not _edited(row)


def _edited(row: SamplingRow) -> bool:
    """Whether penalties or suppressed ids change some of the row's logits."""
    return row.params.has_penalties or bool(row.suppressed_token_ids)


def _tokens_on_kernels(
    logits: torch.Tensor, rows: list[SamplingRow], kernels: SamplerKernels
) -> tuple[list[int], list[bool]]:
    """Each row's token and non-finite flag from the logits in their own dtype: greedy rows without edits on
    ``kernels.greedy`` (where given), the others on ``kernels.sample``."""
    on_greedy = [kernels.greedy is not None and r.params.greedy and not _edited(r) for r in rows]
    greedy = [i for i, yes in enumerate(on_greedy) if yes]
    others = [i for i, yes in enumerate(on_greedy) if not yes]
    token_ids, non_finite = [0] * len(rows), [False] * len(rows)
    if greedy:
        ids, flags = kernels.greedy(logits[greedy] if others else logits)
        for j, i in enumerate(greedy):
            token_ids[i], non_finite[i] = ids[j], flags[j]
    if others:
        subset, picked = (logits[others] if greedy else logits), [rows[i] for i in others]
        ids, flags = kernels.sample(subset, _row_settings(picked, subset), _row_penalties(picked, subset.shape[-1]))
        for i, token, flag in zip(others, ids.tolist(), flags.tolist(), strict=True):
            token_ids[i], non_finite[i] = token, flag
    return token_ids, non_finite


def _tokens_on_torch(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[bool]]:
    """Each row's token and non-finite flag, in float32."""
    raw, logits = logits, logits.float()
    # One vectorised pass: a NaN or an inf anywhere makes the row's sum non-finite; finite logits would have
    # to average over 1e33 to overflow it. 34x faster than isfinite().all() on 64 x 151,936 logits
    # (0.84 vs 28.5 ms, AVX-512 BF16 kind): 7% of a 64-sequence decode step.
    non_finite = (~torch.isfinite(logits.sum(dim=-1))).tolist()
    if any(_edited(r) for r in rows):
        # Edited in place: on a copy of the caller's logits only where float() returned them as they were.
        logits = logits.clone() if logits.data_ptr() == raw.data_ptr() else logits
        _logit_edits(logits, _row_penalties(rows, logits.shape[-1])).apply(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(random_rows) < len(rows):
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if random_rows:
        random_logits = logits if len(random_rows) == len(rows) else logits[random_rows]
        tokens[random_rows] = _sample_random(random_logits, [rows[i] for i in random_rows])
    return tokens.tolist(), non_finite


def _logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int], kernel: LogprobsKernel | None
) -> list[dict[int, float] | None]:
    """Per row that asks for them, {token id: log-probability} of its sampled token and its top ``logprobs`` tokens
    in the raw ``logits``; None for the other rows."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[dict[int, float] | None] = [None] * len(rows)
    if not wanted:
        return out
    k = min(max(rows[i].params.logprobs for i in wanted), logits.shape[-1])
    subset = logits if len(wanted) == len(rows) else logits[wanted]
    sampled_ids = torch.tensor([token_ids[i] for i in wanted], device=logits.device)
    sampled, _, values, ids = (kernel or _token_logprobs)(subset, sampled_ids, k)
    for i, lp, top_values, top_ids in zip(wanted, sampled.tolist(), values.tolist(), ids.tolist(), strict=True):
        count = rows[i].params.logprobs
        entry = dict(zip(top_ids[:count], top_values[:count], strict=True))
        entry[token_ids[i]] = lp
        out[i] = entry
    return out


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], k: int, kernel: LogprobsKernel | None = None
) -> tuple[list[dict[int, float]], list[int]]:
    """Per row of ``logits`` [R, vocab] (the model's at R prompt positions): {token id: logprob} of the prompt's next
    token ``targets[r]`` and of the ``k`` likeliest tokens, and that token's rank (1 + how many logits are larger)."""
    chosen, ranks, values, ids = (kernel or _token_logprobs)(logits, torch.tensor(targets, device=logits.device), k)
    entries = []
    for target, target_logprob, top_values, top_ids in zip(
        targets, chosen.tolist(), values.tolist(), ids.tolist(), strict=True
    ):
        entry = dict(zip(top_ids, top_values, strict=True))
        entry[target] = target_logprob
        entries.append(entry)
    return entries, ranks.tolist()


def _token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PyTorch path's LogprobsKernel."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    chosen = x.gather(-1, targets[:, None])
    top, ids = x.topk(k, dim=-1)
    return (chosen[:, 0] - lse), (x > chosen).sum(dim=-1) + 1, top - lse[:, None], ids


def _row_penalties(rows: list[SamplingRow], vocab: int) -> RowPenalties:
    """Each row's penalties and suppressed ids (rows without them: none)."""
    if not any(_edited(r) for r in rows):
        return _no_penalties(len(rows))
    if any(not 0 <= t < vocab for r in rows for t in r.suppressed_token_ids):
        raise ValueError(f"a suppressed token id lies outside the vocabulary of {vocab}")
    params = [r.params for r in rows]
    prompts = [r.prompt_ids if r.params.repetition_penalty != 1.0 else NO_PROMPT_IDS for r in rows]
    outputs = [r.output_token_ids if r.params.has_penalties else () for r in rows]
    suppressed = [r.suppressed_token_ids for r in rows]
    return RowPenalties(
        torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
        torch.tensor([p.presence_penalty for p in params], dtype=torch.float64),
        torch.tensor([p.frequency_penalty for p in params], dtype=torch.float64),
        _starts(prompts),
        torch.cat(prompts),
        _starts(outputs),
        _concatenated(outputs),
        _starts(suppressed),
        torch.tensor(list(chain.from_iterable(suppressed)), dtype=torch.long),
    )


def _concatenated(lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """int64 lists or arrays (the engine's: ``Sequence.output_ids_so_far``) as one int64 tensor, read through the
    buffer protocol where they are arrays."""
    arrays = [np.asarray(ids, dtype=np.int64) for ids in lists]
    return torch.from_numpy(np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64))


def _starts(lists: Sequence[Sequence[int] | torch.Tensor]) -> torch.Tensor:
    """Where each list starts in their concatenation, and where the last ends (int64 [len(lists) + 1])."""
    return torch.tensor([0, *accumulate(len(ids) for ids in lists)], dtype=torch.long)


@functools.lru_cache(maxsize=16)
def _no_penalties(rows: int) -> RowPenalties:
    """RowPenalties of ``rows`` rows without any (shared: nothing writes to them)."""
    starts, none = torch.zeros(rows + 1, dtype=torch.long), NO_PROMPT_IDS
    zeros = torch.zeros(rows, dtype=torch.float64)
    return RowPenalties(torch.ones(rows, dtype=torch.float32), zeros, zeros, starts, none, starts, none, starts, none)


def _logit_edits(logits: torch.Tensor, penalties: RowPenalties) -> LogitEdits:
    """``penalties`` as LogitEdits, computed on the logits' device (on a GPU the sorts of the output's ids took
    ~19 ms a step on the host at 256 rows of 512 tokens): only the ids they name are touched (a pass over the
    vocabulary a row cost ~1 ms at 151,936 logits), the output's and suppressed ones found as tensor keys
    row * vocab + id (in Python sets and lists: 10.5 ms a step at 64 rows of 288 ids)."""
    device, vocab = logits.device, logits.shape[-1]
    pen = RowPenalties(*(getattr(penalties, f.name).to(device) for f in fields(RowPenalties)))
    banned = LogitEdits.rows_of(pen.suppressed_starts, pen.suppressed_ids) * vocab + pen.suppressed_ids
    output = LogitEdits.rows_of(pen.output_starts, pen.output_ids) * vocab + pen.output_ids
    output, counts = output.unique(return_counts=True)
    touched = torch.cat([banned, output]).unique()  # sorted: by row, then by id
    values = logits[touched // vocab, touched % vocab].float()
    values = values.index_fill(0, torch.searchsorted(touched, banned), float("-inf"))
    factor = torch.ones(len(touched), dtype=torch.float32, device=device)
    row = output // vocab
    at_output = torch.searchsorted(touched, output)
    factor[at_output] = pen.repetition[row]
    values = torch.where(values > 0, values / factor, values * factor)
    # frequency * count + presence, in float64 as Python computes it, on the ids the output holds.
    amount = torch.zeros(len(touched), dtype=torch.float64, device=device)
    amount[at_output] = pen.frequency[row] * counts + pen.presence[row]
    values -= amount.float()
    return LogitEdits(
        pen.repetition,
        pen.prompt_starts,
        pen.prompt_ids,
        torch.searchsorted(touched, torch.arange(len(pen.repetition) + 1, device=device) * vocab),
        touched % vocab,
        values,
    )


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's token: the weights exp(logit / temperature), cut by top-k, top-p and min-p, drawn by the inverse of
    their CDF (in vocabulary order) at one uniform number a row."""
    settings = _row_settings(rows, logits)
    device = logits.device
    logits = logits / settings.temperature[:, None]
    if any(r.params.top_k or r.params.top_p < 1.0 for r in rows):
        logits = _top_k_top_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)
    if any(r.params.min_p for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype, device=device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    cdf = probs.double().cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, (settings.uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    # u * total rounded up to the total: the last token that holds weight.
    last_kept = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(dim=-1)
    return torch.minimum(tokens, last_kept)


def _row_settings(rows: list[SamplingRow], logits: torch.Tensor) -> RowSettings:
    """Each row's RowSettings values, and its uniform draw."""
    device = logits.device
    return RowSettings(
        torch.tensor(
            [0.0 if r.params.greedy else r.params.temperature for r in rows], dtype=torch.float32, device=device
        ),
        # top_k may be any int (2**64 passes validation): past the vocabulary it keeps everything.
        torch.tensor([min(r.params.top_k, logits.shape[-1]) for r in rows], dtype=torch.long, device=device),
        torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=device),
        torch.tensor([r.params.min_p for r in rows], dtype=torch.float32, device=device),
        _uniforms(rows, device),
    )


def _uniforms(rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
    """One float64 draw in [0, 1) a row. A seeded request draws from its own (CPU) generator, so its tokens are the
    same on every device and whatever shares its step; the other rows are drawn in one call on the device."""
    uniform = torch.rand(len(rows), dtype=torch.float64, device=device)
    # A greedy row (the kernels take those with edits here too) leaves its generator as it is.
    seeded = [i for i, r in enumerate(rows) if r.generator is not None and not r.params.greedy]
    if seeded:
        drawn = [torch.rand((), dtype=torch.float64, generator=rows[i].generator) for i in seeded]
        uniform[seeded] = torch.stack(drawn).to(device)
    return uniform


# A row whose top-k keeps at most this many tokens finds its cut among its best from torch.topk, without sorting the
# vocabulary (Qwen's generation configs set top_k 20).
MOST_TOP_K_WITHOUT_SORT = 1024
# A row with top-p alone looks for its cut among its this many best first, as the CPU kernel does; only the rows whose
# best hold less than top_p of the mass are sorted.
TOP_P_PROBE = 64


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logits`` with the tokens outside each row's top-k and top-p set to -inf. Tied logits are ranked by id (the
    lower first), as the CPU kernel ranks them: bf16 logits tie often. How many tokens a row keeps is found among
    its best logits where its top_k is at most MOST_TOP_K_WITHOUT_SORT, or where it has none and its TOP_P_PROBE
    best reach top_p; the other rows are sorted."""
    vocab, device = logits.shape[-1], logits.device
    ks = [min(r.params.top_k, vocab) or vocab for r in rows]
    top_k = torch.tensor(ks, device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=device)
    by_top_k = [k <= MOST_TOP_K_WITHOUT_SORT for k in ks]
    by_top_p = [k == vocab > MOST_TOP_K_WITHOUT_SORT and r.params.top_p < 1.0 for k, r in zip(ks, rows, strict=True)]
    best_needed = max([k for k in ks if k <= MOST_TOP_K_WITHOUT_SORT] + [TOP_P_PROBE] * any(by_top_p), default=0)
    found = torch.tensor(by_top_k, device=device)
    kept = torch.full((len(rows),), vocab, device=device)
    best = None
    if best_needed > 0:
        best = logits.topk(min(best_needed, vocab), dim=-1).values
        kept = torch.where(found, _kept_ranks(best, top_k, top_p).sum(dim=-1), kept)
        if any(by_top_p):
            nucleus, reached = _nucleus_among_the_best(logits, best, top_p)
            reached &= torch.tensor(by_top_p, device=device)
            kept = torch.where(reached, nucleus, kept)
            found |= reached
    uncut = (top_k == vocab) & (top_p >= 1.0)  # in a batch with rows that cut: nothing to do
    to_sort = torch.nonzero(~found & ~uncut).squeeze(-1)
    cut = _keep_the_best(logits, best, kept, found) if best is not None else logits.clone()
    if len(to_sort):
        cut[to_sort] = _cut_by_sorting(logits[to_sort], top_k[to_sort], top_p[to_sort])
    return cut


def _kept_ranks(ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which of each row's logits, ranked from the largest, top-k and then top-p keep (bool, as ``ranked``)."""
    cut = torch.arange(ranked.shape[-1], device=ranked.device)[None, :] >= top_k[:, None]
    probs = torch.softmax(ranked.masked_fill(cut, float("-inf")), dim=-1)
    # Drop a token when the mass before it already reaches top_p (the first token always stays).
    cut |= (probs.double().cumsum(dim=-1) - probs.double()) >= top_p[:, None]
    return cut.logical_not_()


def _nucleus_among_the_best(
    logits: torch.Tensor, best: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many tokens each row's top-p keeps over its whole row, counted among its ``best`` logits (ranked from the
    largest), and whether that count holds: False where the best hold less than top_p of the row's mass, so the cut
    lies past them."""
    probs = (best.float() - logits.float().logsumexp(dim=-1, keepdim=True)).exp().double()
    mass = probs.cumsum(dim=-1)
    kept = ((mass - probs) < top_p[:, None]).sum(dim=-1)
    return kept, mass[:, -1] >= top_p


def _keep_the_best(logits: torch.Tensor, best: torch.Tensor, kept: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``logits`` where each of ``rows`` (bool) keeps its ``kept`` largest logits (``best``: each row's largest,
    ranked; at least ``kept`` of them) and the others are -inf; other rows as they are. The values decide: a row keeps
    every logit above its smallest kept value and, of those equal to it, the lowest ids, as many as were kept (so
    which of tied ids ``topk`` returned does not matter)."""
    kept = kept.clamp(max=best.shape[-1])[:, None]  # rows left as they are: any rank
    smallest = best.gather(-1, kept - 1)
    tied_kept = kept - (best > smallest).sum(dim=-1, keepdim=True)
    tied = logits == smallest
    crowded = (tied.sum(dim=-1, keepdim=True) > tied_kept).squeeze(-1) & rows
    if crowded.any():  # more logits equal the smallest kept value than are kept: the lower ids go first
        tied[crowded] &= tied[crowded].cumsum(dim=-1) <= tied_kept[crowded]
    return logits.masked_fill(~((logits > smallest) | tied | ~rows[:, None]), float("-inf"))


def _cut_by_sorting(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The cut of ``_top_k_top_p`` by a stable sort of each row (ties keep the lower ids)."""
    ranked, order = logits.sort(dim=-1, descending=True, stable=True)
    dropped = _kept_ranks(ranked, top_k, top_p).logical_not_()
    return torch.empty_like(logits).scatter_(-1, order, ranked.masked_fill(dropped, float("-inf")))
