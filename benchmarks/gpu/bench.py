"""The GPU benchmark of issue 14 (run it through run.sh): one call on a lent GPU, under 8 minutes.

(0) greedy tokens equal transformers' on a tiny random Qwen3, float32, graphs and eager;
(a) Qwen3-0.6B shape, dummy bfloat16 weights, 500 prompts x 512 random tokens -> 128, ignore_eos;
(b) nano-vllm's workload: 256 sequences, input and output lengths random in 100-1024, ignore_eos;
(c) transformers.generate on (b) at its best static batch size, same GPU and dtype;
(d) batch-1 decode with CUDA graphs against eager; (e) the sampler at Qwen3's generation config, top-k cut from
torch.topk against a full sort; then, on the GPU, the Triton kernels' tests.
``--smoke`` runs all of it on the CPU with a tiny model and the Triton interpreter, so a lent GPU
never finds a typo. Needs only torch, transformers, tokenizers, safetensors, numpy, tqdm, jinja2,
psutil, xxhash (no server extras, no gguf); pytest for the kernel tests, which are skipped without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time
import traceback
from array import array
from pathlib import Path

import psutil
import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.baseline import best_batch_size, pad_token_id, run_static
from qwenbatch.bench.workloads import BenchRequest, random_workload
from qwenbatch.loader.dummy import SHAPES

TINY = dict(  # the smoke model and the parity model: a few layers, GQA 4/2, head_dim 32
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    initializer_range=0.1,
    eos_token_id=1,
)
SWEEP_OUTPUT_LEN = 64  # tokens a request in transformers' batch-size sweep
# transformers' Qwen3Config of the engine's own dummy shape, so both systems run the same model.
QWEN3_0_6B = {k: v for k, v in SHAPES["qwen3-0.6b"].items() if k != "architectures"}


def tiny_checkpoint(folder: Path) -> Path:
    """A tiny random Qwen3 saved by transformers (config.json + safetensors)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen3Config(**TINY), dtype=torch.float32).save_pretrained(str(folder))
    return folder


