"""The int8 linear, in its 8-bit and 5-bit layouts, beside oneDNN's prepacked linear in the machine's fast dtype
(`--dtype auto`: bfloat16 where the CPU multiplies it natively, else float32) at the small M of decode steps,
weights streamed from DRAM (24 distinct 896 -> 9728 gate_up matrices, 209 MB in bf16, cycled): BENCHMARKS.md's
table. The weights are Q5_0 blocks (as the default model's gate/up), so both layouts hold the same values.
Never run by CI.

    .venv/bin/python benchmarks/int8_linear_micro.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from qwenbatch.config import cpu_has_native_bf16
from qwenbatch.layers.int8_linear import GROUP_SIZE, Int8Linear, dequantize
from qwenbatch.layers.linear import PackedLinear


def best_of(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def q5_0_linears(k: int, n: int, layers: int) -> list[nn.Linear]:
    """``layers`` float32 linears [n, k] whose weights are Q5_0 blocks (as the default model's gate / up)."""
    dense = []
    for _ in range(layers):
        values = torch.randint(-16, 16, (n, k), dtype=torch.int8)
        values[:, ::GROUP_SIZE] = -16
        linear = nn.Linear(k, n, bias=False)
        linear.weight.data = dequantize(values, torch.rand(n, k // GROUP_SIZE).half() * 0.01)
        dense.append(linear)
    return dense


def main() -> None:
    torch.manual_seed(0)
    layers, k, n = 24, 896, 9728
    dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    dense = q5_0_linears(k, n, layers)
    int8 = [Int8Linear(d, five_bit=False) for d in dense]
    five = [Int8Linear(d, five_bit=True) for d in dense]
    packed = [PackedLinear(d.to(dtype)) for d in dense]
    weights = layers * n * k
    name = str(dtype).removeprefix("torch.")
    print(f"M  {name}-prepacked-ms  GB/s  int8-ms  GB/s  GOP/s  5bit-ms  GB/s  GOP/s  int8/prepacked  5bit/int8")
    for m in (1, 2, 4, 8, 16, 64, 256):
        x = torch.randn(m, k, dtype=dtype)
        t_dense = best_of(lambda x=x: [layer(x) for layer in packed])
        t_int8 = best_of(lambda x=x: [layer(x) for layer in int8])
        t_five = best_of(lambda x=x: [layer(x) for layer in five])
        print(
            f"{m:<3d}{t_dense * 1e3:14.1f}{weights * dtype.itemsize / t_dense / 1e9:10.1f}{t_int8 * 1e3:9.1f}"
            f"{weights * 1.0625 / t_int8 / 1e9:6.1f}{2 * m * weights / t_int8 / 1e9:7.0f}"
            f"{t_five * 1e3:9.1f}{weights * 0.6875 / t_five / 1e9:6.1f}{2 * m * weights / t_five / 1e9:7.0f}"
            f"{t_dense / t_int8:15.2f}x{t_int8 / t_five:10.2f}x"
        )


if __name__ == "__main__":
    main()
