"""The default model's MLP (gate_up 896 -> 2 x 4,864 with SiLU * up in 5 bits, down 4,864 -> 896 in 8 bits) at
each row count: the int8 kernel against the dense bf16 path (the weight dequantized for the call, then PyTorch's
bf16 matmul), as layers/int8_large_m.py times them at load, plus the dequantizing alone. BENCHMARKS.md's table.
Never run by CI.

    .venv/bin/python benchmarks/int8_dense_rows.py [--rows 16 64 256 1024 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from qwenbatch.layers.cpu_kernels import kernels
from qwenbatch.layers.int8_linear import GROUP_SIZE, Int8Linear, dequantize
from qwenbatch.layers.timing import best_times_ms


def q_blocks_linear(k: int, n: int, low: int, high: int) -> nn.Linear:
    """A float32 linear [n, k] whose weights are blocks of 32 with values in [low, high) (Q5_0: -16..16, Q8_0)."""
    values = torch.randint(low, high, (n, k), dtype=torch.int8)
    values[:, ::GROUP_SIZE] = low
    linear = nn.Linear(k, n, bias=False)
    linear.weight.data = dequantize(values, torch.rand(n, k // GROUP_SIZE).half() * 0.01)
    return linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    gate_up = Int8Linear(q_blocks_linear(896, 9728, -16, 16), five_bit=True, silu_and_mul=True)
    down = Int8Linear(q_blocks_linear(4864, 896, -127, 128))
    linears = (gate_up, down)
    ops = kernels()
    dequantize_only = lambda: [  # noqa: E731
        ops.int8_dequantize(m.packed_weight, m.packed_scales, m.padded_out, m.in_features, m.bits, m.silu_and_mul)
        for m in linears
    ]
    print(f"isa {ops.isa()}, bits {gate_up.bits} / {down.bits}, threads {torch.get_num_threads()}")
    print(f"dequantizing both weights: {best_times_ms({'d': dequantize_only}, args.repeats)['d']:.2f} ms")
    print(f"{'rows':>6} {'int8 ms':>9} {'dense ms':>9} {'dense/int8':>10} {'int8 GOP/s':>11} {'dense GFLOP/s':>14}")
    for m in args.rows:
        xs = [torch.randn(m, linear.in_features).bfloat16() for linear in linears]
        best = best_times_ms(
            {
                "int8": lambda xs=xs: [linear.kernel_forward(x) for linear, x in zip(linears, xs, strict=True)],
                "dense": lambda xs=xs: [linear.dense_forward(x) for linear, x in zip(linears, xs, strict=True)],
            },
            args.repeats,
        )
        ops_count = 2 * m * sum(linear.padded_out * linear.in_features for linear in linears)
        print(
            f"{m:>6} {best['int8']:>9.2f} {best['dense']:>9.2f} {best['dense'] / best['int8']:>10.2f} "
            f"{ops_count / best['int8'] / 1e6:>11.0f} {ops_count / best['dense'] / 1e6:>14.0f}"
        )


if __name__ == "__main__":
    main()
