"""The ``qwenbatch`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from qwenbatch.config import EngineConfig, parse_bytes, parse_kv_cache_memory

DEFAULT_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"


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
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of shared prompt prefixes (default: on)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_kv_cache_memory,
        default=None,
        help="KV-cache size in bytes (4GiB) or as a fraction of the memory left after the weights (0.5); default 4GiB",
    )
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
        enable_prefix_caching=args.enable_prefix_caching,
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

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve the model over an OpenAI-compatible API; all requests share one engine. "
        "Flags fall back to QWENBATCH_<FLAG> environment variables (QWENBATCH_API_KEY, QWENBATCH_PORT, ...).",
    )
    env = os.environ.get
    serve.add_argument("--host", default=env("QWENBATCH_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(env("QWENBATCH_PORT", "8000")))
    serve.add_argument("--api-key", default=env("QWENBATCH_API_KEY"), help="require this bearer token")
    serve.add_argument(
        "--admin-api-key", default=env("QWENBATCH_ADMIN_API_KEY"), help="for POST /config (default: --api-key)"
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=env("QWENBATCH_SERVED_MODEL_NAME", "").split() or None,
        help="the names clients use for the model (default: the --model value)",
    )
    serve.add_argument(
        "--max-waiting-seqs",
        type=int,
        default=int(env("QWENBATCH_MAX_WAITING_SEQS", "4096")),
        help="above this many waiting sequences new requests get 503 with Retry-After",
    )
    serve.add_argument(
        "--max-request-body",
        type=parse_bytes,
        default=parse_bytes(env("QWENBATCH_MAX_REQUEST_BODY", "32MiB")),
        help="largest request body (413 above it)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=float(env("QWENBATCH_SHUTDOWN_TIMEOUT", "30")),
        help="on SIGTERM, seconds to let in-flight requests finish",
    )
    add_engine_args(serve)
    serve.set_defaults(func=_serve)

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
        "--endpoint", choices=["chat", "completions"], default="chat", help="where plain-text prompts go (default chat)"
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
        help="send similar prompt lengths together (default: on with --server)",
    )
    add_engine_args(rb)
    rb.set_defaults(func=_run_batch)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, metavar="BENCH")
    tp = bench.add_parser(
        "throughput",
        help="offline throughput of a workload, optionally beside transformers",
        description="Run a fixed-seed workload on our engine (greedy, eos ignored) and, with --baseline, on "
        "transformers.generate at its best static batch size, in the same process; print a table.",
    )
    tp.add_argument("--workload", choices=["cpu-mixed", "shared-prefix", "random"], default="cpu-mixed")
    tp.add_argument("--num-prompts", type=int, default=64, help="random workload: number of requests")
    tp.add_argument("--input-len", default="32-512", help="random workload: prompt length or range A-B")
    tp.add_argument("--output-len", default="16-128", help="random workload: output length or range C-D")
    tp.add_argument("--baseline", choices=["transformers"], help="also run this baseline")
    tp.add_argument("--baseline-batch-sizes", default="1,2,4,8,16,32", help="the baseline's sweep")
    tp.add_argument(
        "--compare-prefix-caching", action="store_true", help="run ours twice, with and without prefix caching"
    )
    tp.add_argument("--batch1", action="store_true", help="also measure batch-1 decode against memory bandwidth")
    tp.add_argument("--output", type=Path, help="write the results as JSON here")
    add_engine_args(tp)
    tp.set_defaults(func=_bench_throughput)
    return parser


def _bench_throughput(args: argparse.Namespace) -> int:
    import json

    from qwenbatch.bench.report import format_report, throughput_report
    from qwenbatch.bench.workloads import WORKLOADS, parse_range, random_workload
    from qwenbatch.loader import model_config_of

    config = engine_config_from_args(args)
    vocab = model_config_of(config).vocab_size  # random prompt tokens must fit the model's vocabulary
    if args.workload == "random":
        requests = random_workload(
            args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab_size=vocab
        )
    else:
        requests = WORKLOADS[args.workload](vocab)
    sizes = [int(s) for s in args.baseline_batch_sizes.split(",")] if args.baseline else None
    report = throughput_report(config, args.workload, requests, sizes, args.compare_prefix_caching, args.batch1)
    print(format_report(report))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal

    try:
        import uvicorn

        from qwenbatch.server.app import ServerSettings, build_app
    except ImportError as e:
        raise ValueError(f"the server needs the server extra: pip install 'qwenbatch[server]' ({e})") from e

    from qwenbatch.loader import check_model_source

    config = engine_config_from_args(args)
    check_model_source(config.model, config.load_format)  # a bad --model fails here, not after listening
    names = args.served_model_name or ([config.model, DEFAULT_MODEL_NAME] if config.model == "default" else None)
    failures: list[BaseException] = []

    def on_fatal(error: BaseException) -> None:
        failures.append(error)
        server.should_exit = True

    settings = ServerSettings(
        served_model_names=names or [],
        api_key=args.api_key,
        admin_api_key=args.admin_api_key,
        max_waiting_seqs=args.max_waiting_seqs,
        max_body_bytes=args.max_request_body,
        on_fatal=on_fatal,
    )
    app = build_app(settings, config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            timeout_graceful_shutdown=args.shutdown_timeout,
            log_level="debug" if args.verbose else "info",
        )
    )
    # uvicorn re-raises the signal it stopped on once it has drained; a handler that does nothing
    # turns that into a normal exit (0) after the graceful shutdown.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if failures:
        print(f"qwenbatch: error: {failures[0]}", file=sys.stderr)
        return 1
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    import asyncio
    import shutil
    import tempfile

    from qwenbatch.batch.jsonl import CHAT_URL, COMPLETIONS_URL
    from qwenbatch.batch.runner import BatchOptions, run_batch, scan

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
        prompt_url=CHAT_URL if args.endpoint == "chat" else COMPLETIONS_URL,
        defaults=defaults,
        resume=args.resume and args.output != "-",
        ordered=args.ordered,
        normalize_input=args.normalize_input,
        max_input_chars=args.max_input_chars,
        clean_output=args.clean_output,
        bucket_by_length=backend_name == "server" if args.bucket_by_length is None else args.bucket_by_length,
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
        scan(input_path, options)  # a file with no valid line fails here, before any model loads
        backend = _batch_backend(backend_name, args)
        summary = asyncio.run(run_batch(input_path, output_path, backend, options))
        if args.output == "-":
            with open(output_path, "rb") as f:
                shutil.copyfileobj(f, sys.stdout.buffer)
            sys.stdout.flush()
    print(summary.format(), file=sys.stderr)
    return 0


def _batch_backend(name: str, args: argparse.Namespace):
    if name == "server":
        from qwenbatch.batch.backends import ServersBackend

        return ServersBackend(args.server, args.max_concurrency, args.api_key, args.served_model)
    config = engine_config_from_args(args)
    if name == "ray":
        from qwenbatch.batch.ray_backend import RayBackend

        return RayBackend(config, args.num_replicas, args.ray_address)
    from qwenbatch.batch.backends import InProcessBackend

    return InProcessBackend(config)


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
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    from qwenbatch.batch.backends import ServersUnavailableError
    from qwenbatch.loader.default_model import DefaultModelError

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, DefaultModelError) as e:
        print(f"qwenbatch: error: {e}", file=sys.stderr)
        return 2
    except ServersUnavailableError as e:
        print(f"qwenbatch: error: {e}; what is done is saved, run the same command again to resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
