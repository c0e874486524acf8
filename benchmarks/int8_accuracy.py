"""Accuracy of ``--quantization int8`` against the unquantized model (issue 15's gate), on the default model:
greedy outputs of 32 chat prompts x 64 tokens from both, then the candidate's logits on the reference's
own sequences (teacher-forced), so one early divergence does not hide the rest. Never run by CI.

    .venv/bin/python benchmarks/int8_accuracy.py --output benchmarks/results/int8-accuracy.json
    # the same measures for bfloat16 against float32, for scale:
    .venv/bin/python benchmarks/int8_accuracy.py --reference dtype=float32 --candidate dtype=bfloat16

Reports: greedy agreement (tokens equal before the first divergence, over all tokens), sequences equal,
teacher-forced top-1 agreement, and the largest logit error (absolute, and over the logit range).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from qwenbatch import LLM, SamplingParams

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain the difference between a process and a thread.",
    "What does the SQL keyword HAVING do? Give an example.",
    "Write a bash one-liner that counts lines in all .py files under a folder.",
    "Summarize what a hash map is in two sentences.",
    "Write a C function that returns the length of a string without strlen.",
    "How do I read a JSON file in JavaScript with Node.js?",
    "What is the time complexity of binary search, and why?",
    "Write a regular expression that matches an IPv4 address.",
    "Explain what a race condition is, with a short example.",
    "Write a Rust function that sums a vector of i32.",
    "What is the difference between git merge and git rebase?",
    "Write a Python class for a stack with push, pop and peek.",
    "Explain recursion to a beginner.",
    "Write a SQL query that finds the second highest salary in a table employees.",
    "What is a closure in Python? Show an example.",
    "Write a Go program that prints the numbers 1 to 10.",
    "Explain how HTTPS keeps a connection private.",
    "Write a function that checks whether a string is a palindrome, in Java.",
    "What does the 'volatile' keyword mean in C?",
    "Write a Python generator that yields Fibonacci numbers.",
    "Explain the CAP theorem briefly.",
    "Write a Dockerfile for a small Flask app.",
    "What is the difference between a list and a tuple in Python?",
    "Write quicksort in Haskell.",
    "How does garbage collection work in Java, in a few sentences?",
    "Write a TypeScript interface for a user with a name, an email and an optional age.",
    "Explain what an index does in a database.",
    "Write a Python script that downloads a web page and prints its title.",
    "What is Big-O notation?",
    "Write a function in C++ that swaps two integers using references.",
    "Explain the difference between TCP and UDP.",
]


def engine_settings(text: str) -> dict[str, str]:
    """'dtype=bfloat16,quantization=int8' -> LLM keyword arguments."""
    return dict(item.split("=", 1) for item in text.split(",") if item)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reference", type=engine_settings, default="dtype=auto", help="LLM settings, k=v,...")
    parser.add_argument(
        "--candidate", type=engine_settings, default="dtype=auto,quantization=int8", help="LLM settings, k=v,..."
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    ref = LLM(model="default", max_num_seqs=len(PROMPTS), **args.reference)
    quant = LLM(model="default", max_num_seqs=len(PROMPTS), **args.candidate)
    ref_out = ref.chat(conversations, params, use_tqdm=False)
    quant_out = quant.chat(conversations, params, use_tqdm=False)

    prefix_tokens = total_tokens = equal_sequences = forced_agree = forced_total = 0
    max_abs = max_rel = 0.0
    for r, q in zip(ref_out, quant_out, strict=True):
        ref_ids, quant_ids = r.outputs[0].token_ids, q.outputs[0].token_ids
        common = min(len(ref_ids), len(quant_ids))
        same = next((i for i in range(common) if ref_ids[i] != quant_ids[i]), common)
        prefix_tokens += same
        total_tokens += len(ref_ids)
        equal_sequences += list(ref_ids) == list(quant_ids)
        sequence = list(r.prompt_token_ids) + list(ref_ids)
        start = len(r.prompt_token_ids) - 1  # the logits that chose each output token
        ref_logits = ref.engine.runner.sequence_logits(sequence)[start:-1]
        quant_logits = quant.engine.runner.sequence_logits(sequence)[start:-1]
        forced_agree += int((ref_logits.argmax(-1) == quant_logits.argmax(-1)).sum())
        forced_total += ref_logits.shape[0]
        err = (ref_logits - quant_logits).abs().amax(-1)
        spread = ref_logits.amax(-1) - ref_logits.amin(-1)
        max_abs = max(max_abs, float(err.max()))
        max_rel = max(max_rel, float((err / spread).max()))
    report = {
        "reference": {**args.reference, "linear_kernels": ref.engine.runner.linear_kernels},
        "candidate": {**args.candidate, "linear_kernels": quant.engine.runner.linear_kernels},
        "threads": torch.get_num_threads(),
        "prompts": len(PROMPTS),
        "max_tokens": args.max_tokens,
        "greedy_agreement": prefix_tokens / total_tokens,
        "sequences_equal": equal_sequences,
        "teacher_forced_top1_agreement": forced_agree / forced_total,
        "max_logit_abs_error": max_abs,
        "max_logit_error_over_range": max_rel,
    }
    print(json.dumps(report, indent=2))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
