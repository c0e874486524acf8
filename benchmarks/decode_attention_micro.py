"""The CPU decode-attention kernel (`paged_decode_attention`) on the default model's shapes (14 query heads, 2 KV
heads, head_dim 64, bfloat16, blocks of 16 scattered through the cache), at a decode step's batch sizes and
context lengths. "cold" cycles through 256 MiB of layers' caches (more than the L3 holds), as a real step finds its KV
after the weights have streamed through the caches; "warm" repeats one layer. The lower bound beside each is the
layer's K and V bytes at the stream rate given (`--gbs`, this machine's measured read bandwidth). Never run by CI.

    .venv/bin/python benchmarks/decode_attention_micro.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qwenbatch.layers.cpu_kernels import kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / calls * 1e6


def measure(ops, seqs: int, context: int, footprint: int) -> tuple[float, float]:
    """Microseconds a call, (cold, warm), for `seqs` sequences of `context` positions each; the cold loop cycles
    through enough caches to fill `footprint` bytes."""
    blocks_per_seq = -(-context // BLOCK)
    pool = seqs * blocks_per_seq + 8
    layers = max(4, footprint // (2 * pool * BLOCK * KV_HEADS * HEAD_DIM * 2))
    caches = [torch.randn(2, pool, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(layers)]
    tables = torch.randperm(pool)[: seqs * blocks_per_seq].view(seqs, blocks_per_seq).int()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5

    def cold() -> None:
        for cache in caches:
            ops.paged_decode_attention(q, cache, tables, lens, scale)

    def warm() -> None:
        for _ in caches:
            ops.paged_decode_attention(q, caches[0], tables, lens, scale)

    cold()
    return per_call_us(cold, layers), per_call_us(warm, layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--footprint-mib", type=int, default=256, help="the cold loop's caches, more than the L3")
    parser.add_argument("--gbs", type=float, default=32.0, help="read bandwidth for the lower bound, GB/s")
    args = parser.parse_args()
    torch.manual_seed(0)
    ops = kernels()
    print("D   context  cold-us  warm-us  bound-us  cold/bound")
    for seqs, context in ((1, 128), (1, 450), (1, 2048), (16, 450), (64, 320)):
        t_cold, t_warm = measure(ops, seqs, context, args.footprint_mib * 2**20)
        bound = seqs * context * KV_HEADS * HEAD_DIM * 2 * 2 / (args.gbs * 1e3)
        print(f"{seqs:<4d}{context:8d}{t_cold:9.1f}{t_warm:9.1f}{bound:10.1f}{t_cold / bound:11.1f}x")


if __name__ == "__main__":
    main()
