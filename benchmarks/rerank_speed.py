"""Reranking pairs/s: LLM.score against the Qwen3-Reranker model card's transformers method.

Random weights of the Qwen3-0.6B shape (the reranker's shape) are made once with transformers and
saved with the default model's tokenizer (the Qwen vocabulary, which has "yes" and "no"), so both
sides load the very same weights. Documents are random ordinary Qwen tokens decoded to text,
50-400 tokens each. The baseline is the model card's code as the tuning guides tell users to run
it: left padding to the p95 length (`padding="max_length"`, truncation), full logits, best batch
size of a sweep. Ours: packed batches, the prefix cache, two LM-head rows.

Every run is in a fresh process of its own after a warm-up (in one process, whichever system ran second inherited
the first's state), and with ``--repeats N`` each workload runs N rounds of both systems in turn, every other round
in reverse order; each system's row is its run of median time, the ratio the median of the rounds' ratios.

    .venv/bin/python benchmarks/rerank_speed.py --docs 64 --queries 4x16 --repeats 3 \
        --output benchmarks/results/rerank-float32.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from common import random_qwen3_0_6b  # benchmarks/ is on sys.path when this script runs

from qwenbatch import LLM
from qwenbatch.bench.isolation import alternating_rounds, in_fresh_process
from qwenbatch.rerank import DEFAULT_INSTRUCTION, PREFIX, SUFFIX
from qwenbatch.tokenizer import Tokenizer

WEIGHTS = Path("/tmp/qwenbatch-bench/qwen3-reranker-0.6b-random")
QUERIES = ["what is a hash table?", "how do I read a csv file in python?", "什么是快速排序？", "best way to learn rust"]


def make_weights(dtype: torch.dtype) -> Path:
    from transformers import AutoModelForCausalLM

    folder = WEIGHTS.with_name(f"{WEIGHTS.name}-{str(dtype).removeprefix('torch.')}")
    random_qwen3_0_6b(folder, dtype, AutoModelForCausalLM)
    return folder


def random_documents(tokenizer, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [tokenizer.decode([rng.randrange(1000, 150_000) for _ in range(rng.randint(50, 400))]) for _ in range(count)]


def baseline(
    folder: Path, dtype: torch.dtype, pairs: list[tuple[str, str]], batch_sizes: list[int], best: int | None
) -> dict:
    """The model card's method at the best batch size of a sweep over ``batch_sizes`` (at ``best`` without one, after
    an untimed batch of that size); rows padded (and truncated) to the p95 length."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    prefix, suffix = tok.encode(PREFIX, add_special_tokens=False), tok.encode(SUFFIX, add_special_tokens=False)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    bodies = [f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {q}\n<Document>: {d}" for q, d in pairs]
    lengths = sorted(len(tok.encode(b, add_special_tokens=False)) + len(prefix) + len(suffix) for b in bodies)
    max_length = lengths[math.ceil(0.95 * len(lengths)) - 1]  # the guides' p95 max_length

    def run(batch: list[str]) -> list[float]:
        inputs = tok(batch, padding=False, truncation="longest_first", return_attention_mask=False,
                     max_length=max_length - len(prefix) - len(suffix))  # fmt: skip
        inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
        inputs = tok.pad(inputs, padding="max_length", return_tensors="pt", max_length=max_length)
        with torch.inference_mode():
            logits = model(**inputs).logits[:, -1, :]
        scores = torch.stack([logits[:, no], logits[:, yes]], dim=1).float().log_softmax(dim=1)[:, 1].exp()
        return scores.tolist()

    # One untimed batch of each size first: the sweep's first calls in a process ran at half speed (the model's
    # first touches of its memory), so the first workload's sweep picked its batch size by noise (batch 8 at
    # 0.7 pairs/s where batch 2 then ran 1.6).
    for size in batch_sizes if best is None else [best]:
        run(bodies[:size])
    sweep = {}
    if best is None:
        for size in batch_sizes:
            started = time.perf_counter()
            run(bodies[:size])
            sweep[size] = size / (time.perf_counter() - started)
        best = max(sweep, key=sweep.get)
    started = time.perf_counter()
    scores = [s for i in range(0, len(bodies), best) for s in run(bodies[i : i + best])]
    wall = time.perf_counter() - started
    real = sum(min(n, max_length) for n in lengths)
    return {
        "pairs": len(pairs),
        "batch_size": best,
        "sweep_pairs_per_s": sweep,
        "p95_max_length": max_length,
        "effective_token_ratio": real / (max_length * len(pairs)),
        "wall_s": wall,
        "pairs_per_s": len(pairs) / wall,
        "scores": scores,
    }


