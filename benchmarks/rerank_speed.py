"""Reranking pairs/s: LLM.score against the Qwen3-Reranker model card's transformers method.

Random weights of the Qwen3-0.6B shape (the reranker's shape) are made once with transformers and
saved with the default model's tokenizer (the Qwen vocabulary, which has "yes" and "no"), so both
sides load the very same weights. Documents are random ordinary Qwen tokens decoded to text,
50-400 tokens each. The baseline is the model card's code as the tuning guides tell users to run
it: left padding to the p95 length (`padding="max_length"`, truncation), full logits, best batch
size of a sweep. Ours: packed batches, the prefix cache, two LM-head rows.

    .venv/bin/python benchmarks/rerank_speed.py --docs 64 --queries 4x16 --output benchmarks/results/rerank-float32.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from qwenbatch import LLM
from qwenbatch.loader.default_model import default_model_dir
from qwenbatch.loader.dummy import SHAPES
from qwenbatch.rerank import DEFAULT_INSTRUCTION, PREFIX, SUFFIX

WEIGHTS = Path("/tmp/qwenbatch-bench/qwen3-reranker-0.6b-random")
QUERIES = ["what is a hash table?", "how do I read a csv file in python?", "什么是快速排序？", "best way to learn rust"]


def make_weights(dtype: torch.dtype) -> Path:
    folder = WEIGHTS.with_name(f"{WEIGHTS.name}-{str(dtype).removeprefix('torch.')}")
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = {k: v for k, v in SHAPES["qwen3-reranker-0.6b"].items() if k != "architectures"}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=dtype)
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        src = default_model_dir() / name
        if src.is_file():
            shutil.copy(src, folder / name)
    return folder


def random_documents(tokenizer, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [tokenizer.decode([rng.randrange(1000, 150_000) for _ in range(rng.randint(50, 400))]) for _ in range(count)]


def baseline(folder: Path, dtype: torch.dtype, pairs: list[tuple[str, str]], batch_sizes: list[int]) -> dict:
    """The model card's method at the best batch size; rows padded (and truncated) to the p95 length."""
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
    for size in batch_sizes:
        run(bodies[:size])
    sweep = {}
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


def ours(llm: LLM, pairs: list[tuple[str, str]]) -> dict:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default="none", choices=["none", "int8"], help="ours only")
    parser.add_argument("--docs", type=int, default=256, help="one query against this many documents")
    parser.add_argument("--queries", default="16x64", help="QxD: Q queries, D documents each")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16", help="32 needs ~9 GB for its full logits")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    folder = make_weights(dtype)
    llm = LLM(model=str(folder), dtype=args.dtype, task="rerank", quantization=args.quantization)
    num_queries, per_query = (int(x) for x in args.queries.split("x"))
    workloads = {
        f"1x{args.docs}": [(QUERIES[0], d) for d in random_documents(llm.tokenizer, args.docs, 0)],
        args.queries: [
            (QUERIES[q % len(QUERIES)] + ("" if q < len(QUERIES) else f" ({q})"), d)
            for q in range(num_queries)
            for d in random_documents(llm.tokenizer, per_query, 1000 + q)
        ],
    }
    llm.score(workloads[args.queries][:2], use_tqdm=False)  # warm-up
    result = {"dtype": args.dtype, "quantization": args.quantization, "workloads": {}}
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    for name, pairs in workloads.items():
        mine = ours(llm, pairs)
        theirs = baseline(folder, dtype, pairs, sizes)
        ratio = mine["pairs_per_s"] / theirs["pairs_per_s"]
        result["workloads"][name] = {"qwenbatch": mine, "transformers": theirs, "ratio_pairs_per_s": ratio}
        print(
            f"{name}: qwenbatch {mine['pairs_per_s']:.2f} pairs/s (prefix-cache hit rate "
            f"{mine['prefix_cache_hit_rate']:.0%}), transformers {theirs['pairs_per_s']:.2f} pairs/s at batch "
            f"{theirs['batch_size']} padded to {theirs['p95_max_length']} "
            f"(effective tokens {theirs['effective_token_ratio']:.0%}): ratio {ratio:.2f}x",
            flush=True,
        )
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
