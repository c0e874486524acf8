"""Prefill attention on the default model's shapes (14 query heads, 2 KV heads, head_dim 64, bfloat16): our
AVX512-BF16 kernel (`prefill_attention`) against what the engine calls without it, SDPA's CPU flash kernel (causal
for a fresh prompt; for a chunk after a cached prefix, two mask-free calls merged by log-sum-exp at >= 1,024 queries,
else one call with the bottom-right mask). GFLOP/s count the products of the visible (unmasked) scores only.
Never run by CI.

    .venv/bin/python benchmarks/prefill_attention_micro.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qwenbatch.layers.attention import sdpa_chunk_attention
from qwenbatch.layers.cpu_kernels import kernels

HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="300x300,1024x1024,2048x2048,2048x4096,512x2560,4096x8192")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ops = kernels()
    if not ops.prefill_attention_available():
        raise SystemExit("this CPU has no AVX512-BF16: the kernel is not built")
    torch.manual_seed(0)
    scale = HEAD_DIM**-0.5
    print(f"{'queries x keys':>16} {'sdpa ms':>9} {'ours ms':>9} {'sdpa GF/s':>10} {'ours GF/s':>10} {'speed-up':>9}")
    for shape in args.shapes.split(","):
        q_len, k_len = (int(x) for x in shape.split("x"))
        q = torch.randn(q_len, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        k = torch.randn(k_len, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        v = torch.randn(k_len, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        visible = q_len * (k_len - q_len) + q_len * (q_len + 1) / 2
        flop = 4 * HEADS * HEAD_DIM * visible
        theirs = median_ms(lambda q=q, k=k, v=v: sdpa_chunk_attention(q, k, v, scale), args.repeats)
        ours = median_ms(lambda q=q, k=k, v=v: ops.prefill_attention(q, k, v, scale), args.repeats)
        print(
            f"{shape:>16} {theirs:9.2f} {ours:9.2f} {flop / theirs / 1e6:10.1f} {flop / ours / 1e6:10.1f}"
            f" {theirs / ours:8.2f}x"
        )


if __name__ == "__main__":
    main()
