"""The throughput benchmark's report: run the systems, collect one dict, format it as a table."""

from __future__ import annotations

import math
import statistics

from qwenbatch.bench import throughput
from qwenbatch.bench.isolation import alternating_rounds, in_fresh_process
from qwenbatch.bench.machine import cpu_kind, describe_cpu, gemm_gflops
from qwenbatch.bench.workloads import BenchRequest
from qwenbatch.config import EngineConfig


def throughput_report(
    config: EngineConfig,
    workload: str,
    requests: list[BenchRequest],
    baseline_sizes: list[int] | None,
    compare_prefix_caching: bool,
    batch1: bool,
    llama_cpp: bool = False,
    repeats: int = 1,
) -> dict:
    """Run ours (and optionally ours without prefix caching, batch 1, transformers, llama.cpp): in this process
    where ours runs alone, else each system's run in a fresh process of its own.

    Keys: workload, machine, repeats, systems (per system: requests, prompt/output tokens, wall_s,
    output_tps, total_tps, peak_rss_mib, extra), model_gflops_fraction_of_gemm, and when asked
    prefix_caching_speedup, batch1, ratio_output_tps (ours / transformers), ratio_output_tps_llama_cpp.

    With ``repeats`` > 1 ours and each baseline run that many times, in turn, every other round in reverse order
    (a drift of the machine's speed falls on all of them alike). A system's row is its run of median wall time
    (``extra["run_walls_s"]`` has them all), each ratio the median of the rounds' ratios (listed in
    ``run_ratios_output_tps`` and ``run_ratios_output_tps_llama_cpp``); transformers' batch size is swept in the
    first round only, and the prefix-caching comparison and batch 1 run there only.
    """
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    gemm_samples = [gemm_gflops(config.torch_dtype)]
    dtype_name = str(config.torch_dtype).removeprefix("torch.")
    machine = {"cpu": cpu_kind(), "gemm_dtype": dtype_name}
    report: dict = {"workload": workload, "machine": machine, "repeats": repeats}
    ours_runs: list[throughput.SystemResult] = []
    base_runs: list[throughput.SystemResult] = []
    llama_runs: list[throughput.SystemResult] = []
    extra_rows = []
    isolated = repeats > 1 or bool(baseline_sizes) or llama_cpp

    def ours_once(first: bool) -> None:
        run = _call(
            isolated,
            throughput.run_ours_and_extras,
            config,
            requests,
            first and compare_prefix_caching,
            first and batch1,
        )
        ours_runs.append(run.result)
        if run.flipped is not None:
            extra_rows.append(run.flipped)
            report["prefix_caching_speedup"] = run.prefix_caching_speedup
        if run.batch1 is not None:
            report["batch1"] = run.batch1

    def transformers_once(first: bool) -> None:
        best = None if first else base_runs[0].extra["best_batch_size"]
        base_runs.append(_call(isolated, throughput.run_transformers, config, requests, baseline_sizes, best))

    def llama_cpp_once(first: bool) -> None:
        from qwenbatch.bench.llama_cpp import run_llama_cpp

        llama_runs.append(_call(isolated, run_llama_cpp, config.model, requests, config.resolved_max_num_seqs))

    systems = [ours_once, *([transformers_once] if baseline_sizes else []), *([llama_cpp_once] if llama_cpp else [])]
    for round_, system in alternating_rounds(systems, repeats):
        system(first=round_ == 0)
        gemm_samples.append(gemm_gflops(config.torch_dtype))
    ours = _median_run(ours_runs)
    results = [ours, *extra_rows]
    for key, runs_key, runs_of in (
        ("ratio_output_tps", "run_ratios_output_tps", base_runs),
        ("ratio_output_tps_llama_cpp", "run_ratios_output_tps_llama_cpp", llama_runs),
    ):
        if runs_of:
            results.append(_median_run(runs_of))
            report[runs_key] = [a.output_tps / b.output_tps for a, b in zip(ours_runs, runs_of, strict=True)]
            report[key] = statistics.median(report[runs_key])
    if base_runs:
        # The first round's sweep chose the batch size every round ran at; later rounds only warm up.
        report["baseline_batch_size"] = base_runs[0].extra["best_batch_size"]
        report["baseline_sweep"] = base_runs[0].extra["sweep"]
        report["baseline_runs_swept"] = sum(1 for run in base_runs if run.extra["sweep"])
    # The matmul rate before and after every run: the host's speed drifts by ±8% between runs, and the fastest
    # sample is the machine's rate, which the model's FLOP/s is a fraction of.
    gemm = max(gemm_samples)
    report["machine"].update(gemm_2048_gflops=gemm, gemm_2048_gflops_samples=gemm_samples)
    report["systems"] = [r.to_dict() for r in results]
    report["model_gflops_fraction_of_gemm"] = ours.extra["model_gflops"] / gemm
    return report


def _call(isolated: bool, fn, *args):
    """``fn(*args)``, in a fresh process where ``isolated``."""
    return in_fresh_process(fn, *args) if isolated else fn(*args)


