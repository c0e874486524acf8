"""The ``qwenbatch`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from qwenbatch.config import EngineConfig, parse_bytes


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The flags every sub-command that loads a model takes (vLLM's names)."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="'default' (embedded Qwen2.5-Coder-0.5B-Instruct), a Hugging Face folder, a .gguf file, "
        "or with --load-format dummy a shape name (qwen3-0.6b, qwen3-4b, qwen2.5-0.5b)",
    )
    g.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=None,
        help="dummy: random weights of the model's shape, for benchmarks",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help="weights and activations (auto: bfloat16, the fast dtype on CPU)",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV-cache size, e.g. 4GiB")
    g.add_argument("--seed", type=int, default=None)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from flags, falling back to QWENBATCH_* environment variables, then defaults."""
    return EngineConfig.from_env(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwenbatch", description="Batch inference for Qwen models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    gen.set_defaults(func=_generate)
    return parser


def _generate(args: argparse.Namespace) -> int:
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from qwenbatch.loader.default_model import DefaultModelError

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, DefaultModelError) as e:
        print(f"qwenbatch: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
