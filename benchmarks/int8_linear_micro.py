"""The int8 linear beside oneDNN's prepacked linear in the machine's fast dtype (`--dtype auto`: bfloat16 where
the CPU multiplies it natively, else float32) at the small M of decode steps, weights streamed from DRAM (24
distinct 896 -> 9728 gate_up matrices, 209 MB in bf16, cycled): BENCHMARKS.md's table. Never run by CI.

    .venv/bin/python benchmarks/int8_linear_micro.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from qwenbatch.config import cpu_has_native_bf16
from qwenbatch.layers.int8_linear import Int8Linear
from qwenbatch.layers.linear import PackedLinear


def best_of(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    layers, k, n = 24, 896, 9728
    dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    dense = [nn.Linear(k, n, bias=False).to(dtype) for _ in range(layers)]
    packed = [PackedLinear(d) for d in dense]
    int8 = [Int8Linear(d) for d in dense]
    weights = layers * n * k
    name = str(dtype).removeprefix("torch.")
    print(f"M  {name}-prepacked-ms  GB/s  int8-ms  GB/s  GOP/s  speed-up")
    for m in (1, 2, 4, 8, 16, 64, 256):
        x = torch.randn(m, k, dtype=dtype)
        t_dense = best_of(lambda x=x: [layer(x) for layer in packed])
        t_int8 = best_of(lambda x=x: [layer(x) for layer in int8])
        print(
            f"{m:<3d}{t_dense * 1e3:14.1f}{weights * dtype.itemsize / t_dense / 1e9:10.1f}{t_int8 * 1e3:9.1f}"
            f"{weights * 1.0625 / t_int8 / 1e9:6.1f}{2 * m * weights / t_int8 / 1e9:7.0f}{t_dense / t_int8:9.2f}x"
        )


if __name__ == "__main__":
    main()