def _median_run(runs: list[throughput.SystemResult]) -> throughput.SystemResult:
    """The run of median wall time (the faster of the middle two where there is an even number), with every run's
    wall time and end in ``extra["run_walls_s"]`` and ``extra["runs_finished_at"]``."""
    median = sorted(runs, key=lambda r: r.wall_s)[(len(runs) - 1) // 2]
    median.extra["run_walls_s"] = [r.wall_s for r in runs]
    median.extra["runs_finished_at"] = [r.finished_at for r in runs]
    return median


def usd_per_million_output_tokens(output_tps: float, price_per_hour: float) -> float:
    """What a million output tokens cost on a machine rented at ``price_per_hour`` dollars that generates
    ``output_tps`` tokens/s: the price of the hours it takes, price_per_hour / (output_tps * 3600) * 1e6."""
    check_price_per_hour(price_per_hour)
    if not output_tps > 0:
        raise ValueError(f"output tokens/s must be positive to price a run, got {output_tps}")
    return price_per_hour / (output_tps * 3600) * 1e6


def check_price_per_hour(price_per_hour: float) -> None:
    """ValueError unless the price is a finite positive number of dollars an hour."""
    if not (math.isfinite(price_per_hour) and price_per_hour > 0):
        raise ValueError(f"--price-per-hour must be a positive number of dollars, got {price_per_hour}")


def add_costs(report: dict, price_per_hour: float) -> dict:
    """Record ``price_per_hour`` in the report and each system's ``usd_per_million_output_tokens``
    at that price (every system ran on this machine, so each is priced the same); returns the report."""
    check_price_per_hour(price_per_hour)
    report["price_per_hour"] = price_per_hour
    for system in report["systems"]:
        system["usd_per_million_output_tokens"] = usd_per_million_output_tokens(system["output_tps"], price_per_hour)
    return report


def format_report(report: dict) -> str:
    """The report as the table and lines the CLI prints."""
    priced = "price_per_hour" in report
    lines = [
        f"{'system':<34} {'reqs':>5} {'prompt':>7} {'output':>7} {'wall s':>7} {'out tok/s':>10} "
        f"{'tot tok/s':>10} {'peak RSS MiB':>12}" + (f" {'$/1M out':>10}" if priced else "")
    ]
    for r in report["systems"]:
        lines.append(
            f"{r['system']:<34} {r['requests']:>5} {r['prompt_tokens']:>7} {r['output_tokens']:>7} "
            f"{r['wall_s']:>7.1f} {r['output_tps']:>10.1f} {r['total_tps']:>10.1f} "
            f"{r['peak_rss_mib']:>12.0f}" + (f" {r['usd_per_million_output_tokens']:>10.4f}" if priced else "")
        )
    ours, m = report["systems"][0]["extra"], report["machine"]
    lines.append(
        f"model FLOP/s {ours['model_gflops']:.1f} GFLOP/s = "
        f"{100 * report['model_gflops_fraction_of_gemm']:.0f}% of a 2048^3 {m['gemm_dtype']} matmul "
        f"({m['gemm_2048_gflops']:.1f} GFLOP/s); prefix-cache hit rate {ours['prefix_cache_hit_rate']:.1%}"
    )
    if report.get("repeats", 1) > 1:
        lines.append(f"each system's run of median wall time of {report['repeats']}, run in turn; ratios: medians")
    if "ratio_output_tps" in report:
        lines.append(
            f"ratio output tok/s (ours / transformers at batch {report['baseline_batch_size']}): "
            f"{report['ratio_output_tps']:.2f}" + _per_run(report, "run_ratios_output_tps")
        )
    if "ratio_output_tps_llama_cpp" in report:
        lines.append(
            f"ratio output tok/s (ours / llama.cpp): {report['ratio_output_tps_llama_cpp']:.2f}"
            + _per_run(report, "run_ratios_output_tps_llama_cpp")
        )
    attention = f"; prefill attention: {ours['prefill_attention']}" if "prefill_attention" in ours else ""
    attention += f"; decode attention: {ours['decode_attention']}" if "decode_attention" in ours else ""
    lines.append(f"linears: {ours['linear_kernels']}{attention} on {ours['device']}")
    lines.append(f"cpu: {describe_cpu(m['cpu'])}")
    if priced:
        lines.append(
            f"cost at ${report['price_per_hour']:.2f}/hour: $ per 1M output tokens = price per hour / "
            "(output tok/s x 3600) x 1e6"
        )
    if "prefix_caching_speedup" in report:
        lines.append(f"prefix caching speed-up end to end: {report['prefix_caching_speedup']:.2f}x")
    if "batch1" in report:
        b = report["batch1"]
        lines.append(
            f"batch-1 decode: {b['steps_per_s']:.1f} steps/s x {b['weight_bytes_per_step'] / 1e9:.2f} GB = "
            f"{b['achieved_read_gbs']:.1f} GB/s, {100 * b['fraction_of_copy']:.0f}% of copy bandwidth "
            f"({b['copy_bandwidth_gbs']:.1f} GB/s)"
        )
    return "\n".join(lines)


def _per_run(report: dict, key: str) -> str:
    """The rounds' ratios under ``key`` as " (runs: 2.62, 2.91, 2.97)", where the report has more than one."""
    ratios = report.get(key, [])
    return f" (runs: {', '.join(f'{r:.2f}' for r in ratios)})" if len(ratios) > 1 else ""
