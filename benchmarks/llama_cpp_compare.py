"""Ours beside llama.cpp (llama-batched-bench) on the default model's GGUF, in one run, as issue 15's table:
P parallel sequences of 256 random prompt tokens and 64 output tokens (all at once), batch-1 decode, and
the prefill of one long prompt. Needs `bash benchmarks/build_llama_cpp.sh` first; never run by CI.

    .venv/bin/python benchmarks/llama_cpp_compare.py --output benchmarks/results/llama-cpp-compare.json

Another model: ``--model FOLDER --gguf FILE``, the same weights as llama.cpp's converter wrote them (e.g. a
mixture of experts from benchmarks/random_moe_checkpoint.py, through convert_hf_to_gguf.py --outtype q8_0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.llama_cpp import bin_dir, build_info
from qwenbatch.bench.machine import copy_bandwidth_gbs, cpu_kind, gemm_gflops, read_bandwidth_gbs
from qwenbatch.bench.throughput import matmul_params
from qwenbatch.bench.workloads import random_workload
from qwenbatch.layers.cpu_experts import PackedExperts
from qwenbatch.layers.int8_linear import Int8Linear
from qwenbatch.layers.linear import PackedLinear
from qwenbatch.loader.default_model import default_gguf_path


def llama_batched(gguf: Path, npp: int, ntg: int, npl: list[int]) -> dict[int, dict]:
    """llama-batched-bench rows by parallel count (t: seconds for the whole batch; speed_tg, speed_pp)."""
    ctx = max(npl) * (npp + ntg) + 64
    cmd = [
        str(bin_dir() / "llama-batched-bench"),
        *("-m", str(gguf), "-t", str(torch.get_num_threads()), "-c", str(ctx)),
        *("-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl))),
        *("--output-format", "jsonl"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("{")]
    return {row["pl"]: row for row in rows}


def ours_parallel(llm: LLM, parallel: int, npp: int, ntg: int, run: int = 0) -> float:
    """Seconds for ``parallel`` prompts of ``npp`` random tokens and ``ntg`` outputs each, all queued at once. Each
    ``run`` draws other prompts: a repeat of the same ones would find their prefixes cached."""
    work = random_workload(parallel, (npp, npp), (ntg, ntg), seed=1000 * run + parallel)
    params = SamplingParams(temperature=0, max_tokens=ntg, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([r.prompt_token_ids for r in work], params, use_tqdm=False)
    return time.perf_counter() - start


def ours_decode_tps(llm: LLM, ntg: int = 64) -> float:
    """Batch-1 decode tokens/s: the time of ntg tokens less the time of 1, over ntg - 1."""
    prompt = random_workload(1, (256, 256), (1, 1), seed=7)[0].prompt_token_ids
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=ntg, ignore_eos=True)
    llm.generate([prompt[::-1]], one, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    t1 = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt[1:] + prompt[:1]], many, use_tqdm=False)
    return (ntg - 1) / (time.perf_counter() - start - t1)


def linear_weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of linear weights one batch-1 decode step reads: packed int8 / 5-bit values and their scales, or dense;
    of a mixture of experts, the share of its experts a token runs."""
    total = 0.0
    experts = {name: m for name, m in model.named_modules() if name.endswith(".experts")}
    for name, module in model.named_modules():
        share = 1.0
        owner = name.rsplit(".experts.", 1)[0] + ".experts" if ".experts." in name else None
        if owner in experts:
            share = model.config.moe.experts_per_token / experts[owner].num_experts
        if isinstance(module, PackedExperts):
            total += model.config.moe.experts_per_token / module.num_experts * module.weight_bytes
        elif isinstance(module, Int8Linear):
            total += share * (module.packed_weight.nbytes + module.packed_scales.nbytes)
        elif isinstance(module, torch.nn.Linear | PackedLinear):
            total += share * module.in_features * module.out_features * dtype.itemsize
    return int(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="ours: a model folder (default: the embedded model)")
    parser.add_argument("--gguf", type=Path, help="llama.cpp: the same model's GGUF (default: the embedded model's)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", choices=["none", "int8"])
    parser.add_argument("--parallel", default="1,16,64")
    parser.add_argument("--prefill-lens", default="1024,4096")
    parser.add_argument(
        "--batch1-pairs",
        type=int,
        default=1,
        help="batch-1 decode: this many alternating llama.cpp / ours runs; the median of the pairs' ratios",
    )
    parser.add_argument(
        "--parallel-pairs",
        type=int,
        default=1,
        help="P parallel sequences: this many llama.cpp / ours pairs, alternating; the median of the pairs' ratios",
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    parallel = [int(p) for p in args.parallel.split(",") if p]  # "" for none
    prefill_lens = [int(n) for n in args.prefill_lens.split(",") if n]

    gguf = args.gguf or default_gguf_path()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_seqs=max(parallel, default=2),
        max_model_len=max(prefill_lens, default=256) + 64,
    )
    dtype = llm.engine.dtype
    layer_params, head_params = matmul_params(llm.engine.model_config)
    report: dict = {
        "cpu": cpu_kind(),
        "model": args.model,
        "gguf": str(gguf),
        "dtype": str(dtype).removeprefix("torch."),
        "linear_kernels": llm.engine.runner.linear_kernels,
        "quantization": args.quantization,
        "threads": torch.get_num_threads(),
        "llama_cpp": {k: build_info(bin_dir()).get(k) for k in ("llama_cpp_commit", "cmake_flags")},
        "gemm_2048_gflops_samples": [gemm_gflops(dtype)],
        "copy_bandwidth_gbs": copy_bandwidth_gbs(),
        "read_bandwidth_gbs": read_bandwidth_gbs(),
    }
    ours_parallel(llm, 2, 32, 4)  # warm-up
    rows = []
    for p in parallel:
        # Pairs of one run each, which side goes first alternating: on a shared host the speed drifts between
        # minutes, and a pair's ratio is what survives it.
        pairs = []
        for i in range(args.parallel_pairs):
            if i % 2:
                wall = ours_parallel(llm, p, 256, 64, run=i)
                theirs = llama_batched(gguf, 256, 64, [p])[p]["t"]
            else:
                theirs = llama_batched(gguf, 256, 64, [p])[p]["t"]
                wall = ours_parallel(llm, p, 256, 64, run=i)
            pairs.append({"ours_s": wall, "llama_cpp_s": theirs, "ratio": theirs / wall})
            report["gemm_2048_gflops_samples"].append(gemm_gflops(dtype))
        wall = statistics.median(pair["ours_s"] for pair in pairs)
        flops = 2 * (layer_params * p * (256 + 63) + head_params * p * 64)
        rows.append(
            {
                "parallel": p,
                "ours_s": wall,
                "llama_cpp_s": statistics.median(pair["llama_cpp_s"] for pair in pairs),
                "ours_over_llama_cpp": statistics.median(pair["ratio"] for pair in pairs),
                "ours_model_gflops": flops / wall / 1e9,
                "pairs": pairs,
            }
        )
    # The matmul rate was sampled before and after every pair (the host's speed drifts by ±8% between runs): the
    # fastest sample is the machine's rate, which the model's FLOP/s is a fraction of.
    report["gemm_2048_gflops"] = max(report["gemm_2048_gflops_samples"])
    for row in rows:
        row["ours_fraction_of_gemm"] = row["ours_model_gflops"] / report["gemm_2048_gflops"]
    report["parallel"] = rows
    if args.batch1_pairs:
        # On a shared machine the speed drifts between runs: alternate the two, compare each pair.
        # The read bandwidth, too, moves with the host (42-82 GB/s between runs on one machine): it is sampled before
        # and after every pair, and the fastest sample divides.
        pairs, reads = [], [report["read_bandwidth_gbs"]]
        for _ in range(args.batch1_pairs):
            pairs.append((llama_batched(gguf, 256, 64, [1])[1]["speed_tg"], ours_decode_tps(llm)))
            reads.append(read_bandwidth_gbs())
        report["read_bandwidth_gbs_samples"] = reads
        report["read_bandwidth_gbs"] = max(reads)
        decode_theirs = statistics.median(t for t, _ in pairs)
        decode_ours = statistics.median(o for _, o in pairs)
        weight_bytes = linear_weight_bytes(llm.engine.runner.model, dtype)
        report["batch1_decode"] = {
            "pairs_tps": [{"llama_cpp": t, "ours": o} for t, o in pairs],
            "ours_tps": decode_ours,
            "llama_cpp_tps": decode_theirs,
            "ours_over_llama_cpp": statistics.median(o / t for t, o in pairs),
            "weight_bytes_per_step": weight_bytes,
            "ours_weight_read_gbs": weight_bytes * decode_ours / 1e9,
            "fraction_of_read_bandwidth": weight_bytes * decode_ours / 1e9 / report["read_bandwidth_gbs"],
        }
    prefills = []
    for n in prefill_lens:
        prompt = random_workload(1, (n, n), (1, 1), seed=n)[0].prompt_token_ids
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        ours_s = time.perf_counter() - start
        theirs_pp = llama_batched(gguf, n, 1, [1])[1]
        prefills.append(
            {
                "tokens": n,
                "ours_s": ours_s,
                "ours_tps": n / ours_s,
                "llama_cpp_tps": theirs_pp["speed_pp"],
                "ours_over_llama_cpp": (n / ours_s) / theirs_pp["speed_pp"],
            }
        )
    report["prefill"] = prefills
    print(json.dumps(report, indent=2))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
