"""The transformers baseline at its best: static batches sorted by length, left padding, the
best batch size of a sweep. This is the system our users would otherwise run."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qwenbatch.bench.workloads import BenchRequest
from qwenbatch.engine.llm_engine import warm_up_first_token

logger = logging.getLogger(__name__)


@dataclass
class StaticRun:
    batch_size: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int  # tokens the requests asked for
    computed_tokens: int  # tokens the static batches computed, padding included
    latencies: list[float]  # per request, seconds from the start to the end of its batch

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s


def load_hf_model(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


def pad_token_id(model) -> int:
    """The model's pad id, else its (first) eos id: what left padding fills with."""
    if model.config.pad_token_id is not None:
        return model.config.pad_token_id
    eos = model.config.eos_token_id
    return eos[0] if isinstance(eos, list) else (eos or 0)


def warm_up(model, batch_size: int, pad_id: int) -> None:
    """Two tokens for ``batch_size`` prompts of 16, so that a timed run does not pay the first calls' costs."""
    ids = torch.full((batch_size, 16), warm_up_first_token(model.config.vocab_size), dtype=torch.long)
    with torch.inference_mode():
        model.generate(
            input_ids=ids.to(model.device), max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=pad_id
        )


def sampling_kwargs(request: BenchRequest) -> dict:
    """``generate``'s sampling arguments for the request's settings (a workload's requests share them): greedy, or
    temperature and top-p alone (top_k=0: transformers' default of 50 is no setting of ours)."""
    if request.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": request.temperature, "top_p": request.top_p, "top_k": 0}


def run_static(model, requests: list[BenchRequest], batch_size: int, pad_id: int) -> StaticRun:
    """Generate every request's output_len tokens in length-sorted static batches.

    A static batch runs until its longest request is done, so shorter ones ride along as waste;
    the waste is what ``computed_tokens`` counts beside the useful ``output_tokens``.
    """
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_token_ids))
    start = time.perf_counter()
    computed = 0
    latencies = []
    for b in range(0, len(order), batch_size):
        batch = [requests[i] for i in order[b : b + batch_size]]
        width = max(len(r.prompt_token_ids) for r in batch)
        new_tokens = max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids) :] = 1
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                **sampling_kwargs(batch[0]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad_id,
                eos_token_id=None,
            )
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        computed += len(batch) * (width + new_tokens)
        latencies += [time.perf_counter() - start] * len(batch)
    return StaticRun(
        batch_size,
        time.perf_counter() - start,
        sum(len(r.prompt_token_ids) for r in requests),
        sum(r.output_len for r in requests),
        computed,
        latencies,
    )


def best_batch_size(model, requests: list[BenchRequest], sizes: list[int], pad_id: int) -> tuple[int, list[dict]]:
    """Sweep ``sizes`` on one batch each (the first ``size`` requests) and pick the highest output tok/s."""
    sweep = []
    for size in sizes:
        run = run_static(model, requests[:size], size, pad_id)
        sweep.append({"batch_size": size, "output_tps": run.output_tps})
        logger.info("transformers sweep: batch %d -> %.1f output tok/s", size, run.output_tps)
    best = max(sweep, key=lambda r: r["output_tps"])["batch_size"]
    return best, sweep
