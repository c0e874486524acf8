"""The engine flags every model-loading sub-command takes, and the EngineConfig they make."""

from __future__ import annotations

import argparse
from pathlib import Path

from qwenbatch.config import EngineConfig, parse_kv_cache_memory
from qwenbatch.settings import resolve


def add_engine_args(parser: argparse.ArgumentParser, sweep: bool = False) -> None:
    """The flags every sub-command that loads a model takes (vLLM's names); ``sweep``: all but the batch
    limits, which ``tune`` takes as lists."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a qwenbatch.toml (as qwenbatch tune writes): its [engine] table, and for serve its [server] table; "
        "flags win over it, it over QWENBATCH_* environment variables",
    )
    g.add_argument(
        "--model",
        default=None,
        help="'default' (embedded Qwen2.5-Coder-0.5B-Instruct), a Hugging Face folder, a .gguf file, "
        "or with --load-format dummy a shape name (qwen3-0.6b, qwen3-4b, qwen2.5-0.5b)",
    )
    g.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=None,
        help="dummy: random weights of the model's shape, for benchmarks",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help="weights and activations (auto: bfloat16 on CUDA and on CPUs with native bf16, else float32)",
    )
    g.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default=None, help="auto: cuda when a GPU is visible, else cpu"
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="CUDA: share of the GPU's memory for weights, activations and the KV pool (default 0.9)",
    )
    g.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs",
    )
    g.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "triton"],
        default=None,
        help="auto: Triton kernels on CUDA, PyTorch on CPU",
    )
    g.add_argument(
        "--quantization",
        choices=["none", "int8"],
        default=None,
        help="CPU: int8 linears (int8 weights, activations quantized per 32 values); default none",
    )
    g.add_argument(
        "--cpu-kernels",
        choices=["auto", "on", "off"],
        default=None,
        help="CPU: fused norms, SiLU*up, RoPE and paged decode attention (prefill attention too, where "
        "timed faster than PyTorch's) and a caching allocator for large step buffers, in our C++ kernels (built "
        "once, ~1 min; auto: on where a C++ compiler exists)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU: torch.compile (inductor, frozen weights) the model, attention left opaque, in place of "
        "--cpu-kernels; compiles in the first steps (~1 min); off by default: it decodes slower (BENCHMARKS.md)",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    if not sweep:
        g.add_argument(
            "--max-num-seqs",
            type=int,
            default=None,
            help="most sequences in one step (default: 1024 on a GPU of >= 70 GiB, else 256)",
        )
        g.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="token budget of one step (default: 16384 on a GPU of >= 70 GiB, 8192 on others, 2048 on the CPU)",
        )
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of shared prompt prefixes (default: on)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_kv_cache_memory,
        default=None,
        help="KV-cache size in bytes (4GiB) or as a fraction of the memory left after the weights (0.5); default 4GiB",
    )
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--task",
        choices=["auto", "generate", "rerank", "embed"],
        default=None,
        help="rerank: score query-document pairs (Qwen3-Reranker); embed: text embeddings (Qwen3-Embedding); "
        "auto: rerank or embed when the model name says reranker or embedding",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer folder or 'default' (for dummy weights)")
    g.add_argument(
        "--generation-config",
        default=None,
        help="sampling values for what a request leaves unset: 'auto' (default) the model's generation_config.json "
        "(Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05), 'vllm' OpenAI's "
        "defaults, or a folder holding a generation_config.json",
    )
    g.add_argument(
        "--override-generation-config",
        default=None,
        help="a JSON object of sampling values over those, e.g. '{\"temperature\": 0.5}'; a max_new_tokens here "
        "(or in a --generation-config folder) is also the most any request gets",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from flags, then the ``--config`` file's [engine], then QWENBATCH_* environment variables, then
    defaults; ValueError naming a bad variable, key or value.

    Every EngineConfig field that has a flag of the same name is taken from it, so a new field
    needs only its flag.
    """
    return resolve(EngineConfig, vars(args), args.config, "engine")
