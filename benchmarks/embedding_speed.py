"""Embedding texts/s: LLM.embed against the Qwen3-Embedding model card's transformers code.

Random weights of the Qwen3-0.6B shape (Qwen3-Embedding-0.6B's) are made once with transformers and saved as Qwen
ships that model (the backbone alone, config.json naming Qwen3ForCausalLM), with the default model's tokenizer made
to append <|endoftext|> as Qwen3-Embedding's does, so both sides load the very same files. Texts are random ordinary
Qwen tokens decoded, 50-400 tokens each. The baseline is the model card's code: left padding to the batch's longest
text, the last position's hidden state, L2-normalized, at the best batch size of a sweep. Each run in a fresh
process, the order alternated by round. Never run by CI.

    .venv/bin/python benchmarks/embedding_speed.py --texts 256 --repeats 3 --output benchmarks/results/x.json
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
from common import random_qwen3_0_6b  # benchmarks/ is on sys.path when this script runs

from qwenbatch import LLM
from qwenbatch.bench.isolation import alternating_rounds, in_fresh_process
from qwenbatch.bench.machine import cpu_kind

WEIGHTS = Path("/tmp/qwenbatch-bench/Qwen3-Embedding-0.6B-random")


def make_weights(dtype: torch.dtype) -> Path:
    from tokenizers import Tokenizer, processors
    from transformers import AutoModel

    folder = WEIGHTS.with_name(f"{WEIGHTS.name}-{str(dtype).removeprefix('torch.')}")
    if not random_qwen3_0_6b(folder, dtype, AutoModel):
        return folder
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def random_texts(folder: Path, count: int, seed: int = 0) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    rng = random.Random(seed)
    return [tokenizer.decode([rng.randrange(1000, 150_000) for _ in range(rng.randint(50, 400))]) for _ in range(count)]


def ours(folder: Path, dtype: str, texts: list[str]) -> dict:
    llm = LLM(model=str(folder), dtype=dtype)
    llm.embed(texts[:2], use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.embed(texts, use_tqdm=False)
    wall = time.perf_counter() - started
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"wall_s": wall, "tokens": tokens, "vectors": [o.embedding.tolist() for o in outputs]}


def baseline(folder: Path, dtype: str, texts: list[str], sizes: list[int], best: int | None) -> dict:
    """The model card's code at the best batch size of a sweep over ``sizes`` (at ``best`` without one)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), padding_side="left")
    model = AutoModel.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()

    def run(batch: list[str]) -> list[list[float]]:
        inputs = tokenizer(batch, padding=True, truncation=True, max_length=8192, return_tensors="pt")
        with torch.inference_mode():
            states = model(**inputs).last_hidden_state[:, -1]
        return torch.nn.functional.normalize(states.float(), dim=-1).tolist()

    for size in sizes if best is None else [best]:
        run(texts[:size])  # untimed: a process's first calls run slower
    sweep = {}
    if best is None:
        for size in sizes:
            started = time.perf_counter()
            run(texts[: 2 * size])
            sweep[size] = 2 * size / (time.perf_counter() - started)
        best = max(sweep, key=sweep.get)
    started = time.perf_counter()
    vectors = [v for i in range(0, len(texts), best) for v in run(texts[i : i + best])]
    return {"wall_s": time.perf_counter() - started, "batch_size": best, "sweep_texts_per_s": sweep, "vectors": vectors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch-sizes", default="4,8,16,32", help="transformers' sweep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    folder = make_weights(getattr(torch, args.dtype))
    texts = random_texts(folder, args.texts)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    runs: dict[str, list[dict]] = {"qwenbatch": [], "transformers": []}
    for round_, system in alternating_rounds(list(runs), args.repeats):
        if system == "qwenbatch":
            run = in_fresh_process(ours, folder, args.dtype, texts)
        else:
            best = runs[system][0]["batch_size"] if runs[system] else None
            run = in_fresh_process(baseline, folder, args.dtype, texts, sizes, best)
        runs[system].append(run)
        print(
            f"round {round_ + 1} {system}: {run['wall_s']:.2f} s, {len(texts) / run['wall_s']:.1f} texts/s", flush=True
        )
    mine, theirs = torch.tensor(runs["qwenbatch"][0]["vectors"]), torch.tensor(runs["transformers"][0]["vectors"])
    cosine = (mine * theirs).sum(dim=-1)
    walls = {s: [r["wall_s"] for r in system_runs] for s, system_runs in runs.items()}
    ratios = [t / o for o, t in zip(walls["qwenbatch"], walls["transformers"], strict=True)]
    result = {
        "cpu": cpu_kind(),
        "dtype": args.dtype,
        "texts": args.texts,
        "tokens": runs["qwenbatch"][0]["tokens"],
        "wall_s": walls,
        "texts_per_s": {s: args.texts / statistics.median(w) for s, w in walls.items()},
        "transformers_batch_size": runs["transformers"][0]["batch_size"],
        "transformers_sweep_texts_per_s": runs["transformers"][0]["sweep_texts_per_s"],
        "ratio": statistics.median(ratios),
        "run_ratios": ratios,
        "cosine_to_transformers": {"min": cosine.min().item(), "mean": cosine.mean().item()},
    }
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
