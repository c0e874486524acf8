"""How fast a decode step's int8 linears stream their weights at one row, layer kind by layer kind, beside the
machine's read bandwidth (``torch.sum`` of 1 GiB, as `bench` and llama_cpp_compare.py sample it), in one process:
the default model's own linears (``--quantization int8``), each kind's 24 layers in turn (from memory, as a step
reads them; a kind whose layers together fit in the last-level cache is read partly from it after the first of three
passes) and one of them again and again (from cache: what the kernel's arithmetic allows; not for one larger than
CACHED_MB). A kind far below the read bandwidth from memory and not much faster from cache is bound by its
arithmetic; one fast from cache but slow from memory waits on its loads. Rounds alternate with bandwidth samples;
the table gives medians. Never run by CI.

    .venv/bin/python benchmarks/decode_weight_stream.py --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch

from qwenbatch import LLM
from qwenbatch.bench.machine import cpu_kind, describe_cpu, read_bandwidth_gbs
from qwenbatch.layers.int8_linear import Int8Linear

CACHED_MB = 8  # a linear up to this size is read again from cache (L3: 32 MB on the AVX2 kind's Zen 3)


def stream_gbs(linears: list[Int8Linear], repeats: int) -> float:
    """GB/s of weights and scales read by ``repeats`` passes over ``linears``, one row of x each, called as the
    kernel is called in a step (no Python module call around it)."""
    calls = [(torch.randn(1, m.in_features), m) for m in linears]
    start = time.perf_counter()
    for _ in range(repeats):
        for x, m in calls:
            m._kernels.int8_linear(x, m.packed_weight, m.packed_scales, m.bias, m.padded_out, m.bits, m.silu_and_mul)
    seconds = time.perf_counter() - start
    return sum(m.packed_weight.nbytes + m.packed_scales.nbytes for m in linears) * repeats / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    llm = LLM(quantization="int8", max_model_len=512)
    kinds: dict[str, list[Int8Linear]] = collections.defaultdict(list)
    for name, module in llm.engine.runner.model.named_modules():
        if isinstance(module, Int8Linear):
            kinds[f"{name.rsplit('.', 1)[-1]} {module.bits}-bit"].append(module)
    rows: dict[str, dict[str, list[float]]] = {k: {"memory": [], "cache": []} for k in kinds}
    bandwidth = []
    for _ in range(args.rounds):
        bandwidth.append(read_bandwidth_gbs())
        for kind, linears in kinds.items():
            rows[kind]["memory"].append(stream_gbs(linears, 3))
            if linears[0].packed_weight.nbytes <= CACHED_MB * 1e6:
                rows[kind]["cache"].append(stream_gbs(linears[:1], 100))
    read = statistics.median(bandwidth)
    print(describe_cpu(cpu_kind()))
    print(f"read bandwidth (torch.sum of 1 GiB): median {read:.1f} GB/s of {len(bandwidth)} samples")
    print(f"{'linears':22} {'count':>5} {'MB each':>8} {'memory GB/s':>12} {'/ read':>7} {'cache GB/s':>11}")
    report = {"cpu": cpu_kind(), "read_bandwidth_gbs_samples": bandwidth, "kinds": {}}
    for kind, linears in kinds.items():
        each = sum(m.packed_weight.nbytes + m.packed_scales.nbytes for m in linears) / len(linears) / 1e6
        memory = statistics.median(rows[kind]["memory"])
        cache = f"{statistics.median(rows[kind]['cache']):11.1f}" if rows[kind]["cache"] else f"{'-':>11}"
        print(f"{kind:22} {len(linears):5d} {each:8.1f} {memory:12.1f} {memory / read:7.2f} {cache}")
        report["kinds"][kind] = {"count": len(linears), "mb_each": each, **rows[kind]}
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
