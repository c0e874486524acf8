"""``qwenbatch bench``: offline throughput beside the transformers baseline, and load on a running server."""

from __future__ import annotations

import argparse
from pathlib import Path

from qwenbatch.commands.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register this sub-command on the top-level parser."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, metavar="BENCH")
    tp = bench.add_parser(
        "throughput",
        help="offline throughput of a workload, optionally beside transformers",
        description="Run a fixed-seed workload on our engine (greedy unless --temperature, eos ignored) and, with "
        "--baseline, on "
        "transformers.generate at its best static batch size and/or llama.cpp's llama-server on the same GGUF "
        "(one slot per --max-num-seqs), in the same run; print a table.",
    )
    tp.add_argument("--workload", choices=["cpu-mixed", "shared-prefix", "random"], default="cpu-mixed")
    tp.add_argument("--num-prompts", type=int, default=64, help="random workload: number of requests")
    tp.add_argument("--input-len", default="32-512", help="random workload: prompt length or range A-B")
    tp.add_argument("--output-len", default="16-128", help="random workload: output length or range C-D")
    tp.add_argument(
        "--baseline",
        choices=["transformers", "llama.cpp"],
        action="append",
        help="also run this baseline (may be given twice); llama.cpp: built by benchmarks/build_llama_cpp.sh",
    )
    tp.add_argument("--baseline-batch-sizes", default="1,2,4,8,16,32", help="the baseline's sweep")
    tp.add_argument(
        "--temperature", type=float, default=0.0, help="every system samples at this temperature (default 0: greedy)"
    )
    tp.add_argument("--top-p", type=float, default=1.0, help="with --temperature: every system's top-p")
    tp.add_argument(
        "--compare-prefix-caching", action="store_true", help="run ours twice, with and without prefix caching"
    )
    tp.add_argument("--batch1", action="store_true", help="also measure batch-1 decode against memory bandwidth")
    tp.add_argument(
        "--price-per-hour",
        type=float,
        metavar="USD",
        help="the machine's hourly price in dollars: also print and record each system's $ per 1M output tokens",
    )
    tp.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run ours and each baseline this many times, in turn, every other round in reverse order; report each "
        "system's median run and the median of the rounds' ratios (for a machine whose speed drifts)",
    )
    tp.add_argument("--output", type=Path, help="write the results as JSON here")
    add_engine_args(tp)
    tp.set_defaults(func=run)

    sv = bench.add_parser(
        "serve",
        help="load a running server: Poisson arrivals, streaming, latency percentiles",
        description="Send streamed requests to an OpenAI-compatible server at --request-rate (Poisson; inf: all at "
        "once) with at most --max-concurrency in flight; report throughput and TTFT / inter-token / end-to-end "
        "latency p50/p95/p99, and failures by status code.",
    )
    sv.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback unless --allow-remote)")
    sv.add_argument("--workload", choices=["serve"], default="serve", help="chat requests from 32 instructions")
    sv.add_argument("--input", type=Path, help="instead: a run-batch input file (chat or completions lines)")
    sv.add_argument("--num-prompts", type=int, default=64)
    sv.add_argument("--max-tokens", type=int, default=64, help="for requests that set none")
    sv.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf)")
    sv.add_argument("--max-concurrency", type=int, help="most requests in flight")
    sv.add_argument("--max-duration", type=float, default=600.0, help="send no new request after this many seconds")
    sv.add_argument("--model", help="model name to put in the requests")
    sv.add_argument("--api-key")
    sv.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    sv.add_argument("--seed", type=int, default=0, help="of the arrival times")
    sv.add_argument("--output", type=Path, help="write the report as JSON here")
    sv.set_defaults(func=run_serve)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise ValueError for a one-line message)."""
    import dataclasses
    import json

    from qwenbatch.bench.report import add_costs, check_price_per_hour, format_report, throughput_report
    from qwenbatch.bench.workloads import WORKLOADS, parse_range, random_workload
    from qwenbatch.loader import model_config_of
    from qwenbatch.sampling_params import SamplingParams

    if args.price_per_hour is not None:
        check_price_per_hour(args.price_per_hour)  # before the run, not after minutes of it
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    # Refused before anything loads where bad; a temperature below 1e-5 becomes greedy, as in a request.
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    config = engine_config_from_args(args)
    vocab = model_config_of(config).vocab_size  # random prompt tokens must fit the model's vocabulary
    if args.workload == "random":
        requests = random_workload(
            args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab_size=vocab
        )
    else:
        requests = WORKLOADS[args.workload](vocab)
    requests = [dataclasses.replace(r, temperature=sampling.temperature, top_p=sampling.top_p) for r in requests]
    baselines = args.baseline or []
    sizes = [int(s) for s in args.baseline_batch_sizes.split(",")] if "transformers" in baselines else None
    report = throughput_report(
        config,
        args.workload,
        requests,
        sizes,
        args.compare_prefix_caching,
        args.batch1,
        "llama.cpp" in baselines,
        args.repeats,
    )
    report["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if args.price_per_hour is not None:
        add_costs(report, args.price_per_hour)
    print(format_report(report))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """``bench serve``: build the requests, load the server, print (and write) the report."""
    import asyncio
    import json

    from qwenbatch.bench.serving import check_loopback, format_serve_report, run_load, serve_report
    from qwenbatch.bench.workloads import serve_workload

    if not args.allow_remote:
        check_loopback(args.url)
    if (
        args.num_prompts < 1
        or args.request_rate <= 0
        or (args.max_concurrency is not None and args.max_concurrency < 1)
    ):
        raise ValueError("--num-prompts, --request-rate and --max-concurrency must be positive")
    if args.input is not None:
        requests = _requests_from_file(args.input, args.max_tokens)[: args.num_prompts]
    else:
        requests = serve_workload(args.num_prompts, args.max_tokens)
    if args.model:
        requests = [(url, {**body, "model": args.model}) for url, body in requests]
    wall, timings, not_sent = asyncio.run(
        run_load(
            args.url, requests, args.request_rate, args.max_concurrency, args.max_duration, args.api_key, args.seed
        )
    )
    report = serve_report(wall, timings, not_sent)
    print(format_serve_report(report))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return 0


def _requests_from_file(path: Path, max_tokens: int) -> list[tuple[str, dict]]:
    from qwenbatch.batch.jsonl import CHAT_URL, COMPLETIONS_URL, parse_lines

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, encoding="utf-8-sig") as f:
        lines = parse_lines(f, endpoints=(CHAT_URL, COMPLETIONS_URL), defaults={"max_tokens": max_tokens})
        requests = [(line.url, line.body) for line in lines if line.valid]
    if not requests:
        raise ValueError(f"{path}: no chat or completions request line")
    return requests
