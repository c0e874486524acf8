"""The sweep of ``qwenbatch tune``: every batch setting measured, failures recorded, a progress bar across.

In-process mode runs each setting in a child process (see ``measure``); server mode changes a live
server's limits with ``POST /config`` and loads it with the serving benchmark's client.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from qwenbatch.bench.stats import percentile
from qwenbatch.bench.workloads import BenchRequest
from qwenbatch.config import EngineConfig
from qwenbatch.tune.measure import Measurement, write_job

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setting:
    system: str  # "qwenbatch" or "transformers"
    max_num_seqs: int
    max_num_batched_tokens: int | None

    @property
    def slug(self) -> str:
        budget = "" if self.max_num_batched_tokens is None else f"-t{self.max_num_batched_tokens}"
        return f"{self.system}-s{self.max_num_seqs}{budget}"


def settings_grid(max_num_seqs: Iterable[int], budgets: Iterable[int], compare_static: bool = False) -> list[Setting]:
    """Every (max_num_seqs, budget) pair for our engine, then one static run per batch size."""
    seqs, budgets = sorted(set(max_num_seqs)), sorted(set(budgets))
    grid = [Setting("qwenbatch", s, b) for b, s in itertools.product(budgets, seqs)]
    if compare_static:
        grid += [Setting("transformers", s, None) for s in seqs]
    return grid


def run_sweep(
    config: EngineConfig,
    requests: list[BenchRequest],
    settings: list[Setting],
    work_dir: Path,
    timeout_s: float | None = None,
    progress: bool = True,
    repeats: int = 1,
) -> list[Measurement]:
    """Measure every setting in a fresh process, ``repeats`` times (see ``_sweep``); a failed setting is
    recorded with its error and skipped."""
    work_dir.mkdir(parents=True, exist_ok=True)

    def measure(setting: Setting, run: int) -> Measurement:
        return measure_in_child(config, requests, setting, work_dir, timeout_s, run)

    return _sweep(settings, measure, progress, repeats)


def _sweep(
    settings: list[Setting], measure: Callable[[Setting, int], Measurement], progress: bool, repeats: int = 1
) -> list[Measurement]:
    """Each setting ``repeats`` times (``measure(setting, run)``, run 0, 1, ...), one round after another, every
    other round in reverse order so that a host's drift over the sweep falls on every setting alike; one
    Measurement per setting (``combine``). A setting that failed is not run again: it is no pick anyway."""
    if repeats < 1:
        raise ValueError(f"repeats must be positive, got {repeats}")
    order = [(r, s) for r in range(repeats) for s in (settings if r % 2 == 0 else settings[::-1])]
    runs: dict[Setting, list[Measurement]] = {s: [] for s in settings}
    bar = tqdm(order, desc="tune", unit="run", disable=not progress, dynamic_ncols=True)
    for run, setting in bar:
        if any(not m.ok for m in runs[setting]):
            continue
        bar.set_postfix_str(setting.slug)
        result = measure(setting, run)
        if result.ok:
            logger.info(
                "%s: %.1f output tok/s, p95 latency %.2f s", result.label, result.output_tps, result.latency_p95_s
            )
        else:
            logger.warning("%s failed: %s", result.label, result.error)
        runs[setting].append(result)
    return [combine(runs[s]) for s in settings]


def combine(runs: list[Measurement]) -> Measurement:
    """One setting's runs as one: its median run by output tok/s (of an even count, the slower middle one),
    with every run's figure in ``runs_output_tps`` and the highest peak memory of them all. A setting that
    failed in any run is failed: one that only sometimes runs out of memory is no pick."""
    if len(runs) == 1:
        return runs[0]
    failed = [r for r in runs if not r.ok]
    if failed:
        return dataclasses.replace(failed[0], error=f"failed in {len(failed)} of {len(runs)} runs: {failed[0].error}")
    median = sorted(runs, key=lambda r: r.output_tps)[(len(runs) - 1) // 2]
    peaks = [r.peak_memory_mib for r in runs if r.peak_memory_mib is not None]
    return dataclasses.replace(
        median, runs_output_tps=[r.output_tps for r in runs], peak_memory_mib=max(peaks) if peaks else None
    )


def measure_in_child(
    config: EngineConfig,
    requests: list[BenchRequest],
    setting: Setting,
    work_dir: Path,
    timeout_s: float | None,
    run: int = 0,
) -> Measurement:
    """Run ``python -m qwenbatch.tune.measure`` for one setting; its log goes to ``work_dir/<slug>.log`` (the
    first run; ``<slug>-r<run>.log`` for the repeats)."""
    setting_config = dataclasses.replace(
        config,
        max_num_seqs=setting.max_num_seqs,
        max_num_batched_tokens=setting.max_num_batched_tokens or config.resolved_max_num_batched_tokens,
    )
    name = setting.slug + (f"-r{run}" if run else "")
    job, result, log = (work_dir / f"{name}{ext}" for ext in (".job.json", ".result.json", ".log"))
    write_job(job, setting.system, setting_config, requests)
    result.unlink(missing_ok=True)
    failed = Measurement(setting.system, setting.max_num_seqs, setting.max_num_batched_tokens, requests=len(requests))
    with open(log, "w") as log_file:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "qwenbatch.tune.measure", str(job), str(result)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                env={**os.environ, "TQDM_DISABLE": "1"},
            )
        except subprocess.TimeoutExpired:
            return dataclasses.replace(failed, error=f"timed out after {timeout_s:.0f} s")
    job.unlink()
    if proc.returncode == 0 and result.is_file():
        return Measurement.from_dict(json.loads(result.read_text()))
    return dataclasses.replace(failed, error=_failure(proc.returncode, log))


def _failure(returncode: int, log: Path) -> str:
    """One line saying why a measuring process failed: its last error line, or the signal that killed it."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else f"exited with status {returncode}"


