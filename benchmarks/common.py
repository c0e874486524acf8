"""Shared helpers for the benchmark scripts: real chat prompts, timing, random weights of a real model's shape."""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from qwenbatch.bench.workloads import CHAT_INSTRUCTIONS  # noqa: F401 (the scripts import it from here)
from qwenbatch.loader.default_model import default_model_dir
from qwenbatch.loader.dummy import SHAPES


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall seconds of ``repeats`` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def random_qwen3_0_6b(folder: Path, dtype: torch.dtype, auto_class) -> bool:
    """Save random weights of the Qwen3-0.6B shape (the reranker's and embedder's) to ``folder`` through
    transformers' ``auto_class`` (AutoModelForCausalLM, or AutoModel for a backbone alone), seed 0, with the default
    model's tokenizer (the Qwen vocabulary); False where the folder already holds them."""
    if (folder / "config.json").is_file():
        return False
    from transformers import Qwen3Config

    shape = {k: v for k, v in SHAPES["qwen3-reranker-0.6b"].items() if k != "architectures"}
    torch.manual_seed(0)
    auto_class.from_config(Qwen3Config(**shape), dtype=dtype).save_pretrained(str(folder))
    copy_default_tokenizer(folder)
    return True


def copy_default_tokenizer(folder: Path) -> None:
    """Give ``folder`` the default model's tokenizer files (the Qwen vocabulary and chat template)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (default_model_dir() / name).is_file():
            shutil.copy(default_model_dir() / name, folder / name)
