"""``qwenbatch generate``: one prompt or a file of prompts, printed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qwenbatch.commands.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register this sub-command on the top-level parser."""
    gen = sub.add_parser(
        "generate",
        help="generate completions for one prompt or a file of prompts",
        description="Generate a completion for PROMPT, or for each line of --input.",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt text")
    gen.add_argument("--input", type=Path, help="a text file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--system", help="system message for --chat")
    gen.add_argument("--no-thinking", action="store_true", help="Qwen3: chat template with enable_thinking=False")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(gen)
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise ValueError for a one-line message)."""
    from qwenbatch.llm import LLM
    from qwenbatch.sampling_params import SamplingParams

    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a PROMPT or --input FILE")
    if args.input is not None:
        prompts = [line for line in args.input.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"{args.input}: no prompts (one per line)")
    else:
        prompts = [args.prompt]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        seed=args.seed,
    )
    config = engine_config_from_args(args)
    llm = LLM(**vars(config))
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        conversations = [[*system, {"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, enable_thinking=False if args.no_thinking else None)
    else:
        outputs = llm.generate(prompts, params)
    failed = 0
    for output in outputs:
        completion = output.outputs[0]
        if completion.error:
            print(f"error: {completion.error}", file=sys.stderr)
            failed += 1
            continue
        print(completion.text if len(prompts) == 1 else completion.text.replace("\n", "\\n"))
    return 1 if failed else 0
