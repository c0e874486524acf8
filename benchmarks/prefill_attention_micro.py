"""Prefill attention on the default model's shapes (14 query heads, 2 KV heads, head_dim 64, bfloat16 or float32): our
kernel (`prefill_attention`: AVX512-BF16 or AMX in bf16, AVX2 FMAs in float32) against what the engine calls without
it, SDPA's CPU flash kernel (causal for a fresh prompt; for a chunk after a cached prefix, two mask-free calls
merged by log-sum-exp at >= 1,024 queries, else one call with the bottom-right mask). GFLOP/s count the products of
the visible (unmasked) scores only. `--base COMMIT` puts that commit's kernel in SDPA's place: a change to ours,
measured in one process, each shape alternating the two sides call by call (the median of each side's times). Never
run by CI.

    .venv/bin/python benchmarks/prefill_attention_micro.py [--dtype float32] [--base HEAD]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kernel_ab import sources_at

from qwenbatch.layers import cpu_kernels
from qwenbatch.layers.attention import sdpa_chunk_attention

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64


def median_ms(first, second, repeats: int) -> tuple[float, float]:
    """Each function's median time in ms, the two called in turn."""
    first(), second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, into in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            into.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="300x300,1024x1024,2048x2048,2048x4096,512x2560,4096x8192")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--base", help="a commit whose kernel is the baseline, in SDPA's place")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    ops = cpu_kernels.kernels()
    if not ops.prefill_attention_isa(args.dtype):
        raise SystemExit(f"our {args.dtype} kernel is not built for this CPU (bf16 needs AVX512-BF16, float32 AVX2)")
    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5
    if args.base:
        with tempfile.TemporaryDirectory() as tmp:
            base_ops = cpu_kernels.build(sources_at(args.base, Path(tmp)), "native")
    name = "base" if args.base else "sdpa"
    print(
        f"{'queries x keys':>16} {name + ' ms':>9} {'ours ms':>9} {name + ' GF/s':>10} {'ours GF/s':>10}"
        f" {'speed-up':>9}"
    )
    for shape in args.shapes.split(","):
        q_len, k_len = (int(x) for x in shape.split("x"))
        q = torch.randn(q_len, HEADS, HEAD_DIM, dtype=dtype)
        k = torch.randn(k_len, KV_HEADS, HEAD_DIM, dtype=dtype)
        v = torch.randn(k_len, KV_HEADS, HEAD_DIM, dtype=dtype)
        visible = q_len * (k_len - q_len) + q_len * (q_len + 1) / 2
        flop = 4 * HEADS * HEAD_DIM * visible
        if args.base:
            baseline = lambda q=q, k=k, v=v: base_ops.prefill_attention(q, k, v, scale)  # noqa: E731
        else:
            baseline = lambda q=q, k=k, v=v: sdpa_chunk_attention(q, k, v, scale)  # noqa: E731
        theirs, ours = median_ms(baseline, lambda q=q, k=k, v=v: ops.prefill_attention(q, k, v, scale), args.repeats)
        print(
            f"{shape:>16} {theirs:9.2f} {ours:9.2f} {flop / theirs / 1e6:10.1f} {flop / ours / 1e6:10.1f}"
            f" {theirs / ours:8.2f}x"
        )


if __name__ == "__main__":
    main()
