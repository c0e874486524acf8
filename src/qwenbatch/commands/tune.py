"""``qwenbatch tune``: analyse a workload, sweep batch settings on it, pick one by stated rules, report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qwenbatch.commands.engine_args import add_engine_args, engine_config_from_args
from qwenbatch.settings import parse_bytes

DEFAULT_SEQS = "1,2,4,8,16,32,64"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register this sub-command on the top-level parser."""
    p = sub.add_parser(
        "tune",
        help="sweep batch settings on a workload and pick one",
        description="Analyse a workload (prompt lengths, truncation, static-batch padding), measure every batch "
        "setting on it (each in a fresh process: throughput, latency, TTFT, peak memory, KV usage, preemptions), "
        "pick one by stated rules (memory limit with a 10%% margin, latency SLO, the knee: the smallest setting to "
        "which the fastest adds at most 10%% throughput) and write report.json, report.md, report.png and "
        "qwenbatch.toml (which serve --config and run-batch --config read).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input", type=Path, help="a run-batch input file (chat / completions lines)")
    src.add_argument("--workload", choices=["cpu-mixed", "shared-prefix", "random"], help="default: cpu-mixed")
    p.add_argument("--num-prompts", type=int, default=64, help="random workload: number of requests")
    p.add_argument("--input-len", default="32-512", help="random workload: prompt length or range A-B")
    p.add_argument("--output-len", default="16-128", help="random workload: output length or range C-D")
    p.add_argument("--num-samples", type=int, default=64, help="requests swept (a fixed-seed sample)")
    p.add_argument("--max-tokens", type=int, default=256, help="for input lines that set none")
    p.add_argument(
        "--max-num-seqs", dest="sweep_seqs", type=_int_list, default=_int_list(DEFAULT_SEQS), help=DEFAULT_SEQS
    )
    p.add_argument(
        "--max-num-batched-tokens",
        dest="sweep_budgets",
        type=_int_list,
        help="token budgets (default: the engine's; with --server, the server's)",
    )
    p.add_argument("--memory-limit", type=parse_bytes, help="e.g. 20GiB (default: this machine's memory)")
    p.add_argument("--latency-slo-ms", type=float, help="p95 request latency the pick must meet")
    p.add_argument("--output", type=Path, default=Path("tune-report"), help="the report folder")
    p.add_argument("--compare-static", action="store_true", help="also sweep transformers' static batches")
    p.add_argument("--setting-timeout", type=float, help="seconds one setting may take (default: no limit)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each setting, every other round in reverse order; the median run counts (2-3 on a shared, "
        "noisy machine)",
    )
    p.add_argument("--server", help="sweep a running server's POST /config instead (loopback unless --allow-remote)")
    p.add_argument("--api-key", help="for --server (the admin key, as POST /config needs it)")
    p.add_argument("--apply", action="store_true", help="with --server: leave the server at the pick")
    p.add_argument("--allow-remote", action="store_true")
    add_engine_args(p, sweep=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (bad input raises ValueError for a one-line message)."""
    import psutil
    import torch

    from qwenbatch.tune.analysis import analyze
    from qwenbatch.tune.recommend import NoSettingFits, Rules, recommend
    from qwenbatch.tune.report import TuneReport, write_report
    from qwenbatch.tune.sweep import apply_setting, run_server_sweep, run_sweep, server_limits, settings_grid

    try:
        import matplotlib  # noqa: F401  (the plot is written last; fail before the sweep, not after)
    except ImportError:
        raise ValueError("tune writes a plot and needs matplotlib: pip install 'qwenbatch[tune]'") from None
    if args.num_samples < 1:
        raise ValueError("--num-samples must be positive")
    if args.repeats < 1:
        raise ValueError("--repeats must be positive")
    if args.latency_slo_ms is not None and args.latency_slo_ms <= 0:
        raise ValueError("--latency-slo-ms must be positive")
    if args.server and args.compare_static:
        raise ValueError("--compare-static runs transformers in-process; it cannot be combined with --server")
    config = engine_config_from_args(args)
    workload, model_len = _workload(args, config)
    if args.server and not args.allow_remote:
        from qwenbatch.bench.serving import check_loopback

        check_loopback(args.server)
    # The budget the engine runs with: against a server, its own (this machine's default may differ from its).
    own = server_limits(args.server, args.api_key)["max_num_batched_tokens"] if args.server else None
    budgets = args.sweep_budgets or [own or config.resolved_max_num_batched_tokens]
    analysis = analyze(workload.prompt_lengths, args.sweep_seqs, model_len)
    settings = settings_grid(args.sweep_seqs, budgets, args.compare_static)
    if args.server:
        measurements = run_server_sweep(args.server, workload.sample, settings, args.api_key, repeats=args.repeats)
    else:
        measurements = run_sweep(
            config, workload.sample, settings, args.output / "runs", args.setting_timeout, repeats=args.repeats
        )
    # On CUDA the limit is GPU memory, as the measurements are.
    on_gpu = config.resolved_device.type == "cuda" and not args.server
    limit = args.memory_limit or (torch.cuda.mem_get_info()[1] if on_gpu else psutil.virtual_memory().total)
    slo_s = None if args.latency_slo_ms is None else args.latency_slo_ms / 1000
    rules = Rules(memory_limit_mib=limit / 2**20, latency_slo_s=slo_s)
    try:
        pick, why_not = recommend(measurements, rules), None
    except NoSettingFits as e:
        pick, why_not = None, str(e)
    if pick and args.server and args.apply:
        apply_setting(args.server, pick.pick.max_num_seqs, pick.pick.max_num_batched_tokens, args.api_key)
    report = TuneReport(
        model=config.model,
        workload=workload.name,
        sampled=len(workload.sample),
        analysis=analysis,
        measurements=measurements,
        rules=rules,
        recommendation=pick,
        no_pick_reason=why_not,
        target=args.server or "in-process",
    )
    paths = write_report(report, config, args.output)
    print(_summary(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    if pick is None:
        print(f"qwenbatch: error: no setting qualifies: {why_not}", file=sys.stderr)
        return 1
    return 0


def _workload(args: argparse.Namespace, config):
    """The TuneWorkload and the max_model_len its prompts are checked against."""
    from qwenbatch.bench.workloads import WORKLOADS, parse_range, random_workload
    from qwenbatch.loader import model_config_of, resolve_model_dir
    from qwenbatch.tune.workload import file_workload, sample_workload

    model_config = model_config_of(config)
    model_len = config.max_model_len or model_config.max_position_embeddings
    if args.input is not None:
        from qwenbatch.tokenizer import Tokenizer

        folder = config.tokenizer or (None if config.load_format == "dummy" else config.model)
        tokenizer = Tokenizer(resolve_model_dir(folder)) if folder else None
        return file_workload(args.input, tokenizer, args.max_tokens, args.num_samples), model_len
    name = args.workload or "cpu-mixed"
    vocab = model_config.vocab_size
    if name == "random":
        requests = random_workload(
            args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), vocab_size=vocab
        )
    else:
        requests = WORKLOADS[name](vocab)
    return sample_workload(name, requests, args.num_samples), model_len


def _summary(report) -> str:
    lines = [f"{'setting':<38} {'out tok/s':>10} {'p95 s':>7} {'TTFT p95 s':>10} {'peak MiB':>9}  error"]
    for m in report.measurements:
        ttft = "–" if m.ttft_p95_s is None else f"{m.ttft_p95_s:.2f}"
        mem = "–" if m.peak_memory_mib is None else f"{m.peak_memory_mib:.0f}"
        runs = f"  runs {' / '.join(f'{t:.1f}' for t in m.runs_output_tps)}" if m.runs_output_tps else ""
        lines.append(
            f"{m.label:<38} {m.output_tps:>10.1f} {m.latency_p95_s:>7.2f} {ttft:>10} {mem:>9}  {m.error or ''}{runs}"
        )
    r = report.recommendation
    if r:
        lines.append(f"pick: {r.pick.label} ({r.decided_by}: {r.reason})")
        if r.runner_up:
            lines.append(f"runner-up: {r.runner_up.label} ({r.runner_up.output_tps:.1f} output tok/s)")
    return "\n".join(lines)
