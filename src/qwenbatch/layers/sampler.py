"""Batched sampling: penalties, min_tokens, greedy, temperature, top-k/top-p/min-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qwenbatch.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs about one sampling sequence this step."""

    params: SamplingParams
    output_token_ids: list[int]  # generated so far, where penalties read them (else empty)
    prompt_token_ids: list[int]  # where the repetition penalty reads them (else empty)
    generator: torch.Generator | None  # per-request RNG when the request has a seed
    suppressed_token_ids: tuple[int, ...]  # eos/stop ids banned until min_tokens is reached


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} for the sampled token and the top-k, or None if not asked.
    logprobs: list[dict[int, float] | None]
    # Per row: True when the raw logits held NaN or inf (the request must fail).
    non_finite: list[bool]


# Each row's argmax and whether it holds an inf or a NaN, from logits as the model returns them, in one pass.
GreedyKernel = Callable[[torch.Tensor], tuple[list[int], list[bool]]]


def sample(logits: torch.Tensor, rows: list[SamplingRow], greedy_kernel: GreedyKernel | None = None) -> SamplerOutput:
    """Pick one token per row of ``logits`` [B, vocab]; work is skipped when no row needs it.

    With ``greedy_kernel``, a step whose rows are all plain greedy (no logprobs, penalties or suppressed tokens)
    takes its tokens from it, with the same tokens and flags as the float32 path below.
    """
    if greedy_kernel is not None and all(_plain_greedy(r) for r in rows):
        token_ids, non_finite = greedy_kernel(logits)
        return SamplerOutput(token_ids, [None] * len(rows), non_finite)
    logits = logits.float()
    # One vectorised pass: a NaN or an inf anywhere makes the row's sum non-finite; finite logits would have
    # to average over 1e33 to overflow it. 34x faster than isfinite().all() on 64 x 151,936 logits
    # (0.84 vs 28.5 ms, AVX-512 BF16 kind): 7% of a 64-sequence decode step.
    non_finite = (~torch.isfinite(logits.sum(dim=-1))).tolist()
    logprobs = _top_logprobs_raw(logits, rows)

    needs_edit = [i for i, r in enumerate(rows) if r.params.has_penalties or r.suppressed_token_ids]
    if needs_edit:
        logits = logits.clone()
        for i in needs_edit:
            _apply_penalties(logits[i], rows[i])
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        tokens[random_rows] = _sample_random(logits[random_rows], [rows[i] for i in random_rows])
    token_list = tokens.tolist()
    out_logprobs: list[dict[int, float] | None] = [None] * len(rows)
    if logprobs is not None:
        lp, top_vals, top_ids = logprobs
        for i, r in enumerate(rows):
            if r.params.logprobs is None:
                continue
            k = r.params.logprobs
            entry = dict(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist(), strict=True))
            entry[token_list[i]] = float(lp[i, token_list[i]])
            out_logprobs[i] = entry
    return SamplerOutput(token_list, out_logprobs, non_finite)


def _plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return p.greedy and p.logprobs is None and not p.has_penalties and not row.suppressed_token_ids


def _top_logprobs_raw(logits: torch.Tensor, rows: list[SamplingRow]):
    """Log-probabilities of the model's raw distribution, as vLLM returns them."""
    k = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
    if k is None:
        return None
    lp = torch.log_softmax(logits, dim=-1)
    top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
    return lp, top_vals, top_ids


def _apply_penalties(row_logits: torch.Tensor, row: SamplingRow) -> None:
    p = row.params
    vocab = row_logits.shape[0]
    if row.suppressed_token_ids:
        row_logits[list(row.suppressed_token_ids)] = float("-inf")
    if not p.has_penalties:
        return
    device = row_logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long, device=device
        )
        if seen.numel():
            vals = row_logits[seen]
            row_logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=device)
        counts = torch.bincount(ids, minlength=vocab).float()
        row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=device)
    logits = logits / temps[:, None]
    if any(r.params.top_k or r.params.top_p < 1.0 for r in rows):
        logits = _top_k_top_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)
    if any(r.params.min_p for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype, device=device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return (probs / _exponential_noise(probs, rows)).argmax(dim=-1)


def _exponential_noise(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """E ~ Exp(1) per entry, for the exponential race (Gumbel-max in another form): argmax(p / E) samples
    from p. A seeded request draws its row from its own (CPU) generator, so its tokens are the same on
    every device; the other rows are drawn in one call on the device, with no per-row host work there."""
    if probs.device.type == "cpu":
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            noise[i].exponential_(generator=r.generator)
        return noise
    noise = torch.empty_like(probs).exponential_()
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if seeded:
        cpu_rows = torch.empty(len(seeded), probs.shape[-1], dtype=probs.dtype)
        for j, i in enumerate(seeded):
            cpu_rows[j].exponential_(generator=rows[i].generator)
        noise[seeded] = cpu_rows.to(probs.device)
    return noise


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    device = logits.device
    top_k = torch.tensor([min(r.params.top_k, vocab) or vocab for r in rows], device=device)
    ranks = torch.arange(vocab, device=device)[None, :]
    mask = ranks >= top_k[:, None]
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=device)
    probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    # Drop a token when the mass before it already reaches top_p (the first token always stays).
    mask |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
