"""`--compile` beside the default eager engine, same process, alternating: batch-1 decode, 16 sequences of
256 -> 64 tokens, one 1,024-token prefill (fresh random prompts each run, so no prefix is cached). Prints the
warm-up (compile) time and each measure's three pairs with the median ratio. Never run by CI.

    .venv/bin/python benchmarks/compile_ab.py --dtype auto
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qwenbatch import LLM, SamplingParams

_seed = [0]


def prompts(n: int, length: int = 256) -> list[list[int]]:
    _seed[0] += 1
    g = torch.Generator().manual_seed(_seed[0])
    return [torch.randint(1000, 100000, (length,), generator=g).tolist() for _ in range(n)]


def timed(llm: LLM, batch: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start


def decode_tps(llm: LLM) -> float:
    batch = prompts(1)
    prefill = timed(llm, batch, 1)
    # The second run finds the prompt cached, so this overstates the decode rate a little, alike for both.
    return 64 / (timed(llm, batch, 65) - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    common = dict(model="default", dtype=args.dtype, kv_cache_memory="1GiB")
    compiled = LLM(**common, compile=True)
    start = time.perf_counter()
    timed(compiled, prompts(1), 3)
    timed(compiled, prompts(4), 3)
    print(f"compile warm-up (first steps): {time.perf_counter() - start:.1f} s", flush=True)
    eager = LLM(**common)
    timed(eager, prompts(2), 3)
    print(f"eager: {eager.engine.runner.linear_kernels}; compiled: {compiled.engine.runner.linear_kernels}")
    measures = [
        ("batch-1 decode tok/s", decode_tps, True),
        ("16 x 256 -> 64, s", lambda llm: timed(llm, prompts(16), 64), False),
        ("prefill 1,024, s", lambda llm: timed(llm, prompts(1, 1024), 1), False),
    ]
    for name, measure, higher_is_better in measures:
        pairs = [(measure(eager), measure(compiled)) for _ in range(3)]
        ratio = statistics.median(c / e if higher_is_better else e / c for e, c in pairs)
        print(
            f"{name}: eager {[round(e, 2) for e, _ in pairs]}, compiled {[round(c, 2) for _, c in pairs]}; "
            f"compiled speed / eager {ratio:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
