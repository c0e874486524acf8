"""Where a batch-1 decode step's time goes, in one process, on the default model under int8: the whole step
(engine.step), the model's forward, the LM head and sampling, the host around them, the same step's linears called
alone in the order the step runs them (one row each, from memory), and ``torch.sum`` over the same weights. What the
forward spends beyond its linears is the step's non-linear share (norms, rotary, the cache write, attention, the
calls' fixed costs, thread wake-ups); what the linears spend beyond ``torch.sum`` of their weights is the kernels'
own. Both keep weight bytes x steps/s under the read bandwidth. Each round measures everything once, beside a read
bandwidth sample; the parts derived from two timings (the rest of the forward, the host) and each share of the
bandwidth are taken within a round, and the table gives their medians and ranges over the rounds. Never run by CI.

    .venv/bin/python benchmarks/decode_step_split.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.machine import cpu_kind, describe_cpu, read_bandwidth_gbs
from qwenbatch.layers.int8_linear import Int8Linear


class Timed:
    """Wraps a callable, adding each call's wall seconds to ``seconds``."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def step_split(llm: LLM, prompt_len: int, steps: int) -> dict[str, float]:
    """One sequence decoding ``steps`` tokens: ms a step of the whole step, the forward, everything outside it
    (the LM head, sampling, the scheduler and output processing), and the LM head alone (the first step, the
    prompt's, left out)."""
    runner, model = llm.engine.runner, llm.engine.runner.model
    forward, logits = Timed(runner._forward), Timed(model.compute_logits)
    runner._forward, model.compute_logits = forward, logits
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        llm.engine.add_request("split", list(range(1000, 1000 + prompt_len)), params)
        llm.engine.step()  # the prompt
        forward.seconds = logits.seconds = 0.0
        start = time.perf_counter()
        while llm.engine.has_unfinished():
            llm.engine.step()
        wall = time.perf_counter() - start
    finally:
        runner._forward, model.compute_logits = forward.fn, logits.fn
    return {
        "step_ms": wall / steps * 1e3,
        "forward_ms": forward.seconds / steps * 1e3,
        "outside_forward_ms": (wall - forward.seconds) / steps * 1e3,
        "lm_head_ms": logits.seconds / steps * 1e3,
    }


def linears_ms(linears: list[Int8Linear], dtype: torch.dtype, repeats: int) -> float:
    """ms of one pass over ``linears`` (one row of ``dtype`` each, the kernel called as a step calls it), median
    of ``repeats``; the weights, larger than the caches, come from memory."""
    calls = [(torch.randn(1, m.in_features, dtype=dtype), m) for m in linears]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for x, m in calls:
            m.kernel_forward(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def summed_ms(linears: list[Int8Linear], repeats: int) -> float:
    """ms of ``torch.sum`` over the same weights and scales, tensor by tensor (read as float32): the read bandwidth's
    own measure, met with the linears' layout of ~200 separate tensors instead of one of 1 GiB."""
    views = [t.view(torch.float32) for m in linears for t in (m.packed_weight, m.packed_scales)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for v in views:
            v.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    llm = LLM(quantization="int8", max_model_len=args.prompt_len + args.steps + 16)
    model = llm.engine.runner.model
    dtype = next(model.parameters()).dtype  # the activations' dtype, as the step's linears take them
    layer_linears = [m for n, m in model.named_modules() if isinstance(m, Int8Linear) and not n.endswith("lm_head")]
    lm_head = model.lm_head
    weight_bytes = sum(m.packed_weight.nbytes + m.packed_scales.nbytes for m in [*layer_linears, lm_head])
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        row = {"read_gbs": read_bandwidth_gbs()}
        row |= step_split(llm, args.prompt_len, args.steps)
        row["layer_linears_ms"] = linears_ms(layer_linears, dtype, 5)
        row["lm_head_alone_ms"] = linears_ms([lm_head], dtype, 5)
        row["summed_ms"] = summed_ms([*layer_linears, lm_head], 5)
        # Within the round: parts from two timings, and weight bytes at each time against this round's sample.
        row["rest_of_forward_ms"] = row["forward_ms"] - row["layer_linears_ms"]
        row["host_ms"] = row["outside_forward_ms"] - row["lm_head_ms"]
        row["all_linears_ms"] = row["layer_linears_ms"] + row["lm_head_alone_ms"]
        for part in ("step", "all_linears", "summed"):
            row[f"{part}_share"] = weight_bytes / row[f"{part}_ms"] / 1e6 / row["read_gbs"]
        rounds.append(row)
    stats = {
        k: (statistics.median(r[k] for r in rounds), min(r[k] for r in rounds), max(r[k] for r in rounds))
        for k in rounds[0]
    }

    def ms(key: str) -> str:
        med, low, high = stats[key]
        return f"{med:7.2f} ms  ({low:.2f} to {high:.2f})"

    def share(key: str) -> str:
        med, low, high = stats[f"{key}_share"]
        return f"{med:.0%} of its round's read sample ({low:.0%} to {high:.0%})"

    print(describe_cpu(cpu_kind()))
    med_read, low_read, high_read = stats["read_gbs"]
    print(
        f"weights a step: {weight_bytes / 1e9:.3f} GB; read bandwidth median {med_read:.1f} GB/s "
        f"({low_read:.1f} to {high_read:.1f}, {len(rounds)} samples); medians over the rounds, ranges in brackets"
    )
    print(f"step                      {ms('step_ms')}  {1e3 / stats['step_ms'][0]:.1f} tok/s; {share('step')}")
    print(f"  forward                 {ms('forward_ms')}")
    print(f"    its linears alone     {ms('layer_linears_ms')}")
    print(f"    the rest of it        {ms('rest_of_forward_ms')}")
    print(f"  outside the forward     {ms('outside_forward_ms')}")
    print(f"    the LM head           {ms('lm_head_ms')}  (alone: {stats['lm_head_alone_ms'][0]:.2f} ms)")
    print(f"    host and sampling     {ms('host_ms')}")
    print(f"linears alone, all        {ms('all_linears_ms')}  {share('all_linears')}")
    print(f"their weights, torch.sum  {ms('summed_ms')}  {share('summed')}")
    if args.output:
        report = {"cpu": cpu_kind(), "weight_bytes": weight_bytes, "rounds": rounds, "median_min_max": stats}
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
