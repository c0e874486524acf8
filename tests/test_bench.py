"""The throughput benchmark end to end on a tiny checkpoint: every option runs and the JSON has its fields."""

from __future__ import annotations

import json

from qwenbatch.bench.workloads import parse_range, random_workload, shared_prefix_workload
from qwenbatch.cli import main


def test_bench_throughput_with_every_option_writes_a_complete_report(tiny_qwen2, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(
        [
            "bench",
            "throughput",
            "--workload",
            "random",
            "--num-prompts",
            "6",
            "--input-len",
            "8-40",
            "--output-len",
            "3-6",
            "--model",
            str(tiny_qwen2),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "16MiB",
            "--baseline",
            "transformers",
            "--baseline-batch-sizes",
            "1,2",
            "--compare-prefix-caching",
            "--batch1",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    ours, off, base = report["systems"]
    assert [s["system"] for s in report["systems"]] == ["qwenbatch", "qwenbatch (prefix caching off)", "transformers"]
    expected_out = sum(r.output_len for r in random_workload(6, (8, 40), (3, 6), vocab_size=402))
    for system in (ours, off, base):
        assert system["requests"] == 6 and system["output_tokens"] == expected_out
        assert system["output_tps"] > 0 and system["peak_rss_mib"] > 0
    assert report["ratio_output_tps"] == ours["output_tps"] / base["output_tps"]
    assert report["baseline_batch_size"] in (1, 2)
    assert report["batch1"]["fraction_of_copy"] > 0
    assert "ratio output tok/s" in capsys.readouterr().out


def test_workloads_are_fixed_by_their_seed():
    assert random_workload(5, (3, 9), (1, 4)) == random_workload(5, (3, 9), (1, 4))
    shared = shared_prefix_workload(4, prefix_len=16, tail_len=(2, 3), output_len=5)
    assert all(r.prompt_token_ids[:16] == shared[0].prompt_token_ids[:16] for r in shared)
    assert parse_range("32-512") == (32, 512) and parse_range("64") == (64, 64)
