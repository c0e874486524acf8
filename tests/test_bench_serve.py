"""`qwenbatch bench serve`: a load generator whose figures add up, against a real server."""

from __future__ import annotations

import json

import pytest

from qwenbatch.bench.serving import check_loopback
from qwenbatch.bench.stats import percentile
from qwenbatch.cli import main


def run_bench(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["bench", "serve", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_bench_serve_reports_consistent_figures(tiny_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code, printed, _ = run_bench(
        capsys, "--url", tiny_server.url, "--num-prompts", "12", "--max-tokens", "6", "--request-rate", "50",
        "--max-concurrency", "4", "--output", str(out),
    )  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["sent"] == 12 and report["completed"] + report["failed"] == report["sent"]
    assert report["failed"] == 0 and report["not_sent"] == 0
    assert 0 < report["output_tokens"] <= 12 * 6
    assert report["ttft_p50_ms"] <= report["ttft_p95_ms"] <= report["ttft_p99_ms"]
    assert report["ttft_p50_ms"] <= report["e2e_p50_ms"]
    assert report["output_tps"] == pytest.approx(report["output_tokens"] / report["wall_s"])
    assert "completed" in printed and "ttft" in printed and "itl" in printed


def test_failures_are_counted_by_status(tiny_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code, _, _ = run_bench(
        capsys, "--url", tiny_server.url, "--num-prompts", "3", "--max-tokens", "2", "--model", "no-such-model",
        "--output", str(out),
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert code == 0
    assert (report["completed"], report["failed"], report["errors_by_status"]) == (0, 3, {"404": 3})
    assert report["ttft_p50_ms"] is None


def test_requests_from_a_batch_file(tiny_server, tmp_path, capsys):
    lines = [
        {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}},
        {"custom_id": "b", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}},
        {"custom_id": "c", "url": "/v1/embeddings", "body": {}},
    ]
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join(json.dumps(line) for line in lines))
    out = tmp_path / "serve.json"
    code, _, _ = run_bench(
        capsys, "--url", tiny_server.url, "--input", str(batch), "--max-tokens", "2", "--output", str(out)
    )
    report = json.loads(out.read_text())
    assert code == 0 and report["sent"] == 2 and report["completed"] == 2
    assert report["output_tokens"] == 3 + 2  # the completion's own max_tokens, the chat line's default


def test_only_loopback_unless_allowed(capsys):
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:8000")
    with pytest.raises(ValueError, match="allow-remote"):
        check_loopback("http://10.1.2.3:8000")
    code, _, err = run_bench(capsys, "--url", "http://example.com:8000")
    assert code == 2
    assert "allow-remote" in err


def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert [percentile(values, q) for q in (0, 50, 95, 100)] == pytest.approx([1.0, 2.5, 3.85, 4.0])
