"""Sampling on the CPU: the sampler's CPU kernels (``SamplerKernels``: csrc/sampling.cpp, csrc/logprobs.cpp) against
its PyTorch path, side by side in one process. Never run by CI.

Two parts: the sampler alone on [rows, 151,936] bf16 logits for each setting (median ms a call; each row with a
256-token prompt and 32 output tokens for the penalties to read), and the default model on the random workload (all
prompts at once, eos ignored), greedy and each setting, the engine with the kernels and without them (its PyTorch
path), alternating runs; each row the median wall time of its runs.

The sampler alone runs on two kinds of logits: "random" (normal, standard deviation 3: at temperature 0.7 top-p 0.9
keeps ~200 tokens) and "model", the default model's own logits from its decode steps on chat prompts (at
temperature 0.7, top-p 0.9 keeps 1 token at the median, at most ~30), which decide how far the top-p cut reaches.

    .venv/bin/python benchmarks/sampling_speed.py --rows 1,64,256 --logits random,model --num-prompts 64 --runs 3

Two versions side by side: run the kernels alone for a few settings, each cell timed for some seconds, in turn from
two checkouts (PYTHONPATH=<checkout>/src), e.g.

    .venv/bin/python benchmarks/sampling_speed.py --rows 64 --logits random --kernel-only --seconds 2 --runs 0 \\
        --settings "temperature 0.7;min-p 0.05;top-p 0.9;Qwen's generation config;presence 0.5"
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.workloads import CHAT_INSTRUCTIONS
from qwenbatch.layers.cpu_kernels import greedy_tokens, sample_tokens, token_logprobs
from qwenbatch.layers.sampler import SamplerKernels, SamplingRow, sample

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top-k 20, top-p 0.8": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},  # Qwen's generation_config.json
    "min-p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "logprobs 5": {"temperature": 0.0, "logprobs": 5},
    "temperature 0.7, logprobs 5": {"temperature": 0.7, "logprobs": 5},
    "presence 0.5": {"temperature": 0.7, "presence_penalty": 0.5},
    "Qwen's generation config": {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05},
    "Qwen3's generation config": {"temperature": 0.6, "top_k": 20, "top_p": 0.95},
}
KERNELS = SamplerKernels(greedy_tokens, sample_tokens, token_logprobs)
TORCH_PATH = SamplerKernels(greedy_tokens)  # the engine's sampler before the sample and logprobs kernels


def median_ms(fn, repeats: int = 5, seconds: float = 0.0) -> float:
    """The median of ``repeats`` calls after a warm-up, or of as many as ``seconds`` hold where given."""
    fn()
    times = []
    deadline = time.perf_counter() + seconds

    def more() -> bool:
        return time.perf_counter() < deadline if seconds else len(times) < repeats

    while more():
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def model_logits(count: int) -> torch.Tensor:
    """``count`` rows of the default model's own bf16 logits: 4 rows of each decode step of 32 chat prompts sampled
    at temperature 0.7, repeated where fewer."""
    llm = LLM("default", dtype="auto")
    captured = []

    def capture(logits: torch.Tensor, settings, penalties):
        captured.append(logits[:4].clone())
        return sample_tokens(logits, settings, penalties)

    llm.engine.runner._sampler_kernels = SamplerKernels(greedy_tokens, capture, token_logprobs)
    prompts = [[{"role": "user", "content": text}] for text in CHAT_INSTRUCTIONS[:32]]
    llm.chat(prompts, SamplingParams(temperature=0.7, max_tokens=64, seed=0), use_tqdm=False)
    rows = torch.cat(captured)
    return rows.repeat(-(-count // len(rows)), 1)[:count].contiguous()


def sampler_alone(
    rows: list[int], kinds: list[str], settings: list[str], seconds: float = 0.0, kernel_only: bool = False
) -> None:
    """A table of ms a call of the PyTorch path (unless ``kernel_only``) and of the kernels, for each kind of logits,
    row count and setting; the kernels' cells timed for ``seconds`` each where given."""
    print("| logits | rows | setting | PyTorch path ms | kernel ms | speed-up |\n| --- | --- | --- | --- | --- | --- |")
    rng = random.Random(0)
    from_model = model_logits(max(rows)) if "model" in kinds else None
    for kind, count in ((kind, count) for kind in kinds for count in rows):
        if kind == "model":
            logits = from_model[:count].contiguous()
        else:
            logits = (torch.randn(count, 151_936, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
        histories = [[rng.randrange(151_936) for _ in range(256 + 32)] for _ in range(count)]
        for name in settings:
            params = [
                SamplingRow(SamplingParams(**SETTINGS[name]), h[256:], torch.tensor(sorted(set(h[:256]))), None, ())
                for h in histories
            ]
            after = median_ms(lambda x=logits, params=params: sample(x, params, KERNELS), seconds=seconds)
            if kernel_only:
                print(f"| {kind} | {count} | {name} | - | {after:.2f} | - |", flush=True)
                continue
            before = median_ms(lambda x=logits, params=params: sample(x, params, TORCH_PATH))
            print(f"| {kind} | {count} | {name} | {before:.2f} | {after:.2f} | {before / after:.1f}x |", flush=True)


def end_to_end(num_prompts: int, input_len: int, output_len: int, runs: int) -> None:
    llm = LLM("default", dtype="auto")
    llm.generate([{"prompt_token_ids": [5] * 8}], SamplingParams(temperature=0.7, max_tokens=4), use_tqdm=False)
    runner = llm.engine.runner
    rng = random.Random(0)
    walls: dict[tuple[str, str], list[float]] = {}
    print(f"\n{num_prompts} prompts x {input_len} random tokens -> {output_len}, {runs} runs a cell (s, median)")
    for run in range(runs):
        for name, kwargs in SETTINGS.items():
            sides = (("kernel", KERNELS), ("PyTorch path", TORCH_PATH))
            for side, kernels in sides if run % 2 == 0 else sides[::-1]:
                if name == "greedy" and side != "kernel":
                    continue  # both take the greedy kernel
                runner._sampler_kernels = kernels
                prompts = [[rng.randrange(1000, 150_000) for _ in range(input_len)] for _ in range(num_prompts)]
                params = SamplingParams(**kwargs, max_tokens=output_len, ignore_eos=True, seed=run)
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                walls.setdefault((name, side), []).append(time.perf_counter() - start)
    runner._sampler_kernels = KERNELS
    greedy = statistics.median(walls[("greedy", "kernel")])
    print("| setting | PyTorch path s | kernel s | speed-up | kernel / greedy |\n| --- | --- | --- | --- | --- |")
    for name in SETTINGS:
        after = statistics.median(walls[(name, "kernel")])
        before = statistics.median(walls.get((name, "PyTorch path"), [after]))
        print(f"| {name} | {before:.2f} | {after:.2f} | {before / after:.2f}x | {after / greedy:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64,256", help="sampler alone: rows a call")
    parser.add_argument("--logits", default="random,model", help="sampler alone: random and/or the model's logits")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--settings", default=";".join(SETTINGS), help="sampler alone: settings, separated by ';'")
    parser.add_argument("--seconds", type=float, default=0.0, help="sampler alone: time each kernel cell this long")
    parser.add_argument("--kernel-only", action="store_true", help="sampler alone: skip the PyTorch path")
    parser.add_argument("--runs", type=int, default=3, help="end to end: runs of each cell (0: skip)")
    args = parser.parse_args()
    settings = [name.strip() for name in args.settings.split(";") if name.strip()]
    if unknown := [name for name in settings if name not in SETTINGS]:
        parser.error(f"unknown settings {unknown}; known: {'; '.join(SETTINGS)}")
    rows = [int(r) for r in args.rows.split(",")]
    sampler_alone(rows, args.logits.split(","), settings, args.seconds, args.kernel_only)
    if args.runs:
        end_to_end(args.num_prompts, args.input_len, args.output_len, args.runs)


if __name__ == "__main__":
    main()
