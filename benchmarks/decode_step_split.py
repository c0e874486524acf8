"""Where a batch-1 decode step's time goes, in one process, on the default model under int8: the whole step
(engine.step), the model's forward, the LM head and sampling, the host around them, the same step's linears called
alone in the order the step runs them (one row each, from memory), and ``torch.sum`` over the same weights. What the
forward spends beyond its linears is the step's non-linear share (norms, rotary, the cache write, attention, the
calls' fixed costs, thread wake-ups); what the linears spend beyond ``torch.sum`` of their weights is the kernels'
own. Both keep weight bytes x steps/s under the read bandwidth. Rounds alternate; the table gives medians. Never run
by CI.

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
    """One sequence decoding ``steps`` tokens: ms a step of the whole step, the forward, and the LM head with
    sampling (the first step, the prompt's, left out)."""
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
        "lm_head_and_sampling_ms": (wall - forward.seconds) / steps * 1e3,
        "lm_head_ms": logits.seconds / steps * 1e3,
    }


def linears_ms(linears: list[Int8Linear], repeats: int) -> float:
    """ms of one pass over ``linears`` (one row each, the kernel called as a step calls it), median of
    ``repeats``; the weights, larger than the caches, come from memory."""
    calls = [(torch.randn(1, m.in_features), m) for m in linears]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for x, m in calls:
            m._kernels.int8_linear(x, m.packed_weight, m.packed_scales, m.bias, m.padded_out, m.bits, m.silu_and_mul)
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
    layer_linears = [m for n, m in model.named_modules() if isinstance(m, Int8Linear) and not n.endswith("lm_head")]
    lm_head = model.lm_head
    weight_bytes = sum(m.packed_weight.nbytes + m.packed_scales.nbytes for m in [*layer_linears, lm_head])
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        row = {"read_gbs": read_bandwidth_gbs()}
        row |= step_split(llm, args.prompt_len, args.steps)
        row["layer_linears_ms"] = linears_ms(layer_linears, 5)
        row["lm_head_alone_ms"] = linears_ms([lm_head], 5)
        row["summed_ms"] = summed_ms([*layer_linears, lm_head], 5)
        rounds.append(row)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    fastest = max(r["read_gbs"] for r in rounds)

    def share(ms: float) -> str:
        """Weight bytes a step over ``ms``, against the median and the fastest read bandwidth sample."""
        gbs = weight_bytes / ms / 1e6
        return (
            f"{gbs:.1f} GB/s: {gbs / med['read_gbs']:.0%} of the median read sample, {gbs / fastest:.0%} of the fastest"
        )

    all_linears = med["layer_linears_ms"] + med["lm_head_alone_ms"]
    print(describe_cpu(cpu_kind()))
    print(
        f"weights a step: {weight_bytes / 1e9:.3f} GB; read bandwidth median {med['read_gbs']:.1f} GB/s, fastest "
        f"{fastest:.1f} ({len(rounds)} samples)"
    )
    print(
        f"step                      {med['step_ms']:7.2f} ms  "
        f"({1e3 / med['step_ms']:.1f} tok/s; {share(med['step_ms'])})"
    )
    print(f"  forward                 {med['forward_ms']:7.2f} ms")
    print(f"    its linears alone     {med['layer_linears_ms']:7.2f} ms")
    print(f"    the rest of it        {med['forward_ms'] - med['layer_linears_ms']:7.2f} ms")
    print(f"  LM head (in the step)   {med['lm_head_ms']:7.2f} ms  (alone {med['lm_head_alone_ms']:.2f})")
    print(f"  host and sampling       {med['lm_head_and_sampling_ms'] - med['lm_head_ms']:7.2f} ms")
    print(f"linears alone, all        {all_linears:7.2f} ms  ({share(all_linears)})")
    print(f"their weights, torch.sum  {med['summed_ms']:7.2f} ms  ({share(med['summed_ms'])})")
    if args.output:
        report = {"cpu": cpu_kind(), "weight_bytes": weight_bytes, "rounds": rounds, "median": med}
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
