"""``qwenbatch tune``: workload analysis, the recommendation rules, real sweeps (in-process and against a
server), failures at a setting, and the qwenbatch.toml that serve and run-batch read."""

from __future__ import annotations

import json
import textwrap
import tomllib

import httpx
import pytest

from qwenbatch.bench.workloads import random_workload
from qwenbatch.cli import build_parser, main
from qwenbatch.commands.engine_args import engine_config_from_args
from qwenbatch.models.config import ModelConfig
from qwenbatch.tokenizer import Tokenizer
from qwenbatch.tune.analysis import analyze, effective_token_ratio, nearest_rank
from qwenbatch.tune.measure import Measurement
from qwenbatch.tune.recommend import NoSettingFits, Rules, recommend
from qwenbatch.tune.workload import file_workload

# -- analysis -------------------------------------------------------------------------------------


def write_lines(path, bodies: list[dict], url: str = "/v1/completions") -> None:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": b}) for i, b in enumerate(bodies)]
    path.write_text("\n".join(lines) + "\n")


def test_analysis_of_a_known_file(tmp_path, tiny_qwen3):
    # Twenty prompts of 10, 20, ..., 200 token ids, shuffled so that input order differs from sorted order.
    lengths = [10 * k for k in (3, 1, 4, 15, 9, 2, 6, 5, 20, 8, 7, 10, 12, 11, 14, 13, 16, 18, 17, 19)]
    path = tmp_path / "in.jsonl"
    write_lines(path, [{"prompt": [5] * n, "max_tokens": 8} for n in lengths])
    workload = file_workload(path, Tokenizer(tiny_qwen3), max_tokens=16, num_samples=4)
    assert sorted(workload.prompt_lengths) == sorted(lengths)
    assert len(workload.sample) == 4 and all(r.output_len == 8 and not r.ignore_eos for r in workload.sample)

    a = analyze(workload.prompt_lengths, [1, 2, 4], max_model_len=150)
    assert (a.num_requests, a.prompt_tokens, a.max) == (20, 2100, 200)
    assert (a.p50, a.p95, a.p99) == (100, 190, 200)  # nearest rank: the 10th, 19th and 20th of 20
    assert a.truncation_length == 190
    assert a.share_over_max_model_len == pytest.approx(5 / 20)  # 160..200
    sorted_batch2 = next(p for p in a.padding if p.batch_size == 2).effective_sorted
    assert sorted_batch2 == pytest.approx(2100 / (2 * (20 + 40 + 60 + 80 + 100 + 120 + 140 + 160 + 180 + 200)))
    in_order = {p.batch_size: p.effective_in_order for p in a.padding}
    assert in_order[1] == 1.0
    assert in_order[2] == pytest.approx(effective_token_ratio(lengths, 2))
    assert in_order[4] < in_order[2] < 1.0  # bigger static batches pad more


def test_padding_ratio_and_percentiles_by_hand():
    assert effective_token_ratio([10, 30, 20, 20], 2) == pytest.approx(80 / (2 * 30 + 2 * 20))
    assert [nearest_rank([1, 2, 3, 4], q) for q in (25, 50, 95, 100)] == [1, 2, 4, 4]
    # Four short prompts then four long ones: batches of up to 4 are uniform, a batch of 8 pads the short ones.
    a = analyze([10, 10, 10, 10, 50, 50, 50, 50], [1, 2, 4, 8])
    assert [p.effective_in_order for p in a.padding] == [1.0, 1.0, 1.0, pytest.approx(240 / 400)]
    assert a.static_batch_size_at_target == 4
    alternating = analyze([10, 50] * 4, [2, 4])
    assert alternating.static_batch_size_at_target is None  # every pair pads: 60 / 100
    assert alternating.static_batch_size_at_target_sorted == 4  # sorted, the batches are uniform


def test_chat_lines_are_measured_with_the_chat_template(tmp_path, tiny_qwen3):
    tok = Tokenizer(tiny_qwen3)
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    path = tmp_path / "chat.jsonl"
    write_lines(path, [{"messages": messages}], url="/v1/chat/completions")
    workload = file_workload(path, tok, max_tokens=12, num_samples=8)
    assert workload.prompt_lengths == [len(tok.encode(tok.apply_chat_template(messages)))]
    assert workload.sample[0].output_len == 12


# -- recommendation rules -------------------------------------------------------------------------


def point(seqs: int, tps: float, p95: float = 1.0, mem: float = 1000.0, budget: int = 2048, error=None):
    """A measurement of ``tps`` output tokens/s (100 s of wall time)."""
    return Measurement(
        "qwenbatch", seqs, budget, requests=10, output_tokens=int(tps * 100), wall_s=100.0,
        latency_p95_s=p95, peak_memory_mib=mem, error=error,
    )  # fmt: skip


