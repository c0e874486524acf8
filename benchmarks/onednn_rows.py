"""oneDNN's prepacked linear (layers/linear.py's PackedLinear; bf16 by default) at each row count, on all threads
and on one, for a model's four linear shapes: where the rate on all threads is no better than on one, oneDNN ran
the call on a single thread. On the AMX kind (2 threads) it does so in bf16 for some shapes at 512-1,280 rows and
runs them at half speed; in float32 there it did not (BENCHMARKS.md). The engine splits only bf16 linears
(layers/packed_rows.py); `--dtype float32` shows whether the AVX2 kind's float32 linears would need it too. Never run
by CI.

    .venv/bin/python benchmarks/onednn_rows.py [--shapes coder|qwen3-0.6b] [--dtype float32] [--rows 64 256 ...]
"""

from __future__ import annotations

import argparse

import torch

from qwenbatch.layers.timing import best_times_ms

# (in_features, out_features) of qkv, o, gate_up and down
SHAPES = {
    "coder": {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728), "down": (4864, 896)},
    "qwen3-0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
}
ROWS = [64, 256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1536, 1792, 2048]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="coder")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    shapes = SHAPES[args.shapes]
    weights = {
        name: torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=dtype), None)
        for name, (k, n) in shapes.items()
    }
    print(f"{args.dtype} GFLOP/s on {threads} threads (on 1); * where {threads} threads run under 1.25x one's rate")
    print(f"{'rows':>6} " + " ".join(f"{name:>16}" for name in shapes))
    for m in args.rows:
        cells = []
        for name, (k, _) in shapes.items():
            x = torch.randn(m, k, dtype=dtype)

            def call(x=x, w=weights[name]):
                return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

            rates = []
            for count in (threads, 1):
                torch.set_num_threads(count)
                ms = best_times_ms({"call": call}, args.repeats)["call"]
                rates.append(2 * m * k * shapes[name][1] / ms / 1e6)
            torch.set_num_threads(threads)
            flag = "*" if rates[0] < 1.25 * rates[1] else " "
            cells.append(f"{rates[0]:>8.0f} ({rates[1]:>4.0f}){flag}")
        print(f"{m:>6} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
