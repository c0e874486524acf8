"""One long prompt's prefill, end to end in the engine, with prefill attention in our kernel and in SDPA's flash
kernel: one engine, the attention switched between runs (each run a fresh prompt, the two sides alternating which
goes first), so the host's drift falls on both. Prints each length's tok/s per side and the median of the pairs'
ratios; the fall from the first length to each longer one. Never run by CI.

    .venv/bin/python benchmarks/prefill_attention_ab.py --lens 1024,4096,8192 --pairs 2 [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.machine import cpu_kind
from qwenbatch.bench.workloads import random_workload
from qwenbatch.layers.attention import KernelAttentionMetadata


def prefill_seconds(llm: LLM, tokens: int, seed: int) -> float:
    prompt = random_workload(1, (tokens, tokens), (1, 1), seed=seed)[0].prompt_token_ids
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lens", default="1024,4096,8192")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    lens = [int(n) for n in args.lens.split(",")]
    llm = LLM(dtype=args.dtype, quantization=args.quantization, max_model_len=max(lens) + 64)
    runner = llm.engine.runner
    if not runner.prefill_attention.startswith("cpu-kernels"):
        raise SystemExit(f"the engine chose {runner.prefill_attention!r} at load: nothing to compare")
    sides = {
        "ours": partial(KernelAttentionMetadata.build, own_prefill=True),
        "sdpa": partial(KernelAttentionMetadata.build, own_prefill=False),
    }
    prefill_seconds(llm, 512, seed=0)  # warm-up
    report: dict = {"cpu": cpu_kind(), "dtype": str(llm.engine.dtype), "chosen": runner.prefill_attention, "rows": []}
    for tokens in lens:
        pairs = []
        for i in range(args.pairs):
            seconds = {}
            for side in sorted(sides, reverse=i % 2 == 1):
                runner._build_metadata = sides[side]
                seconds[side] = prefill_seconds(llm, tokens, seed=tokens * 100 + 2 * i + (side == "ours"))
            pairs.append(seconds)
        row = {
            "tokens": tokens,
            "ours_tps": tokens / statistics.median(p["ours"] for p in pairs),
            "sdpa_tps": tokens / statistics.median(p["sdpa"] for p in pairs),
            "ours_over_sdpa": statistics.median(p["sdpa"] / p["ours"] for p in pairs),
            "pairs_s": pairs,
        }
        report["rows"].append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "pairs_s"}))
    first = report["rows"][0]
    for row in report["rows"][1:]:
        row["fall_from_first"] = {side: 1 - row[f"{side}_tps"] / first[f"{side}_tps"] for side in sides}
        falls = ", ".join(f"{side} {fall:.0%}" for side, fall in row["fall_from_first"].items())
        print(f"fall {first['tokens']} -> {row['tokens']} tokens: {falls}")
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