CURVE = [point(1, 10, 1.0), point(2, 19, 1.2), point(4, 30, 1.5), point(8, 32, 2.5), point(16, 33, 5.0)]


def test_knee_is_the_smallest_setting_to_which_the_fastest_adds_at_most_10_percent():
    r = recommend(CURVE, Rules())
    assert (r.pick.max_num_seqs, r.decided_by) == (4, "knee")
    assert r.runner_up.max_num_seqs == 16  # the fastest other setting


def test_a_plateau_below_the_fastest_does_not_stop_the_knee_short():
    # The AVX2 kind's int8 cpu-mixed sweep: 2 -> 4 adds 5% (the host's noise), 4 -> 8 another 22%.
    tps = {1: 21.3, 2: 30.6, 4: 32.0, 8: 38.9, 16: 39.1, 32: 34.9, 64: 37.4}
    r = recommend([point(seqs, value) for seqs, value in tps.items()], Rules())
    assert (r.pick.max_num_seqs, r.decided_by) == (8, "knee")
    assert r.runner_up.max_num_seqs == 16


def test_a_faster_setting_over_the_memory_limit_does_not_move_the_knee_below_one_within_it():
    # Without 16 (over the limit) the knee among the rest would be 4 (8 adds under 10% to it); 8 fits and stays.
    curve = [point(4, 31, mem=1000), point(8, 33, mem=1100), point(16, 35, mem=5000)]
    r = recommend(curve, Rules(memory_limit_mib=2000))
    assert (r.pick.max_num_seqs, r.decided_by) == (8, "knee")


def test_max_throughput_when_throughput_never_flattens():
    rising = [point(1, 10), point(2, 20), point(4, 40)]
    r = recommend(rising, Rules())
    assert (r.pick.max_num_seqs, r.decided_by) == (4, "max-throughput")


def test_memory_limit_decides_when_the_knee_does_not_fit():
    curve = [point(1, 10, mem=1000), point(2, 19, mem=2000), point(4, 30, mem=9500), point(8, 31, mem=9800)]
    r = recommend(curve, Rules(memory_limit_mib=10_000))  # 9,500 MiB is over 10,000 less 10%
    assert (r.pick.max_num_seqs, r.decided_by) == (2, "memory-limit")
    assert "9500 MiB" in r.reason


def test_latency_slo_decides_when_the_knee_is_too_slow():
    r = recommend(CURVE, Rules(latency_slo_s=1.3))
    assert (r.pick.max_num_seqs, r.decided_by) == (2, "latency-slo")
    assert r.runner_up.max_num_seqs == 1


def test_failed_settings_are_never_picked_and_no_fit_is_an_error():
    with_failure = [*CURVE[:2], point(4, 0, error="CPU out of memory"), *CURVE[3:]]
    assert recommend(with_failure, Rules()).pick.max_num_seqs != 4
    with pytest.raises(NoSettingFits, match="memory limit"):
        recommend(CURVE, Rules(memory_limit_mib=500))
    with pytest.raises(NoSettingFits, match="ran successfully"):
        recommend([point(1, 0, error="boom")], Rules())