def server_limits(url: str, api_key: str | None = None) -> dict:
    """A running server's batch limits, as its ``GET /config`` reports them."""
    with _client(url, api_key) as client:
        config = _check(client.get("/config")).json()
    return {"max_num_seqs": config["max_num_seqs"], "max_num_batched_tokens": config["max_num_batched_tokens"]}


def run_server_sweep(
    url: str,
    requests: list[BenchRequest],
    settings: list[Setting],
    api_key: str | None = None,
    progress: bool = True,
    repeats: int = 1,
) -> list[Measurement]:
    """Sweep a live server: set each setting's limits with ``POST /config``, send every request at once
    (streamed, so TTFT is real), and measure. The server's own limits are put back afterwards."""
    import asyncio

    with _client(url, api_key) as client:
        original = _check(client.get("/config")).json()
        model = _check(client.get("/v1/models")).json()["data"][0]["id"]
        bodies = [("/v1/completions", completion_body(model, r)) for r in requests]

        def measure(setting: Setting, run: int) -> Measurement:
            _set_limits(client, setting.max_num_seqs, setting.max_num_batched_tokens)
            before = _preemptions(client)
            wall, timings = asyncio.run(_load(url, bodies, api_key))
            return _server_measurement(setting, wall, timings, _preemptions(client) - before)

        try:
            return _sweep(settings, measure, progress, repeats)
        finally:
            _set_limits(client, original["max_num_seqs"], original["max_num_batched_tokens"])


def apply_setting(url: str, max_num_seqs: int, max_num_batched_tokens: int, api_key: str | None = None) -> None:
    """Set a running server's batch limits (``POST /config``)."""
    with _client(url, api_key) as client:
        _set_limits(client, max_num_seqs, max_num_batched_tokens)


def _client(url: str, api_key: str | None):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=30)


def _set_limits(client, max_num_seqs: int, max_num_batched_tokens: int | None) -> None:
    limits = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    _check(client.post("/config", json={k: v for k, v in limits.items() if v is not None}))


def completion_body(model: str, r: BenchRequest) -> dict:
    """A request as a greedy ``/v1/completions`` body on its token ids (templates were applied locally)."""
    return {
        "model": model,
        "prompt": r.prompt_token_ids,
        "max_tokens": r.output_len,
        "ignore_eos": r.ignore_eos,
        "temperature": 0,
    }


async def _load(url: str, bodies: list[tuple[str, dict]], api_key: str | None):
    from qwenbatch.bench.serving import run_load

    wall, timings, _ = await run_load(url, bodies, float("inf"), None, float("inf"), api_key, seed=0)
    return wall, timings


def _server_measurement(setting: Setting, wall: float, timings: list, preemptions: int) -> Measurement:
    done = [t for t in timings if t.ok]
    m = Measurement(
        "qwenbatch",
        setting.max_num_seqs,
        setting.max_num_batched_tokens,
        requests=len(timings),
        failed=len(timings) - len(done),
        prompt_tokens=sum(t.prompt_tokens for t in done),
        output_tokens=sum(t.completion_tokens for t in done),
        wall_s=wall,
        preemptions=preemptions,
    )
    if not done:
        errors = {t.error or f"HTTP {t.status}" for t in timings}
        return dataclasses.replace(m, error="every request failed: " + "; ".join(sorted(errors))[:300])
    e2e, ttft = [t.e2e for t in done], [t.ttft for t in done]
    return dataclasses.replace(
        m,
        latency_mean_s=statistics.fmean(e2e),
        latency_p95_s=percentile(e2e, 95),
        ttft_mean_s=statistics.fmean(ttft),
        ttft_p95_s=percentile(ttft, 95),
    )


def _check(response):
    if response.status_code != 200:
        raise ValueError(
            f"{response.request.method} {response.request.url}: HTTP {response.status_code} {response.text}"
        )
    return response


def _preemptions(client) -> int:
    """The server's preemption counter, read from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(_check(client.get("/metrics")).text):
        if family.name == "qwenbatch:num_preemptions":
            return int(sum(sample.value for sample in family.samples if sample.name.endswith("_total")))
    return 0
