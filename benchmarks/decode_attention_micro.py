"""The CPU decode-attention kernel (`paged_decode_attention`) on the default model's shapes (14 query heads, 2 KV
heads, head_dim 64, bfloat16, blocks of 16 scattered through the cache), at a decode step's batch sizes and
context lengths. "cold" cycles through 256 MiB of layers' caches (more than the L3 holds), as a real step finds its KV
after the weights have streamed through the caches; "warm" repeats one layer. The lower bound beside each is the
layer's K and V bytes at the stream rate given (`--gbs`, this machine's measured read bandwidth).
`--base COMMIT` (or a directory holding a copy of `csrc/`) times that build's kernel beside this tree's, the two
called in turn on the same caches (medians of each side's times), and prints base / ours. `--target avx2 --dtype
float32` runs the AVX2 kind's build on its default dtype (the float32 kernel), on this CPU. Never run by CI.

    .venv/bin/python benchmarks/decode_attention_micro.py [--base HEAD] [--target avx2 --dtype float32]
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

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16
SHAPES = ((1, 128), (1, 450), (1, 2048), (16, 450), (64, 320), (64, 1024))


def per_call_us(fns, calls: int, repeats: int = 7) -> list[float]:
    """Each function's median time a call in microseconds, the functions called in turn."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, into in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            into.append(time.perf_counter() - start)
    return [statistics.median(t) / calls * 1e6 for t in times]


def measure(modules, seqs: int, context: int, footprint: int, dtype: torch.dtype) -> tuple[list[float], list[float]]:
    """Microseconds a call for each module, (cold, warm), for `seqs` sequences of `context` positions each; the
    cold loop cycles through enough caches to fill `footprint` bytes."""
    blocks_per_seq = -(-context // BLOCK)
    pool = seqs * blocks_per_seq + 8
    layers = max(4, footprint // (2 * pool * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize))
    caches = [torch.randn(2, pool, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(layers)]
    tables = torch.randperm(pool)[: seqs * blocks_per_seq].view(seqs, blocks_per_seq).int()
    lens = torch.full((seqs,), context, dtype=torch.int32)
    q = torch.randn(seqs, HEADS, HEAD_DIM, dtype=dtype)
    scale = HEAD_DIM**-0.5

    def cold(ops):
        def run() -> None:
            for cache in caches:
                ops.paged_decode_attention(q, cache, tables, lens, scale)

        return run

    def warm(ops):
        def run() -> None:
            for _ in caches:
                ops.paged_decode_attention(q, caches[0], tables, lens, scale)

        return run

    for ops in modules:
        cold(ops)()
    return per_call_us([cold(m) for m in modules], layers), per_call_us([warm(m) for m in modules], layers)


def base_module(base: str, into: Path, target: str):
    """The kernels as `base` (a commit, or a directory holding a copy of csrc/) builds them."""
    return cpu_kernels.build(Path(base) if Path(base).is_dir() else sources_at(base, into), target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--footprint-mib", type=int, default=256, help="the cold loop's caches, more than the L3")
    parser.add_argument("--gbs", type=float, default=32.0, help="read bandwidth for the lower bound, GB/s")
    parser.add_argument("--base", help="a commit (or a copy of csrc/) whose kernel is timed beside this tree's")
    parser.add_argument("--target", choices=["native", "avx2"], default="native", help="both builds' target")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="q's and the cache's")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    modules = [cpu_kernels.kernels(args.target)]
    if args.base:
        with tempfile.TemporaryDirectory() as tmp:
            modules.insert(0, base_module(args.base, Path(tmp), args.target))
        print("D   context  base-cold  cold-us  base/ours  base-warm  warm-us  base/ours  bound-us")
    else:
        print("D   context  cold-us  warm-us  bound-us  cold/bound")
    for seqs, context in SHAPES:
        cold, warm = measure(modules, seqs, context, args.footprint_mib * 2**20, dtype)
        bound = seqs * context * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize / (args.gbs * 1e3)
        if args.base:
            print(
                f"{seqs:<4d}{context:8d}{cold[0]:11.1f}{cold[1]:9.1f}{cold[0] / cold[1]:10.2f}x"
                f"{warm[0]:11.1f}{warm[1]:9.1f}{warm[0] / warm[1]:10.2f}x{bound:10.1f}"
            )
        else:
            print(f"{seqs:<4d}{context:8d}{cold[0]:9.1f}{warm[0]:9.1f}{bound:10.1f}{cold[0] / bound:11.1f}x")


if __name__ == "__main__":
    main()
