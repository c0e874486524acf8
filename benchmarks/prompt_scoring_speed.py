"""Scoring texts (every token's logprob given those before it, as an evaluation or perplexity job asks): the default
model's prompt_logprobs against the same prompts prefilled without them (what scoring adds to a prefill) and against
transformers' forward + log_softmax (what such a job would otherwise run). Each run in a fresh process, the order
alternated by round; transformers' batch size swept in its first round. Never run by CI.

    .venv/bin/python benchmarks/prompt_scoring_speed.py --texts 64 --repeats 3 --output results/x.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.isolation import alternating_rounds, in_fresh_process
from qwenbatch.bench.machine import cpu_kind
from qwenbatch.loader import resolve_model_dir

SYSTEMS = ("qwenbatch", "qwenbatch-prefill", "transformers")


def texts(count: int, shortest: int, longest: int, seed: int = 0) -> list[list[int]]:
    """``count`` texts of random ids (ordinary tokens of the vocabulary) and random lengths in [shortest, longest]."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 100_000) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]


def ours(dtype: str, prompts: list[list[int]], score: bool) -> dict:
    """The prompts through LLM.generate, one output token each, with prompt_logprobs=1 where ``score``."""
    llm = LLM(dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1 if score else None)
    llm.generate([prompts[0][:16]], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    if not score:
        return {"wall_s": wall, "logprobs": None}
    logprobs = [
        [entry[t] for entry, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
        for out, prompt in zip(outputs, prompts, strict=True)
    ]
    return {"wall_s": wall, "logprobs": logprobs}


def transformers_run(dtype: str, prompts: list[list[int]], sizes: list[int], best: int | None) -> dict:
    """transformers' forward in batches (right-padded, with an attention mask), log_softmax in float32 and each
    token's logprob gathered; batch sizes ``sizes`` swept first unless ``best`` is known."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir("default")), dtype=getattr(torch, dtype)).eval()

    def run(batch_size: int) -> list[list[float]]:
        scores = []
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([p + [0] * (width - len(p)) for p in batch])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
            with torch.inference_mode():
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            scores += [row[: len(p) - 1] for row, p in zip(logprobs.tolist(), batch, strict=True)]
        return scores

    run(1)  # warm-up
    sweep = {}
    if best is None:
        for size in sizes:
            started = time.perf_counter()
            run(size)
            sweep[size] = time.perf_counter() - started
        best = min(sweep, key=sweep.get)
    started = time.perf_counter()
    logprobs = run(best)
    return {"wall_s": time.perf_counter() - started, "batch_size": best, "sweep_s": sweep, "logprobs": logprobs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--lengths", default="128-512", help="shortest-longest text, tokens")
    parser.add_argument("--batch-sizes", default="1,4,8,16", help="transformers' sweep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    shortest, longest = (int(x) for x in args.lengths.split("-"))
    prompts = texts(args.texts, shortest, longest)
    tokens = sum(len(p) for p in prompts)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for round_, system in alternating_rounds(SYSTEMS, args.repeats):
        if system == "transformers":
            best = runs[system][0]["batch_size"] if runs[system] else None
            run = in_fresh_process(transformers_run, args.dtype, prompts, sizes, best)
        else:
            run = in_fresh_process(ours, args.dtype, prompts, system == "qwenbatch")
        runs[system].append(run)
        print(f"round {round_ + 1} {system}: {run['wall_s']:.2f} s, {tokens / run['wall_s']:.0f} tokens/s", flush=True)
    ours_lp = [x for row in runs["qwenbatch"][0]["logprobs"] for x in row]
    theirs_lp = [x for row in runs["transformers"][0]["logprobs"] for x in row]
    errors = [abs(a - b) for a, b in zip(ours_lp, theirs_lp, strict=True)]
    walls = {s: [r["wall_s"] for r in system_runs] for s, system_runs in runs.items()}
    vs_transformers = [t / o for o, t in zip(walls["qwenbatch"], walls["transformers"], strict=True)]
    vs_prefill = [p / o for o, p in zip(walls["qwenbatch"], walls["qwenbatch-prefill"], strict=True)]
    result = {
        "cpu": cpu_kind(),
        "dtype": args.dtype,
        "texts": args.texts,
        "tokens": tokens,
        "wall_s": walls,
        "tokens_per_s": {s: tokens / statistics.median(w) for s, w in walls.items()},
        "transformers_batch_size": runs["transformers"][0]["batch_size"],
        "transformers_sweep_s": runs["transformers"][0]["sweep_s"],
        "ratio_vs_transformers": statistics.median(vs_transformers),
        "run_ratios_vs_transformers": vs_transformers,
        "scoring_over_prefill": statistics.median(vs_prefill),
        "run_ratios_scoring_over_prefill": vs_prefill,
        "logprob_abs_error_vs_transformers": {"max": max(errors), "mean": statistics.fmean(errors)},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "wall_s"}, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
