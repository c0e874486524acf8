"""The CPU kernels whose work is cut into tasks by what the threads need (int8_linear's row blocks and short tile
runs, csrc/int8_tasks.h; decode attention's runs of a context and longest-first claims, csrc/decode_attention.cpp),
against a commit's kernels, side by side in one process, at this machine's thread count. Each pair times both
versions back to back, the first alternating, best of 3 calls each; the table gives median times and the median of
the per-pair ratios.

Two sets of shapes:
- the default model's (down and o projections, 896 outputs = 14 runs of 4 tiles; decode attention of one sequence,
  2 KV heads), which the plans cut further from 4 threads (under 4 tasks a thread: 14 runs < 16) and from 3
  threads (more threads than the 2 (sequence, KV head) pairs);
- narrow ones, cut coarser than the threads here (64 outputs = one run of 4 tiles; one KV head), which show the
  mechanism on a 2-core machine too.
Never run by CI.

    .venv/bin/python benchmarks/split_work_ab.py --base HEAD~2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from int8_linear_micro import best_of, q5_0_linears
from kernel_ab import sources_at

from qwenbatch.layers import cpu_kernels
from qwenbatch.layers.int8_linear import Int8Linear

HEADS, HEAD_DIM, BLOCK = 14, 64, 16


def linear_case(k: int, n: int, m: int):
    """An 8-bit [n, k] int8 linear on m rows of bf16 x: a function of a kernels module."""
    layer = Int8Linear(q5_0_linears(k, n, 1)[0], five_bit=False)
    x = torch.randn(m, k).bfloat16()
    return lambda ops: ops.int8_linear(x, layer.packed_weight, layer.packed_scales, None, layer.padded_out, 8)


def attention_case(kv_heads: int, contexts: list[int]):
    """Decode attention of one row per context, over its positions in scattered blocks, bf16."""
    per_seq = -(-max(contexts) // BLOCK)
    cache = torch.randn(2, len(contexts) * per_seq, BLOCK, kv_heads, HEAD_DIM).bfloat16()
    tables = torch.randperm(len(contexts) * per_seq).view(len(contexts), per_seq).int()
    q = torch.randn(len(contexts), HEADS, HEAD_DIM).bfloat16()
    lens = torch.tensor(contexts, dtype=torch.int32)
    return lambda ops: ops.paged_decode_attention(q, cache, tables, lens, HEAD_DIM**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit whose csrc/ is the baseline")
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = cpu_kernels.build(sources_at(args.base, Path(tmp)), "native")
    new = cpu_kernels.kernels("native")
    cases = {
        "down 4864->896, 1 row": linear_case(4864, 896, 1),
        "down 4864->896, 64 rows": linear_case(4864, 896, 64),
        "down 4864->896, 2048 rows": linear_case(4864, 896, 2048),
        "o 896->896, 2048 rows": linear_case(896, 896, 2048),
        "attention, 2 KV heads, 4096 positions": attention_case(2, [4096]),
        "attention, 2 KV heads, 4000 + 3 x 100": attention_case(2, [4000, 100, 100, 100]),
        "attention, 2 KV heads, 16 x 1000": attention_case(2, [1000] * 16),
        "narrow 896->64, 2048 rows": linear_case(896, 64, 2048),
        "narrow 896->64, 1 row": linear_case(896, 64, 1),
        "narrow attention, 1 KV head, 4096": attention_case(1, [4096]),
    }
    print(f"kernels: base {args.base} against the working tree, {torch.get_num_threads()} threads")
    print(f"{'call':<40}{'base ms':>10}{'new ms':>10}{'base/new':>10}  (pairs)")
    for label, case in cases.items():
        case(base), case(new)  # warm
        base_ms, new_ms, ratios = [], [], []
        for pair in range(args.pairs):
            first, second = (new, base) if pair % 2 else (base, new)
            t_first, t_second = best_of(lambda m=first, c=case: c(m), 3), best_of(lambda m=second, c=case: c(m), 3)
            t_base, t_new = (t_second, t_first) if pair % 2 else (t_first, t_second)
            base_ms.append(t_base * 1e3)
            new_ms.append(t_new * 1e3)
            ratios.append(t_base / t_new)
        print(
            f"{label:<40}{statistics.median(base_ms):>10.3f}{statistics.median(new_ms):>10.3f}"
            f"{statistics.median(ratios):>9.2f}x  ({', '.join(f'{r:.2f}' for r in ratios)})"
        )


if __name__ == "__main__":
    main()
