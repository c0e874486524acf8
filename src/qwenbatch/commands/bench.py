"""``qwenbatch bench``: the throughput benchmark beside the transformers baseline."""

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
    tp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise ValueError for a one-line message)."""
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
