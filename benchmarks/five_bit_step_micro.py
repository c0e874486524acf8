"""The linears of a decode step's 24 layers whose weights are Q5_0 blocks (qkv 896 -> 1152, o 896 -> 896,
gate_up 896 -> 9728), held in 5 bits beside the same values in 8 bits, alternating in one process, at the row
counts a batch runs (best of 5 each). Weights stream from DRAM as in a step; down and the LM head are not Q5_0
and are left out. Never run by CI.

    .venv/bin/python benchmarks/five_bit_step_micro.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

from qwenbatch.layers.int8_linear import GROUP_SIZE, Int8Linear, dequantize

SHAPES = ((1152, 896), (896, 896), (9728, 896))  # (out, in) of qkv, o, gate_up


def q5_0_linear(n: int, k: int) -> nn.Linear:
    values = torch.randint(-16, 16, (n, k), dtype=torch.int8)
    values[:, ::GROUP_SIZE] = -16
    linear = nn.Linear(k, n, bias=False)
    linear.weight.data = dequantize(values, torch.rand(n, k // GROUP_SIZE).half() * 0.01)
    return linear


def step_seconds(layers: list[Int8Linear], x: torch.Tensor) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer(x)
    return time.perf_counter() - start


def main() -> None:
    torch.manual_seed(0)
    dense = [q5_0_linear(n, k) for _ in range(24) for n, k in SHAPES]
    eight = [Int8Linear(d, five_bit=False) for d in dense]
    five = [Int8Linear(d, five_bit=True) for d in dense]
    assert all(layer.bits == 5 for layer in five)
    print("M   8-bit-ms  5-bit-ms  5-bit speed")
    for m in (1, 2, 4, 8, 16, 32, 64):
        x = torch.randn(m, 896)
        pairs = [(step_seconds(eight, x), step_seconds(five, x)) for _ in range(5)]
        t8, t5 = min(p[0] for p in pairs), min(p[1] for p in pairs)
        print(f"{m:<4d}{t8 * 1e3:9.1f}{t5 * 1e3:10.1f}{t8 / t5:12.2f}x")


if __name__ == "__main__":
    main()