def hf_model(shape: dict, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM, Qwen3Config

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_reserved() / 2**30
    return psutil.Process().memory_info().rss / 2**30


def memory_gib(device: str, when: str) -> dict:
    """torch's allocated and reserved GiB now and at their peaks (since the last reset), keys prefixed ``when``:
    the first lease's peak reserved (85.5 GiB) was 22 GiB over what gpu_memory_utilization allowed."""
    if device != "cuda":
        return {}
    stats = {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
    }
    return {f"{when}_{key}_gib": value / 2**30 for key, value in stats.items()}


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def reference_tokens(folder: Path, dtype: torch.dtype, device: str, prompts: list[list[int]], steps: int):
    """transformers' greedy ``steps`` tokens after each prompt, in ``dtype``."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = ref.generate(
                torch.tensor([p], device=device),
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(out[0, len(p) :].tolist())
    del ref
    release(device)
    return expected


def parity(folder: Path, device: str, engine: dict, steps: int) -> dict:
    """(0): our greedy tokens (``steps`` of them), with and without decode graphs, against transformers' in
    float32."""
    prompts = [[5, 17, 42, 99, 3, 250, 7], [300, 12], list(range(10, 200, 3)), [1] * 5 + [200, 201, 202]]
    expected = reference_tokens(folder, torch.float32, device, prompts, steps)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    result = {}
    for eager in (False, True) if device == "cuda" else (True,):
        llm = LLM(model=str(folder), dtype="float32", enforce_eager=eager, **engine)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        result["eager" if eager else "graphs"] = got == expected
        del llm
        release(device)
    return result


def scoring_parity(folder: Path, device: str, engine: dict) -> dict:
    """(0'): prompt logprobs (each prompt token's, chunked at a 16-token budget) and embeddings (task embed: the last
    token's normalized final state) against transformers' in float32; the largest differences."""
    from transformers import AutoModelForCausalLM

    prompt = list(range(10, 200, 3))
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        logprobs = torch.log_softmax(ref(ids).logits[0].float(), dim=-1).cpu()
        state = torch.nn.functional.normalize(ref.model(ids).last_hidden_state[0, -1].float(), dim=-1).cpu()
    del ref
    llm = LLM(model=str(folder), dtype="float32", max_num_batched_tokens=16, **engine)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    del llm
    release(device)
    logprob_error = max(abs(out.prompt_logprobs[i][t] - logprobs[i - 1, t].item()) for i, t in enumerate(prompt) if i)
    llm = LLM(model=str(folder), dtype="float32", task="embed", **engine)
    [embedded] = llm.embed([prompt], use_tqdm=False)
    del llm
    release(device)
    embedding_error = (embedded.embedding - state).abs().max().item()
    return {
        "prompt_logprobs_max_error": logprob_error,
        "embedding_max_error": embedding_error,
        "ok": logprob_error < 1e-3 and embedding_error < 1e-4,
    }


def tiny_moe_checkpoint(folder: Path) -> Path:
    """A tiny random Qwen3-MoE (8 experts, 2 a token, layer 1 dense) saved by transformers, one tensor per expert."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    shape = {**TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**shape, norm_topk_prob=True), dtype=torch.float32)
    model.save_pretrained(str(folder))
    return folder


def moe_parity(folder: Path, device: str, engine: dict, steps: int) -> dict:
    """(0''): a mixture of experts: our float32 greedy tokens (``steps`` of them; experts through torch's
    grouped-matmul fallback, no graphs) against transformers' in float32, and bf16 with decode graphs (the
    one-kernel grouped matmul captured) against transformers in bf16: the share of tokens that agree."""
    prompts = [[5, 17, 42, 99, 3, 250, 7], [300, 12], list(range(10, 200, 3))]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    result = {}
    for dtype in ("float32", "bfloat16"):
        expected = reference_tokens(folder, getattr(torch, dtype), device, prompts, steps)
        llm = LLM(model=str(folder), dtype=dtype, **engine)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        result[f"{dtype}_graphs"] = llm.engine.runner._graphs is not None
        del llm
        release(device)
        same = sum(a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True))
        result[f"{dtype}_agreement"] = same / (steps * len(prompts))
    result["ok"] = result["float32_agreement"] == 1.0
    return result


def run_ours(name: str, requests: list[BenchRequest], engine: dict, device: str) -> dict:
    """One offline run of ``requests`` (temperature 0.6 as nano-vllm's benchmark, eos ignored)."""
    reset_peak(device)  # so that the "before" peaks are this engine's start-up
    llm = LLM(**engine)
    llm.generate([requests[0].prompt_token_ids], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.6, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    memory = memory_gib(device, "before")  # the engine at rest: weights, KV pool, graphs
    execute = StepTimer(llm.engine.runner)
    reset_peak(device)
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    execute.restore()
    result = summary(name, requests, sum(len(o.outputs[0].token_ids) for o in outs), wall, peak_gib(device))
    config = llm.config
    result.update(memory_gib(device, "after"), **memory)
    result.update(
        kv_pool_blocks=llm.engine.block_manager.num_blocks,
        kv_pool_gib=llm.engine.runner.kv_cache_bytes / 2**30,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        steps=execute.steps,
        execute_s=execute.seconds,
        host_outside_execute_s=wall - execute.seconds,
    )
    del llm
    release(device)
    return result


class StepTimer:
    """Times the model runner's ``execute`` (packing, the forward and sampling, up to the tokens' copy to the
    host, which waits for the GPU) so that the rest of a step, the scheduler's and the outputs' Python, shows
    as wall time less it."""

    def __init__(self, runner) -> None:
        self.runner, self.steps, self.seconds = runner, 0, 0.0
        self._execute = runner.execute

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._execute(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.steps += 1

        runner.execute = timed

    def restore(self) -> None:
        self.runner.execute = self._execute


def kernel_tests(timeout_s: float) -> dict:
    """The Triton kernels' tests (tests/test_triton_attention.py) compiled and run on this GPU: the CPU runs
    them in the interpreter only."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("pytest") is None:
        return {"skipped": "pytest is not installed here"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_attention.py"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    result = {"returncode": proc.returncode, "summary": summary}
    if proc.returncode != 0:
        result["error"] = summary
        print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
    return result


def run_transformers(name: str, requests: list[BenchRequest], shape: dict, sizes: list[int], device: str) -> dict:
    """(c): transformers.generate in length-sorted static batches at its best batch size of a sweep.

    The sweep generates at most SWEEP_OUTPUT_LEN tokens a request: on the H200, sweeping with the
    workload's full lengths (up to 1,024 steps a batch) did not end within the lease's 7 minutes."""
    model = hf_model(shape, torch.bfloat16 if device == "cuda" else torch.float32, device)
    pad = pad_token_id(model)
    short = [dataclasses.replace(r, output_len=min(r.output_len, SWEEP_OUTPUT_LEN)) for r in requests]
    best, sweep = best_batch_size(model, short, sizes, pad)
    reset_peak(device)
    run = run_static(model, requests, best, pad)
    result = summary(name, requests, run.output_tokens, run.wall_s, peak_gib(device))
    result.update(best_batch_size=best, sweep=sweep)
    del model
    release(device)
    return result


def batch1_decode(engine: dict, device: str, output_len: int, vocab_size: int) -> dict:
    """(d): one sequence's decode tokens/s with decode graphs and eagerly."""
    prompt = [(7 * i) % vocab_size for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rates = {}
    for eager in (True, False) if device == "cuda" else (True,):
        llm = LLM(**{**engine, "enforce_eager": eager, "max_num_seqs": 8})
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        start = time.perf_counter()
        llm.generate([prompt[::-1]], params, use_tqdm=False)
        rates["eager" if eager else "graphs"] = output_len / (time.perf_counter() - start)
        del llm
        release(device)
    if "graphs" in rates:
        rates["graphs_over_eager"] = rates["graphs"] / rates["eager"]
    return rates


def sampler_speed(device: str, rows: int, vocab_size: int) -> dict:
    """(e): the sampler's PyTorch path (CUDA's) on [rows, vocab] bf16 logits, ms a call, each cut found among the
    rows' best logits (torch.topk) against the full sort of the vocabulary it replaced: at Qwen3's generation config
    (temperature 0.6, top_k 20, top_p 0.95, now every request's default there), and at top-p 0.9 alone with a
    temperature of 0.2 (each row's nucleus within its 64 best, as a chat model's mostly is); and at Qwen2.5's, whose
    repetition penalty reads each row's prompt and output ids (256 and 512 here)."""
    from qwenbatch.layers import sampler

    logits = (torch.randn(rows, vocab_size, device=device) * 3).bfloat16()

    def median_ms(params: SamplingParams) -> float:
        batch = [sampler.SamplingRow(params, [], sampler.NO_PROMPT_IDS, None, ()) for _ in range(rows)]
        sampler.sample(logits, batch)
        times = []
        for _ in range(10):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            sampler.sample(logits, batch)  # its .tolist() waits for the device
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]

    top_k_params = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    top_p_params = SamplingParams(temperature=0.2, top_p=0.9)
    result, limits = {}, (sampler.MOST_TOP_K_WITHOUT_SORT, sampler.TOP_P_PROBE)
    try:
        for among_the_best, sorted_ in (("topk_ms", "sort_ms"), ("top_p_probe_ms", "top_p_sort_ms")):
            params = top_k_params if among_the_best == "topk_ms" else top_p_params
            sampler.MOST_TOP_K_WITHOUT_SORT, sampler.TOP_P_PROBE = limits
            result[among_the_best] = median_ms(params)
            sampler.MOST_TOP_K_WITHOUT_SORT, sampler.TOP_P_PROBE = 0, 0
            result[sorted_] = median_ms(params)
    finally:
        sampler.MOST_TOP_K_WITHOUT_SORT, sampler.TOP_P_PROBE = limits
    result["sort_over_topk"] = result["sort_ms"] / result["topk_ms"]
    result["top_p_sort_over_probe"] = result["top_p_sort_ms"] / result["top_p_probe_ms"]
    # Qwen2.5's config adds repetition_penalty 1.05: every row's 256 prompt ids and 512 output ids are read.
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    ids = torch.randint(vocab_size, (rows, 768), generator=torch.Generator().manual_seed(0))
    batch = [sampler.SamplingRow(params, array("q", r[256:].tolist()), r[:256].unique(), None, ()) for r in ids]
    sampler.sample(logits, batch)
    start = time.perf_counter()
    for _ in range(5):
        sampler.sample(logits, batch)
    result["penalties_ms"] = (time.perf_counter() - start) / 5 * 1e3
    return result


def summary(name: str, requests: list[BenchRequest], output_tokens: int, wall: float, peak: float) -> dict:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return {
        "system": name,
        "requests": len(requests),
        "wall_s": wall,
        "req_per_s": len(requests) / wall,
        "output_tps": output_tokens / wall,
        "total_tps": (prompt_tokens + output_tokens) / wall,
        "peak_memory_gib": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, Triton interpreter, a few prompts")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results/gpu")))
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on a CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_checkpoint(Path(tmp) / "tiny-qwen3")
        common = {"device": device, "attention_backend": "triton", "seed": 0}
        if args.smoke:
            common["kv_cache_memory"] = 8 * 2**20
            engine = {**common, "model": str(folder), "load_format": "dummy", "dtype": "float32"}
            shape, n_a, in_a, out_a, n_b, len_b, b1 = TINY, 4, 24, 8, 6, (4, 16), 8
            sizes, steps = [2, 4], 8  # the interpreter runs a Triton kernel ~1,000x slower than a GPU
        else:
            common["gpu_memory_utilization"] = 0.45  # engines run one after another, but keep room
            engine = {**common, "model": "qwen3-0.6b", "load_format": "dummy", "dtype": "bfloat16"}
            shape, n_a, in_a, out_a, n_b, len_b, b1 = QWEN3_0_6B, 500, 512, 128, 256, (100, 1024), 256
            sizes, steps = [64, 128, 256], 32
        vocab = shape["vocab_size"]
        work_a = random_workload(n_a, (in_a, in_a), (out_a, out_a), seed=0, vocab_size=vocab)
        work_b = random_workload(n_b, len_b, len_b, seed=0, vocab_size=vocab)
        phases = [  # the baseline last: it is the slowest, and a lease may end before it
            ("parity", lambda: parity(folder, device, {**common, "max_num_seqs": 8}, steps)),
            ("scoring_parity", lambda: scoring_parity(folder, device, common)),
            ("moe_parity", lambda: moe_parity(tiny_moe_checkpoint(Path(tmp) / "moe"), device, common, steps)),
            ("a", lambda: run_ours(f"qwenbatch (a) {n_a}x{in_a}->{out_a}", work_a, engine, device)),
            ("b", lambda: run_ours("qwenbatch (b) nano-vllm", work_b, engine, device)),
            ("batch1", lambda: batch1_decode(engine, device, b1, vocab)),
            ("sampler", lambda: sampler_speed(device, 256 if device == "cuda" else 8, vocab)),
            ("c", lambda: run_transformers("transformers (b)", work_b, shape, sizes, device)),
        ]
        if not args.smoke:  # CI runs these in the interpreter already
            phases.append(("kernel_tests", lambda: kernel_tests(timeout_s=240)))
        for key, phase in phases:
            # One phase's failure must not lose the others' figures on a lease that may not come again.
            start = time.perf_counter()
            try:
                report[key] = phase()
            except Exception as exc:  # reported in the JSON and the table
                traceback.print_exc()
                report[key] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"({key}) {time.perf_counter() - start:.1f} s: {report[key]}", flush=True)
            (args.out / "gpu-bench.json").write_text(json.dumps(report, indent=2))
            if "error" in report[key]:
                try:  # after a CUDA fault this raises too; the kernel tests run in a process of their own
                    release(device)
                except Exception:
                    traceback.print_exc()
    if "output_tps" in report["b"] and "output_tps" in report["c"]:
        report["b_over_c"] = report["b"]["output_tps"] / report["c"]["output_tps"]
    (args.out / "gpu-bench.json").write_text(json.dumps(report, indent=2))
    print(f"\n{'system':<34} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'peak GiB':>9} {'wall s':>8}")
    for key in ("a", "b", "c"):
        r = report[key]
        if "error" in r:
            print(f"({key}) failed: {r['error']}")
            continue
        print(
            f"{r['system']:<34} {r['req_per_s']:>8.2f} {r['output_tps']:>10.1f} {r['total_tps']:>12.1f} "
            f"{r['peak_memory_gib']:>9.2f} {r['wall_s']:>8.2f}"
        )
    print(f"(0) parity: {report['parity']}; (b) / (c) output tok/s: {report.get('b_over_c', 'n/a')}")
    print(f"(0') prompt logprobs and embeddings against transformers: {report['scoring_parity']}")
    print(f"(0'') mixture of experts against transformers: {report['moe_parity']}")
    print(f"(d) batch-1 decode tok/s: {report['batch1']}")
    print(f"(e) sampler, Qwen3's generation config, ms a call: {report['sampler']}")
    if "kernel_tests" in report:
        print(f"Triton kernel tests on the GPU: {report['kernel_tests']}")
    print(f"wrote {args.out / 'gpu-bench.json'}")
    failed = [key for key, _ in phases if "error" in report[key]]
    if failed:
        raise SystemExit(f"failed phases: {', '.join(failed)}")


if __name__ == "__main__":
    main()
