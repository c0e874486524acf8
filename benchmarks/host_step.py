"""The host's share of an engine step: everything but the model's forward (scheduling, packing, sampling rows,
output processing), per step, on a tiny random model so that the forward is cheap. On a GPU this Python runs
between the kernels' launches and decides the step rate at large batches (BENCHMARKS.md, the CUDA path); it is
the same code on a CPU, so it is measured here. Never run by CI.

    .venv/bin/python benchmarks/host_step.py --seqs 256 --output-len 512
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "gpu"))

from bench import tiny_checkpoint  # the GPU script's tiny random Qwen3

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.workloads import random_workload


def host_ms_per_step(llm: LLM, seqs: int, input_len: int, output_len: int, temperature: float) -> float:
    """One run's wall time less the time in the model's forward, per step, in ms."""
    runner = llm.engine.runner
    forward, spent, steps = runner._forward, [0.0], [0]

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
            steps[0] += 1

    runner._forward = timed
    work = random_workload(seqs, (input_len, input_len), (output_len, output_len), vocab_size=512)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([r.prompt_token_ids for r in work], params, use_tqdm=False)
    wall = time.perf_counter() - start
    runner._forward = forward
    return (wall - spent[0]) / steps[0] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(
            model=str(tiny_checkpoint(Path(tmp) / "tiny")),
            dtype="float32",
            max_num_seqs=args.seqs,
            kv_cache_memory=2 * 2**30,
        )
        runs = [
            host_ms_per_step(llm, args.seqs, args.input_len, args.output_len, args.temperature)
            for _ in range(args.runs)
        ]
    print(
        f"{args.seqs} seqs x {args.input_len} -> {args.output_len}, temperature {args.temperature}: host "
        f"{statistics.median(runs):.2f} ms a step (median of {args.runs}: {', '.join(f'{r:.2f}' for r in runs)})"
    )


if __name__ == "__main__":
    main()
