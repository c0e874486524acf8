"""Decode steps with every layer in one kernel call (FusedDecodeStack, ``decode_layers``) against one call a layer
(each layer's FusedDecodeLayer from Python), in one process, alternating, on the default model: the same kernels,
so the difference is what the per-layer calls cost beyond them (their Python, and the OpenMP worker waking after each
gap between two kernel calls; run it with OMP_WAIT_POLICY=ACTIVE to leave the second out). Each round runs both
sides once (the first side alternating by round), each side decoding one sequence of ``--steps`` tokens, and the
table gives the median ms a step of each side and the median of the rounds' ratios. Never run by CI.

    .venv/bin/python benchmarks/decode_stack_ab.py --rounds 9 --steps 64 --quantization int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.machine import cpu_kind, describe_cpu


def ms_a_step(llm: LLM, steps: int) -> float:
    """One sequence of a 32-token prompt decoding ``steps`` tokens: ms a decode step (the prompt's step left out)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    llm.engine.add_request("ab", list(range(1000, 1032)), params)
    llm.engine.step()  # the prompt
    start = time.perf_counter()
    while llm.engine.has_unfinished():
        llm.engine.step()
    return (time.perf_counter() - start) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/decode-stack-ab.json"))
    args = parser.parse_args()
    llm = LLM(model="default", dtype=args.dtype, quantization=args.quantization)
    decoder = llm.engine.runner.model.model
    stack = decoder.fused_decode
    if stack is None:
        raise SystemExit("this model's layers are not all fused: nothing to compare")
    ms_a_step(llm, 8)  # warm-up
    sides: dict[str, list[float]] = {"stack": [], "per_layer": []}
    for i in range(args.rounds):
        order = ["stack", "per_layer"] if i % 2 == 0 else ["per_layer", "stack"]
        for side in order:
            decoder.fused_decode = stack if side == "stack" else None
            sides[side].append(ms_a_step(llm, args.steps))
        print(f"round {i}: stack {sides['stack'][-1]:.2f} ms, per layer {sides['per_layer'][-1]:.2f} ms", flush=True)
    decoder.fused_decode = stack
    ratios = [p / s for s, p in zip(sides["stack"], sides["per_layer"], strict=True)]
    kind = cpu_kind()
    print(describe_cpu(kind))
    report = {
        "cpu": kind,
        "args": {k: str(v) for k, v in vars(args).items()},
        "layers": len(decoder.layers),
        "ms_a_step": {side: statistics.median(times) for side, times in sides.items()},
        "runs_ms_a_step": sides,
        "per_layer_over_stack": statistics.median(ratios),
        "runs_per_layer_over_stack": ratios,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    saved = report["ms_a_step"]["per_layer"] - report["ms_a_step"]["stack"]
    print(
        f"stack {report['ms_a_step']['stack']:.2f} ms a step, per layer {report['ms_a_step']['per_layer']:.2f}; "
        f"per layer / stack (median of rounds) {report['per_layer_over_stack']:.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); {saved * 1e3 / len(decoder.layers):.1f} us a layer"
    )


if __name__ == "__main__":
    main()
