"""Two versions of the int8 linear kernel side by side in one process: the working tree's ``csrc/`` against a
commit's, on the default model's shapes (gate_up 896 -> 9,728 in 5 bits with SiLU * up, down 4,864 -> 896 and the
LM head 896 -> 151,936 in 8 bits), at the M of decode steps and of prefill chunks. Each pair times both versions
back to back, the first alternating, best of 3 calls each; the table gives the median time and the median of the
per-pair ratios, which is what survives a noisy host. Decode steps' M (up to 64) cycle 24 distinct matrices (2 of the
LM head) so that weights stream from DRAM, as in a step.
Never run by CI.

    .venv/bin/python benchmarks/kernel_ab.py --base HEAD --pairs 7

``--target avx2 --dtype float32`` runs the AVX2 kind's kernels (as that kind runs them, on float32 x) on an
AVX-512 CPU: a check that a change shared by both kinds does not slow the other one, not its figures.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from int8_linear_micro import best_of, q5_0_linears

from qwenbatch.config import cpu_has_native_bf16
from qwenbatch.layers import cpu_kernels
from qwenbatch.layers.int8_linear import Int8Linear

LAYERS = 24


def sources_at(commit: str, into: Path) -> Path:
    """A copy of ``csrc/`` as ``commit`` had it."""
    csrc = "src/qwenbatch/layers/csrc"
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{commit}:{csrc}"], check=True, capture_output=True, text=True
    ).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{commit}:{csrc}/{name}"], check=True, capture_output=True).stdout
        (into / name).write_bytes(blob)
    return into


def q5_layers(k: int, n: int, five_bit: bool, silu_and_mul: bool, layers: int = LAYERS) -> list[Int8Linear]:
    """``layers`` linears whose weights are Q5_0 blocks, packed by this tree."""
    return [Int8Linear(d, five_bit, silu_and_mul=silu_and_mul) for d in q5_0_linears(k, n, layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit whose csrc/ is the baseline")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 2048])
    parser.add_argument(
        "--target", choices=["native", "avx2", "portable"], default="native",
        help="the build target of both versions: avx2 runs the AVX2 kind's kernels on an AVX-512 CPU",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
        help="x's dtype; auto: the engine's --dtype auto on this CPU (bfloat16 where it multiplies it natively)",
    )  # fmt: skip
    args = parser.parse_args()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = cpu_kernels.build(sources_at(args.base, Path(tmp)), args.target)
    new = cpu_kernels.kernels(args.target)
    threads = torch.get_num_threads()
    print(
        f"kernels: base {args.base} ({base.isa()}) against the working tree ({new.isa()}), {threads} threads, "
        f"x in {dtype}"
    )
    shapes = {
        "gate_up 5-bit": q5_layers(896, 9728, five_bit=True, silu_and_mul=True),
        "down 8-bit": q5_layers(4864, 896, five_bit=False, silu_and_mul=False),
        # the LM head (tied to the 8-bit embedding): 136 MB each, 2 are more than the L3
        "lm_head 8-bit": q5_layers(896, 151936, five_bit=False, silu_and_mul=False, layers=2),
    }
    print(f"{'layer':<15}{'M':>6}{'base ms':>10}{'new ms':>10}{'new GOP/s':>11}{'base/new':>10}  (pairs)")
    for label, layers in shapes.items():
        for m in args.rows:
            used = layers if m <= 64 else layers[: max(1, 4096 // m)]  # prefill chunks: compute-bound anyway
            x = torch.randn(m, layers[0].in_features).to(dtype)

            def run(module, used=used, x=x) -> None:
                for layer in used:
                    module.int8_linear(
                        x, layer.packed_weight, layer.packed_scales, None, layer.padded_out, layer.bits,
                        layer.silu_and_mul,
                    )  # fmt: skip

            run(base), run(new)  # warm: first-touch, caches
            base_ms, new_ms, ratios = [], [], []
            for pair in range(args.pairs):
                if pair % 2:
                    t_new, t_base = best_of(lambda: run(new), 3), best_of(lambda: run(base), 3)
                else:
                    t_base, t_new = best_of(lambda: run(base), 3), best_of(lambda: run(new), 3)
                base_ms.append(t_base * 1e3)
                new_ms.append(t_new * 1e3)
                ratios.append(t_base / t_new)
            ops = 2 * m * sum(layer.in_features * layer.padded_out for layer in used)
            print(
                f"{label:<15}{m:>6}{statistics.median(base_ms):>10.2f}{statistics.median(new_ms):>10.2f}"
                f"{ops / statistics.median(new_ms) / 1e6:>11.0f}{statistics.median(ratios):>9.2f}x  "
                f"({', '.join(f'{r:.2f}' for r in ratios)})"
            )


if __name__ == "__main__":
    main()
