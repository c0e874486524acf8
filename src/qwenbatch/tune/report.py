"""The files ``qwenbatch tune`` writes: report.json, report.md, report.png and qwenbatch.toml."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from qwenbatch.config import EngineConfig
from qwenbatch.tune.analysis import WorkloadAnalysis
from qwenbatch.tune.measure import Measurement
from qwenbatch.tune.recommend import Recommendation, Rules

CONFIG_FILE = "qwenbatch.toml"


@dataclass
class TuneReport:
    """Everything one tuning run found."""

    model: str
    workload: str  # the workload name or the input file
    sampled: int  # requests swept (a sample of the analysed workload)
    analysis: WorkloadAnalysis
    measurements: list[Measurement]  # ours and, with --compare-static, transformers
    rules: Rules
    recommendation: Recommendation | None
    no_pick_reason: str | None = None  # why there is no recommendation
    target: str = "in-process"  # or the server's URL

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "workload": self.workload,
            "sampled_requests": self.sampled,
            "target": self.target,
            "analysis": self.analysis.to_dict(),
            "rules": {f.name: getattr(self.rules, f.name) for f in fields(self.rules)},
            "measurements": [m.to_dict() for m in self.measurements],
            "recommendation": self.recommendation.to_dict() if self.recommendation else None,
            "no_pick_reason": self.no_pick_reason,
        }


def write_report(report: TuneReport, config: EngineConfig, out_dir: Path) -> list[Path]:
    """Write the four files (the config file only when there is a pick); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "report.json", out_dir / "report.md", out_dir / "report.png"]
    paths[0].write_text(json.dumps(report.to_dict(), indent=2))
    paths[1].write_text(format_markdown(report))
    plot(report, paths[2])
    if report.recommendation:
        paths.append(out_dir / CONFIG_FILE)
        paths[3].write_text(config_toml(report, config))
    return paths


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def format_markdown(report: TuneReport) -> str:
    """The report as Markdown: workload figures, the sweep table, the pick."""
    a = report.analysis
    lines = [
        f"# qwenbatch tune: {report.model}, {report.workload}",
        "",
        f"{a.num_requests} requests analysed, {report.sampled} swept ({report.target}).",
        "",
        "## Workload",
        "",
        "| prompt tokens | mean | p50 | p95 | p99 | max |",
        "|---|---|---|---|---|---|",
        f"| {a.prompt_tokens} | {a.mean:.1f} | {a.p50} | {a.p95} | {a.p99} | {a.max} |",
        "",
        f"Truncation length the guides recommend (p95): **{a.truncation_length}** tokens.",
    ]
    if a.max_model_len is not None:
        lines.append(
            f"Prompts longer than max_model_len {a.max_model_len}: {a.share_over_max_model_len:.1%} "
            "(a static system truncates them; qwenbatch rejects them with a clear error)."
        )
    lines += [
        "",
        "Static batching's real (non-padding) share of prompt tokens; qwenbatch packs batches, so it pays none:",
        "",
        "| batch size | in input order | length-sorted |",
        "|---|---|---|",
        *(f"| {p.batch_size} | {p.effective_in_order:.1%} | {p.effective_sorted:.1%} |" for p in a.padding),
        "",
        "Largest static batch size keeping ≥ 85% real tokens: "
        f"{a.static_batch_size_at_target or '–'} in input order, {a.static_batch_size_at_target_sorted or '–'} "
        "length-sorted.",
        "",
        "## Sweep",
        "",
        "| system | max_num_seqs | token budget | output tok/s | runs, output tok/s | total tok/s | req/s "
        "| latency mean / p95 s | TTFT mean / p95 s | peak MiB | peak KV | preemptions | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in report.measurements:
        runs = " / ".join(f"{t:.1f}" for t in m.runs_output_tps) or ("one run" if m.ok else "–")
        lines.append(
            f"| {m.system} | {m.max_num_seqs} | {m.max_num_batched_tokens or '–'} | {m.output_tps:.1f} | {runs} | "
            f"{m.total_tps:.1f} | {m.requests_per_s:.2f} | {_fmt(m.latency_mean_s)} / {_fmt(m.latency_p95_s)} | "
            f"{_fmt(m.ttft_mean_s)} / {_fmt(m.ttft_p95_s)} | {_fmt(m.peak_memory_mib, digits=0)} | "
            f"{_fmt(m.peak_kv_usage, 100, 0)}{'%' if m.peak_kv_usage is not None else ''} | {m.preemptions} | "
            f"{m.error or ''} |"
        )
    lines += ["", "## Recommendation", ""]
    r = report.recommendation
    if r is None:
        lines.append(f"No setting qualifies: {report.no_pick_reason}.")
    else:
        lines.append(
            f"**max_num_seqs = {r.pick.max_num_seqs}, max_num_batched_tokens = {r.pick.max_num_batched_tokens}** "
            f"({r.pick.output_tps:.1f} output tok/s, p95 latency {r.pick.latency_p95_s:.2f} s), "
            f"decided by the **{r.decided_by}** rule: {r.reason}."
        )
        if r.runner_up:
            u = r.runner_up
            lines.append(
                f"Runner-up: {u.label} ({u.output_tps:.1f} output tok/s, p95 latency {u.latency_p95_s:.2f} s)."
            )
        lines.append(f"Written to `{CONFIG_FILE}`: `qwenbatch serve --config {CONFIG_FILE}` reads it.")
    return "\n".join(lines) + "\n"


def plot(report: TuneReport, path: Path) -> None:
    """Throughput (top) and p95 latency with peak memory (bottom) against max_num_seqs, the pick marked."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    curves: dict[tuple[str, int | None], list[Measurement]] = {}
    for m in report.measurements:
        if m.ok:
            curves.setdefault((m.system, m.max_num_batched_tokens), []).append(m)
    memory = bottom.twinx()
    for (system, budget), points in curves.items():
        points.sort(key=lambda m: m.max_num_seqs)
        name = system if budget is None else f"{system}, {budget} tokens"
        xs = [m.max_num_seqs for m in points]
        style = "--" if system == "transformers" else "-"
        top.plot(xs, [m.output_tps for m in points], style, marker="o", label=name)
        bottom.plot(xs, [m.latency_p95_s for m in points], style, marker="o", label=f"p95 latency, {name}")
        if all(m.peak_memory_mib is not None for m in points):
            memory.plot(xs, [m.peak_memory_mib for m in points], ":", marker="s", alpha=0.6, label=f"memory, {name}")
    for m in report.measurements:
        if not m.ok:
            top.axvline(m.max_num_seqs, color="red", alpha=0.3, linestyle=":")
    if report.recommendation:
        pick = report.recommendation.pick
        top.scatter([pick.max_num_seqs], [pick.output_tps], s=250, facecolors="none", edgecolors="red", zorder=5)
        top.annotate(
            f"pick ({report.recommendation.decided_by})",
            (pick.max_num_seqs, pick.output_tps),
            textcoords="offset points",
            xytext=(8, -14),
            color="red",
        )
    top.set_xscale("log", base=2)
    swept = sorted({m.max_num_seqs for m in report.measurements})
    top.set_xticks(swept, [str(x) for x in swept])
    top.set_ylabel("output tokens/s")
    top.set_title(f"{report.model}: {report.workload}")
    top.legend(fontsize="small")
    top.grid(alpha=0.3)
    bottom.set_xlabel("max_num_seqs (static batch size for transformers)")
    bottom.set_ylabel("p95 request latency, s")
    memory.set_ylabel("peak memory, MiB")
    handles = [*bottom.get_legend_handles_labels()[0], *memory.get_legend_handles_labels()[0]]
    bottom.legend(handles=handles, fontsize="x-small")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def config_toml(report: TuneReport, config: EngineConfig) -> str:
    """The engine settings to run with: the tuned limits plus the settings the sweep ran under."""
    r = report.recommendation
    values = {f.name: getattr(config, f.name) for f in fields(EngineConfig)}
    values.update(max_num_seqs=r.pick.max_num_seqs, max_num_batched_tokens=r.pick.max_num_batched_tokens)
    defaults = EngineConfig()
    keep = ("model", "dtype", "max_num_seqs", "max_num_batched_tokens")
    lines = [
        f"# Written by qwenbatch tune for {report.workload} ({report.sampled} requests swept).",
        f"# Decided by the {r.decided_by} rule: {r.reason}.",
        "# Read by: qwenbatch serve --config FILE, qwenbatch run-batch --config FILE (flags override it).",
        "",
        "[engine]",
    ]
    for name, value in values.items():
        if value is None or (name not in keep and value == getattr(defaults, name)):
            continue
        lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # JSON string escapes are valid TOML basic-string escapes
