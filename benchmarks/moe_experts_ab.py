"""A mixture of experts' CPU paths side by side, one fresh process a run: prefill of 16 × 256 tokens (after a
warm-up run of the same shapes), the step time of 32 decode steps at 16 rows and at 1, per variant:
``grouped`` (torch's grouped matmul on the weights as loaded), ``packed`` (oneDNN-packed experts, the bf16 default)
or ``int8`` (``--quantization int8``).

    .venv/bin/python benchmarks/random_moe_checkpoint.py /tmp/qwen3-moe-8l --layers 8
    .venv/bin/python benchmarks/moe_experts_ab.py /tmp/qwen3-moe-8l --rounds 5 --variants grouped,packed,int8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(model: str, variant: str) -> dict:
    """One variant's figures, in this process."""
    import qwenbatch.layers.cpu_experts as cpu_experts

    if variant == "grouped":  # leave the GroupedExperts as loaded
        cpu_experts.PackedExperts = lambda experts: experts
    from qwenbatch import LLM, SamplingParams

    quantization = "int8" if variant == "int8" else "none"
    llm = LLM(model=model, dtype="bfloat16", quantization=quantization, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[(1000 + 300 * i + j) % vocab for j in range(256)] for i in range(16)]

    def run(batch: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start

    run(prompts, 1)  # oneDNN creates a primitive for each new row count: the same shapes again are warm
    prefill16 = min(run(prompts, 1) for _ in range(2))
    decode16 = (run(prompts, 33) - prefill16) / 32
    prefill1 = run(prompts[:1], 1)
    decode1 = (run(prompts[:1], 33) - prefill1) / 32
    return {
        "variant": variant,
        "prefill_tok_s": 16 * 256 / prefill16,
        "decode16_ms": decode16 * 1e3,
        "decode1_ms": decode1 * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="grouped,packed,int8")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this variant and print it
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.one)))
        return
    for _ in range(args.rounds):
        for variant in args.variants.split(","):
            child = [sys.executable, __file__, args.model, "--one", variant]
            out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