def ours(folder: Path, dtype: str, quantization: str, pairs: list[tuple[str, str]]) -> dict:
    """``LLM.score`` over ``pairs`` after loading and a two-pair warm-up of other documents."""
    llm = LLM(model=str(folder), dtype=dtype, task="rerank", quantization=quantization)
    llm.score([("a warm-up query", d) for d in random_documents(llm.tokenizer, 2, seed=-1)], use_tqdm=False)
    bm = llm.engine.block_manager
    queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
    started = time.perf_counter()
    scores = llm.score(pairs, use_tqdm=False)
    wall = time.perf_counter() - started
    return {
        "pairs": len(pairs),
        "wall_s": wall,
        "pairs_per_s": len(pairs) / wall,
        "prefix_cache_hit_rate": (bm.prefix_cache_hits - hits) / max(1, bm.prefix_cache_queries - queries),
        "scores": scores,
    }


def compare(args, folder: Path, pairs: list[tuple[str, str]], sizes: list[int]) -> dict:
    """Both systems on ``pairs``, ``args.repeats`` rounds in turn, each run in a fresh process; transformers' batch
    size is swept in the first round only."""
    runs: dict[str, list[dict]] = {"qwenbatch": [], "transformers": []}
    for _, system in alternating_rounds(list(runs), args.repeats):
        if system == "qwenbatch":
            runs[system].append(in_fresh_process(ours, folder, args.dtype, args.quantization, pairs))
        else:
            best = runs[system][0]["batch_size"] if runs[system] else None
            runs[system].append(in_fresh_process(baseline, folder, getattr(torch, args.dtype), pairs, sizes, best))
    result: dict = {}
    for system, system_runs in runs.items():
        median = sorted(system_runs, key=lambda r: r["wall_s"])[(len(system_runs) - 1) // 2]
        result[system] = {**median, "run_pairs_per_s": [r["pairs_per_s"] for r in system_runs]}
    result["transformers"]["sweep_pairs_per_s"] = runs["transformers"][0]["sweep_pairs_per_s"]  # round 1's
    ratios = [a["pairs_per_s"] / b["pairs_per_s"] for a, b in zip(runs["qwenbatch"], runs["transformers"], strict=True)]
    return {**result, "run_ratios_pairs_per_s": ratios, "ratio_pairs_per_s": statistics.median(ratios)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default="none", choices=["none", "int8"], help="ours only")
    parser.add_argument("--docs", type=int, default=256, help="one query against this many documents")
    parser.add_argument("--queries", default="16x64", help="QxD: Q queries, D documents each")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16", help="32 needs ~9 GB for its full logits")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of both systems per workload")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    folder = make_weights(getattr(torch, args.dtype))
    tokenizer = Tokenizer(folder)
    num_queries, per_query = (int(x) for x in args.queries.split("x"))
    workloads = {
        f"1x{args.docs}": [(QUERIES[0], d) for d in random_documents(tokenizer, args.docs, 0)],
        args.queries: [
            (QUERIES[q % len(QUERIES)] + ("" if q < len(QUERIES) else f" ({q})"), d)
            for q in range(num_queries)
            for d in random_documents(tokenizer, per_query, 1000 + q)
        ],
    }
    result = {"dtype": args.dtype, "quantization": args.quantization, "repeats": args.repeats, "workloads": {}}
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    for name, pairs in workloads.items():
        result["workloads"][name] = compared = compare(args, folder, pairs, sizes)
        mine, theirs = compared["qwenbatch"], compared["transformers"]
        rounds = compared["run_ratios_pairs_per_s"]
        print(
            f"{name}: qwenbatch {mine['pairs_per_s']:.2f} pairs/s (prefix-cache hit rate "
            f"{mine['prefix_cache_hit_rate']:.0%}), transformers {theirs['pairs_per_s']:.2f} pairs/s at batch "
            f"{theirs['batch_size']} padded to {theirs['p95_max_length']} "
            f"(effective tokens {theirs['effective_token_ratio']:.0%}): ratio {compared['ratio_pairs_per_s']:.2f}x"
            + (f" (rounds: {', '.join(f'{r:.2f}' for r in rounds)})" if len(rounds) > 1 else ""),
            flush=True,
        )
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
