"""The throughput benchmark end to end on a tiny checkpoint: every option runs and the JSON has its fields."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

from gguf_writer import write_gguf
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
    assert report["machine"]["cpu"]["model"]  # the machine kind beside every figure
    printed = capsys.readouterr().out
    assert "ratio output tok/s" in printed and "\ncpu: " in printed


def test_bench_throughput_repeats_each_system_in_turn_and_reports_the_medians(tiny_qwen2, tmp_path):
    out = tmp_path / "result.json"
    argv = ["bench", "throughput", "--workload", "random", "--num-prompts", "4", "--input-len", "8-20"]
    argv += ["--output-len", "2-3", "--model", str(tiny_qwen2), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    argv += ["--baseline", "transformers", "--baseline-batch-sizes", "1,2", "--repeats", "3", "--output", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["repeats"] == 3
    ours, base = report["systems"]
    ends = sorted(
        [(t, "ours") for t in ours["extra"]["runs_finished_at"]]
        + [(t, "base") for t in base["extra"]["runs_finished_at"]]
    )
    assert [name for _, name in ends] == ["ours", "base", "base", "ours", "ours", "base"]  # every other round reversed
    for system in (ours, base):
        walls = system["extra"]["run_walls_s"]
        assert len(walls) == 3 and system["wall_s"] == sorted(walls)[1]
    # transformers sweeps its batch sizes in the first round only; the report keeps that sweep.
    assert report["baseline_runs_swept"] == 1
    assert [row["batch_size"] for row in report["baseline_sweep"]] == [1, 2]
    assert report["baseline_batch_size"] in (1, 2)
    ratios = report["run_ratios_output_tps"]
    assert len(ratios) == 3 and report["ratio_output_tps"] == statistics.median(ratios)
    # The matmul rate is sampled before and after every run, the fastest sample dividing the model's FLOP/s.
    samples = report["machine"]["gemm_2048_gflops_samples"]
    assert len(samples) == 1 + 6 and report["machine"]["gemm_2048_gflops"] == max(samples)
    assert report["model_gflops_fraction_of_gemm"] == ours["extra"]["model_gflops"] / max(samples)


def test_bench_throughput_refuses_zero_repeats_before_running(capsys, tmp_path):
    assert main(["bench", "throughput", "--repeats", "0", "--model", str(tmp_path / "no-such-model")]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_workloads_are_fixed_by_their_seed():
    assert random_workload(5, (3, 9), (1, 4)) == random_workload(5, (3, 9), (1, 4))
    shared = shared_prefix_workload(4, prefix_len=16, tail_len=(2, 3), output_len=5)
    assert all(r.prompt_token_ids[:16] == shared[0].prompt_token_ids[:16] for r in shared)
    assert parse_range("32-512") == (32, 512) and parse_range("64") == (64, 64)


FAKE_LLAMA_SERVER = '''#!{python}
"""A stand-in for llama.cpp's llama-server: /health, and /completion echoing n_predict; logs its argv."""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
open({log!r}, "a").write(json.dumps(args) + "\\n")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert all(isinstance(t, int) for t in body["prompt"]) and body["ignore_eos"] is True
        sampling = {{k: body[k] for k in ("temperature", "top_p", "top_k", "min_p")}}
        open({log!r}, "a").write(json.dumps(sampling) + "\\n")
        self.reply({{"tokens_predicted": body["n_predict"], "tokens_evaluated": len(body["prompt"])}})


ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
'''


@pytest.fixture
def fake_llama_server(tiny_qwen2, tmp_path, monkeypatch):
    """The tiny checkpoint as a GGUF, and FAKE_LLAMA_SERVER installed as the llama.cpp build: (gguf, its log)."""
    gguf = tmp_path / "tiny.gguf"
    write_gguf(tiny_qwen2, gguf)
    bin_dir, log = tmp_path / "bin", tmp_path / "argv.log"
    bin_dir.mkdir()
    server = bin_dir / "llama-server"
    server.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, log=str(log)))
    server.chmod(0o755)
    monkeypatch.setenv("QWENBATCH_LLAMA_CPP", str(bin_dir))
    return gguf, log


def test_bench_throughput_beside_llama_cpp_sends_it_the_same_requests(fake_llama_server, tmp_path):
    gguf, log = fake_llama_server
    out = tmp_path / "result.json"
    argv = ["bench", "throughput", "--workload", "random", "--num-prompts", "5", "--input-len", "8-20"]
    argv += ["--output-len", "2-4", "--model", str(gguf), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    assert main([*argv, "--max-num-seqs", "3", "--baseline", "llama.cpp", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    ours, theirs = report["systems"]
    assert theirs["system"].startswith("llama.cpp")
    assert theirs["output_tokens"] == ours["output_tokens"] and theirs["prompt_tokens"] == ours["prompt_tokens"]
    assert report["ratio_output_tps_llama_cpp"] == ours["output_tps"] / theirs["output_tps"]
    args = json.loads(log.read_text().splitlines()[0])
    assert args[args.index("-m") + 1] == str(gguf) and args[args.index("-np") + 1] == "3"
    assert args[args.index("--host") + 1] == "127.0.0.1"


def test_bench_throughput_samples_every_system_at_the_asked_temperature(fake_llama_server, tmp_path):
    gguf, log = fake_llama_server
    out = tmp_path / "result.json"
    argv = ["bench", "throughput", "--workload", "random", "--num-prompts", "4", "--input-len", "8-20"]
    argv += ["--output-len", "3", "--model", str(gguf), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    argv += ["--baseline", "transformers", "--baseline-batch-sizes", "2", "--baseline", "llama.cpp"]
    assert main([*argv, "--temperature", "0.8", "--top-p", "0.9", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9}
    assert [s["output_tokens"] for s in report["systems"]] == [12, 12, 12]
    bodies = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert bodies == [{"temperature": 0.8, "top_p": 0.9, "top_k": 0, "min_p": 0.0}] * 4


def test_bench_throughput_refuses_a_bad_top_p_before_running(capsys, tmp_path):
    assert main(["bench", "throughput", "--top-p", "0", "--model", str(tmp_path / "no-such-model")]) == 2
    assert "top_p" in capsys.readouterr().err


def test_llama_cpp_baseline_needs_a_gguf(tiny_qwen2):
    from qwenbatch.bench.llama_cpp import gguf_for

    with pytest.raises(ValueError, match="needs a GGUF"):
        gguf_for(str(tiny_qwen2))


ZEN3_VM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma f16c

processor\t: 1
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma f16c
"""

ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32
CPU implementer\t: 0x41
"""


def test_the_cpu_kind_names_family_and_model_where_the_vm_names_only_the_vendor():
    from qwenbatch.bench.machine import cpu_kind, describe_cpu

    kind = cpu_kind(ZEN3_VM)
    assert kind["model"] == "AMD EPYC" and (kind["family"], kind["model_number"]) == (25, 1)
    assert kind["flags"] == ["avx2"]
    assert describe_cpu(kind).startswith("AMD EPYC (family 25, model 1; avx2), ")
    arm = cpu_kind(ARM)  # no family, no model name, no x86 flags: nothing made up
    assert arm["model"] == "unknown" and "family" not in arm and arm["flags"] == []
    assert describe_cpu(arm) == f"unknown, {arm['machine']}"
