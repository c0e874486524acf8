"""Batch-1 decode of the default model with `--quantization int8`, its all-Q5_0 layers in 5 bits (as shipped
where the CPU has AVX2 or AVX-512) beside the same engine holding them in 8 bits, alternating in one process;
the greedy tokens must be the same (the two layouts hold the same values). Never run by CI.

    .venv/bin/python benchmarks/five_bit_ab.py --pairs 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import qwenbatch.layers.int8_linear as int8_linear
from qwenbatch import LLM, SamplingParams


class EightBitOnly(int8_linear.Int8Linear):
    def __init__(self, linear, five_bit: bool = False, *args, **kwargs) -> None:
        super().__init__(linear, False, *args, **kwargs)


def decode(llm: LLM, prompt: list[int]) -> tuple[float, list[int]]:
    """Tokens/s of 128 decode steps after a 256-token prompt (one 1-token run's time subtracted), and the tokens."""
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=129, ignore_eos=True), use_tqdm=False)
    return 128 / (time.perf_counter() - start - prefill), out[0].outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    five = LLM(model="default", quantization="int8", kv_cache_memory="256MiB")
    original, int8_linear.Int8Linear = int8_linear.Int8Linear, EightBitOnly
    try:
        eight = LLM(model="default", quantization="int8", kv_cache_memory="256MiB")
    finally:
        int8_linear.Int8Linear = original
    count = [
        sum(m.bits == 5 for m in llm.engine.runner.model.modules() if isinstance(m, original)) for llm in (five, eight)
    ]
    print(f"5-bit layers: {count[0]} against {count[1]}")
    prompt = list(range(1000, 1256))
    ratios = []
    for _ in range(args.pairs):
        (r8, t8), (r5, t5) = decode(eight, prompt), decode(five, prompt)
        ratios.append(r5 / r8)
        print(f"8-bit {r8:.1f} tok/s, 5-bit {r5:.1f} tok/s, ratio {r5 / r8:.3f}, same tokens: {t8 == t5}")
    print(f"median ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