def test_repeated_rounds_alternate_order_and_a_setting_reports_its_median_run():
    from qwenbatch.tune.sweep import Setting, _sweep

    settings = [Setting("qwenbatch", s, 64) for s in (1, 2, 4)]
    drift = iter([10, 20, 30, 31, 21, 11, 12, 22, 32])  # the host slows down over the sweep
    calls = []

    def measure(setting, run):
        calls.append(setting.max_num_seqs)
        return point(setting.max_num_seqs, next(drift), mem=100.0 * len(calls))

    ms = _sweep(settings, measure, progress=False, repeats=3)
    assert calls == [1, 2, 4, 4, 2, 1, 1, 2, 4]  # forward, backward, forward
    assert [m.max_num_seqs for m in ms] == [1, 2, 4]
    assert [m.runs_output_tps for m in ms] == [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    assert [m.output_tps for m in ms] == [11, 21, 31]  # the median run
    assert [m.peak_memory_mib for m in ms] == [700, 800, 900]  # the highest of the runs'
    one = _sweep(settings, lambda s, run: point(s.max_num_seqs, 5), progress=False)
    assert [m.runs_output_tps for m in one] == [[], [], []]


def test_a_setting_that_failed_is_not_run_again():
    from qwenbatch.tune.sweep import Setting, _sweep

    settings = [Setting("qwenbatch", s, 64) for s in (1, 2)]
    calls = []

    def measure(setting, run):
        calls.append((setting.max_num_seqs, run))
        return point(setting.max_num_seqs, 0, error="CPU out of memory") if setting.max_num_seqs == 2 else point(1, 9)

    ms = _sweep(settings, measure, progress=False, repeats=3)
    assert calls == [(1, 0), (2, 0), (1, 1), (1, 2)]
    assert ms[0].runs_output_tps == [9, 9, 9] and ms[1].error == "CPU out of memory"


def test_a_setting_that_fails_in_one_run_of_several_is_failed():
    from qwenbatch.tune.sweep import combine

    m = combine([point(4, 30), point(4, 0, error="CPU out of memory"), point(4, 31)])
    assert not m.ok and m.error == "failed in 1 of 3 runs: CPU out of memory"
    even = combine([point(2, 20), point(2, 24)])
    assert even.output_tps == 20 and even.runs_output_tps == [20, 24]  # the slower middle run


# -- real sweeps ----------------------------------------------------------------------------------

TINY_RANDOM = ["--workload", "random", "--num-prompts", "6", "--input-len", "8-24", "--output-len", "4-6"]


def test_tiny_sweep_end_to_end_writes_all_four_files(tiny_qwen3, tmp_path, capsys):
    from matplotlib.image import imread

    vocab = ModelConfig.from_folder(tiny_qwen3).vocab_size
    workload = random_workload(6, (8, 24), (4, 6), vocab_size=vocab)  # what TINY_RANDOM asks for
    out = tmp_path / "report"
    argv = ["tune", "--model", str(tiny_qwen3), "--dtype", "float32", "--kv-cache-memory", "16MiB", *TINY_RANDOM]
    code = main([*argv, "--max-num-seqs", "1,2", "--compare-static", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    ms = report["measurements"]
    assert [(m["system"], m["max_num_seqs"]) for m in ms] == [
        ("qwenbatch", 1), ("qwenbatch", 2), ("transformers", 1), ("transformers", 2),
    ]  # fmt: skip
    for m in ms:
        assert m["error"] is None
        assert m["requests"] == 6 and m["output_tokens"] == sum(r.output_len for r in workload)  # eos ignored
        assert m["output_tps"] > 0 and m["wall_s"] > 0 and m["peak_memory_mib"] > 0
        assert 0 < m["latency_mean_s"] <= m["latency_p95_s"] <= m["wall_s"] * 1.01
    ours = [m for m in ms if m["system"] == "qwenbatch"]
    assert all(0 < m["ttft_p95_s"] <= m["latency_p95_s"] and 0 < m["peak_kv_usage"] <= 1 for m in ours)
    assert report["analysis"]["num_requests"] == 6
    pick = report["recommendation"]
    assert pick["decided_by"] in ("knee", "max-throughput")

    toml = tomllib.loads((out / "qwenbatch.toml").read_text())["engine"]
    assert toml["max_num_seqs"] == pick["max_num_seqs"] and toml["model"] == str(tiny_qwen3)
    assert toml["kv_cache_memory"] == 16 * 2**20
    assert f"max_num_seqs = {pick['max_num_seqs']}" in (out / "report.md").read_text()
    image = imread(out / "report.png")
    assert image.shape[0] > 300 and image.shape[1] > 300
    assert image[..., :3].std() > 0.05  # lines and text, not a blank canvas
    assert "pick:" in capsys.readouterr().out


def test_a_repeated_sweep_reports_each_run(tiny_qwen3, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["tune", "--model", str(tiny_qwen3), "--dtype", "float32", "--kv-cache-memory", "16MiB", *TINY_RANDOM]
    assert main([*argv, "--max-num-seqs", "1,2", "--repeats", "2", "--output", str(out)]) == 0
    ms = json.loads((out / "report.json").read_text())["measurements"]
    assert [m["max_num_seqs"] for m in ms] == [1, 2]
    for m in ms:
        assert len(m["runs_output_tps"]) == 2 and all(t > 0 for t in m["runs_output_tps"])
        assert m["output_tps"] == pytest.approx(min(m["runs_output_tps"]))  # of two, the slower
    table = (out / "report.md").read_text()
    assert "runs, output tok/s" in table and " / ".join(f"{t:.1f}" for t in ms[0]["runs_output_tps"]) in table
    assert "runs " in capsys.readouterr().out


FAULTS = """
import os, signal
import torch
from qwenbatch.engine import llm_engine, model_runner

_init, _execute = llm_engine.LLMEngine.__init__, model_runner.ModelRunner.execute

def init(self, config):
    if config.max_num_seqs == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    _init(self, config)

def execute(self, sched, rows):
    if len(sched.scheduled) > 2:
        raise torch.OutOfMemoryError("CPU out of memory (injected)")
    return _execute(self, sched, rows)

llm_engine.LLMEngine.__init__, model_runner.ModelRunner.execute = init, execute
"""


def test_a_setting_that_runs_out_of_memory_is_recorded_and_the_sweep_goes_on(tiny_qwen3, tmp_path, monkeypatch):
    # Faults injected into the measuring processes only (they import sitecustomize at start-up).
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "sitecustomize.py").write_text(textwrap.dedent(FAULTS))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "faults"))
    out = tmp_path / "report"
    argv = ["tune", "--model", str(tiny_qwen3), "--dtype", "float32", "--kv-cache-memory", "16MiB", *TINY_RANDOM]
    assert main([*argv, "--max-num-seqs", "1,2,4,8", "--output", str(out)]) == 0
    ms = {m["max_num_seqs"]: m for m in json.loads((out / "report.json").read_text())["measurements"]}
    assert ms[1]["error"] is None
    assert ms[2]["error"].startswith("killed by SIGKILL")
    assert "CPU out of memory (injected)" in ms[4]["error"] and "CPU out of memory" in ms[8]["error"]
    report = json.loads((out / "report.json").read_text())
    assert report["recommendation"]["max_num_seqs"] == 1
    assert "killed by SIGKILL" in (out / "report.md").read_text()


def test_tune_against_a_running_server_restores_its_limits(tiny_server, tmp_path, capsys):
    before = httpx.get(tiny_server.url + "/config").json()
    out = tmp_path / "report"
    argv = ["tune", "--server", tiny_server.url, "--model", tiny_server.engine.config.model, *TINY_RANDOM]
    assert main([*argv, "--max-num-seqs", "1,4", "--max-num-batched-tokens", "64", "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["target"] == tiny_server.url
    for m in report["measurements"]:
        assert m["error"] is None and m["failed"] == 0 and m["requests"] == 6
        assert m["max_num_batched_tokens"] == 64 and m["output_tokens"] > 0 and m["ttft_p95_s"] > 0
    after = httpx.get(tiny_server.url + "/config").json()
    assert (after["max_num_seqs"], after["max_num_batched_tokens"]) == (
        before["max_num_seqs"],
        before["max_num_batched_tokens"],
    )
    # Without --max-num-batched-tokens the sweep keeps the server's own budget, not this machine's default.
    httpx.post(tiny_server.url + "/config", json={"max_num_batched_tokens": 96})
    assert main([*argv, "--max-num-seqs", "2", "--output", str(out), "--apply"]) == 0
    assert json.loads((out / "report.json").read_text())["measurements"][0]["max_num_batched_tokens"] == 96
    assert httpx.get(tiny_server.url + "/config").json()["max_num_seqs"] == 2
    httpx.post(tiny_server.url + "/config", json={k: before[k] for k in ("max_num_seqs", "max_num_batched_tokens")})


# -- qwenbatch.toml -------------------------------------------------------------------------------


def test_serve_and_run_batch_read_the_config_file_under_their_flags(tmp_path, monkeypatch):
    path = tmp_path / "qwenbatch.toml"
    path.write_text(
        '[engine]\nmodel = "m"\nmax_num_seqs = 12\nmax_num_batched_tokens = 512\nkv_cache_memory = "64MiB"\n'
    )
    monkeypatch.setenv("QWENBATCH_MAX_NUM_BATCHED_TOKENS", "999")  # the file is above the environment
    parser = build_parser()
    serve = engine_config_from_args(parser.parse_args(["serve", "--config", str(path), "--max-num-seqs", "3"]))
    assert (serve.model, serve.max_num_seqs, serve.max_num_batched_tokens) == ("m", 3, 512)
    assert serve.kv_cache_memory == 64 * 2**20
    batch_args = parser.parse_args(["run-batch", "-i", "in.jsonl", "-o", "o.jsonl", "--config", str(path)])
    batch = engine_config_from_args(batch_args)
    assert (batch.max_num_seqs, batch.max_num_batched_tokens) == (12, 512)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[engine]\nmax_num_seq = 4\n", "unknown engine setting 'max_num_seq'"),
        ("[serve]\nport = 1\n", "unknown table"),
        ("[engine\n", "not valid TOML"),
        ("[engine]\nmax_num_seqs = 0\n", "max_num_seqs must be a positive integer"),
    ],
)
def test_a_bad_config_file_is_a_one_line_error(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    write_lines(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    argv = ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--config", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--latency-slo-ms", "0"], "--latency-slo-ms must be positive"),
        (["--num-samples", "0"], "--num-samples must be positive"),
        (["--repeats", "0"], "--repeats must be positive"),
        (["--server", "http://127.0.0.1:1", "--compare-static"], "cannot be combined with --server"),
    ],
)
def test_bad_tune_flags_are_one_line_errors_before_anything_runs(tmp_path, capsys, flags, message):
    assert main(["tune", "--output", str(tmp_path / "r"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_bad_sweep_list_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", "--max-num-seqs", "4,0"])
    assert e.value.code == 2 and "positive integers" in capsys.readouterr().err
