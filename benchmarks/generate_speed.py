"""Greedy decode speed of qwenbatch beside transformers.generate on the same prompts, in one run.

    python benchmarks/generate_speed.py --dtype bfloat16 --batch-sizes 1,16 --repeats 3

Both sides load the same weights (the default model's cached float32 folder), generate exactly
``--max-tokens`` tokens per prompt (eos ignored), and are timed alternately; the table reports the
median of ``--repeats`` runs and the ratio ours / transformers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch
from common import CHAT_INSTRUCTIONS, median_time

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.baseline import load_hf_model, run_static
from qwenbatch.bench.workloads import BenchRequest
from qwenbatch.loader.default_model import default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", help="write the results as JSON here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(torch.get_num_threads())

    folder = default_model_dir()
    dtype = getattr(torch, args.dtype)
    llm = LLM(model=str(folder), dtype=args.dtype)
    hf = load_hf_model(folder, dtype)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHAT_INSTRUCTIONS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        batch = (prompts * (bs // len(prompts) + 1))[:bs]
        ours_s, _ = median_time(lambda b=batch: llm.generate(b, params, use_tqdm=False), args.repeats)
        static = [BenchRequest(p, args.max_tokens) for p in batch]
        hf_s, _ = median_time(lambda r=static, n=bs: run_static(hf, r, n, pad_id=151643), args.repeats)
        tokens = bs * args.max_tokens
        rows.append(
            {
                "batch": bs,
                "dtype": args.dtype,
                "prompt_tokens": sum(map(len, batch)),
                "output_tokens": tokens,
                "ours_tok_s": tokens / ours_s,
                "transformers_tok_s": tokens / hf_s,
                "ratio": hf_s / ours_s,
            }
        )
    print(f"{'batch':>5} {'dtype':>9} {'ours tok/s':>11} {'HF tok/s':>9} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['dtype']:>9} {r['ours_tok_s']:>11.1f} {r['transformers_tok_s']:>9.1f} "
            f"{r['ratio']:>6.2f}"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
