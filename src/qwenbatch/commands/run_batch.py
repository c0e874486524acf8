"""``qwenbatch run-batch``: a batch file through an in-process engine, servers or Ray."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qwenbatch.commands.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register this sub-command on the top-level parser."""
    rb = sub.add_parser(
        "run-batch",
        help="run a batch file (OpenAI Batch JSONL, JSONL of prompts/messages, or text) to a results file",
        description="Run every request of INPUT and append each result to OUTPUT as it finishes. Killed and "
        "started again with the same command, it skips what OUTPUT already holds.",
    )
    rb.add_argument("-i", "--input", required=True, help="input file, or - for stdin")
    rb.add_argument("-o", "--output", required=True, help="results file (OpenAI Batch output lines), or - for stdout")
    rb.add_argument("--input-format", choices=["auto", "openai", "jsonl", "prompts"], default="auto")
    rb.add_argument(
        "--endpoint",
        choices=["chat", "completions", "embeddings"],
        default="chat",
        help="where plain-text prompts go (default chat; embeddings for an embedding model)",
    )
    rb.add_argument("--max-tokens", type=int, help="default max_tokens for lines that set none")
    rb.add_argument("--temperature", type=float, help="default temperature for lines that set none")
    rb.add_argument("--top-p", type=float, help="default top_p for lines that set none")
    rb.add_argument("--server", action="append", default=[], help="send to this OpenAI-compatible server (repeatable)")
    rb.add_argument("--max-concurrency", type=int, default=32, help="requests in flight per server")
    rb.add_argument("--api-key", default=os.environ.get("QWENBATCH_API_KEY"), help="bearer token for --server")
    rb.add_argument("--served-model", help="model name sent to the servers (default: none, their default model)")
    rb.add_argument("--backend", choices=["local", "server", "ray"], help="default: server with --server, else local")
    rb.add_argument("--num-replicas", type=int, default=1, help="ray: engines (one per GPU, or cores split evenly)")
    rb.add_argument("--ray-address", help="ray: a running cluster (default: start a local one)")
    rb.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip what OUTPUT already holds (default); --no-resume starts OUTPUT afresh",
    )
    rb.add_argument("--ordered", action="store_true", help="rewrite OUTPUT in input order at the end")
    rb.add_argument("--normalize-input", action="store_true", help="NFKC, invisible characters, whitespace runs")
    rb.add_argument("--max-input-chars", type=int, help="with --normalize-input: keep the first N characters")
    rb.add_argument(
        "--clean-output", action="store_true", help="strip stock preambles (好的，以下是… / Sure, here is…)"
    )
    rb.add_argument(
        "--bucket-by-length",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send each window of lines shortest prompt first (default off: measured no gain on continuous "
        "batching servers, see BENCHMARKS.md; may help static-batching ones)",
    )
    add_engine_args(rb)
    rb.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise ValueError for a one-line message)."""
    import asyncio
    import shutil
    import tempfile

    from qwenbatch.batch.jsonl import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL
    from qwenbatch.batch.runner import BatchOptions, run_batch

    backend_name = args.backend or ("server" if args.server else "local")
    if backend_name == "server" and not args.server:
        raise ValueError("--backend server needs at least one --server URL")
    if args.max_input_chars is not None and not args.normalize_input:
        raise ValueError("--max-input-chars works with --normalize-input")
    defaults = {
        k: v
        for k, v in {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}.items()
        if v is not None
    }
    options = BatchOptions(
        input_format=args.input_format,
        prompt_url={"chat": CHAT_URL, "completions": COMPLETIONS_URL, "embeddings": EMBEDDINGS_URL}[args.endpoint],
        defaults=defaults,
        resume=args.resume and args.output != "-",
        ordered=args.ordered,
        normalize_input=args.normalize_input,
        max_input_chars=args.max_input_chars,
        clean_output=args.clean_output,
        bucket_by_length=bool(args.bucket_by_length),
    )
    with tempfile.TemporaryDirectory(prefix="qwenbatch-") as tmp:
        if args.input == "-":
            input_path = Path(tmp) / "input.jsonl"
            with open(input_path, "wb") as f:
                shutil.copyfileobj(sys.stdin.buffer, f)
        else:
            input_path = Path(args.input)
            if not input_path.is_file():
                raise FileNotFoundError(f"{input_path}: no such file")
        output_path = Path(tmp) / "output.jsonl" if args.output == "-" else Path(args.output)
        backend = make_backend(backend_name, args)
        summary = asyncio.run(run_batch(input_path, output_path, backend, options))
        if args.output == "-":
            with open(output_path, "rb") as f:
                shutil.copyfileobj(f, sys.stdout.buffer)
            sys.stdout.flush()
    print(summary.format(), file=sys.stderr)
    return 0


def make_backend(name: str, args: argparse.Namespace):
    """The backend ``--backend`` names, built from the flags (the engine loads when the job starts)."""
    if name == "server":
        from qwenbatch.batch.backends import ServersBackend

        return ServersBackend(args.server, args.max_concurrency, args.api_key, args.served_model)
    config = engine_config_from_args(args)
    if name == "ray":
        from qwenbatch.batch.ray_backend import RayBackend

        return RayBackend(config, args.num_replicas, args.ray_address)
    from qwenbatch.batch.backends import in_process_backend

    return in_process_backend(config)
