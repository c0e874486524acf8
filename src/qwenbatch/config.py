"""EngineConfig: every engine setting in one validated dataclass (filled from flags, file and env by settings)."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from dataclasses import dataclass, field

import torch

from qwenbatch.cpuinfo import cpu_flags
from qwenbatch.sampling_params import KNOBS
from qwenbatch.settings import FLOAT, Form, parse_bytes, read_as

logger = logging.getLogger(__name__)

TASKS = ("auto", "generate", "rerank", "embed")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
QUANTIZATIONS = ("none", "int8")
CPU_KERNELS = ("auto", "on", "off")
# The sampling values --override-generation-config may set (SamplingParams' names, and Hugging Face's max_new_tokens).
OVERRIDABLE = (*KNOBS, "max_tokens", "max_new_tokens")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX).

    Without it (an AVX2-only CPU) PyTorch's bfloat16 matmuls run at ~18 GFLOP/s against ~120 in
    float32 on the same machine, so float32 is the fast dtype there.
    """
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def has_cxx_compiler() -> bool:
    """True when torch's extension builder finds a C++ compiler (``$CXX``, else ``c++``)."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def parse_kv_cache_memory(text: str) -> int | float:
    """'4GiB' -> bytes; '0.3' -> a fraction of the memory available once the weights are loaded."""
    try:
        value = float(text)
    except ValueError:
        return parse_bytes(text)
    return value if 0 < value < 1 else parse_bytes(text)


def batch_defaults(device: torch.device) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) where the user sets neither.

    CUDA: vLLM's offline defaults, 1,024 sequences and 16,384 tokens a step on a GPU of >= 70 GiB other
    than an A100 (where vLLM measured large token budgets lose), else 256 and 8,192; a step's fixed cost
    (launches, the host's share) is then spread over enough work, and 500 requests decode in one wave.
    CPU: 256 and 2,048, where `tune`'s sweeps put the knee (BENCHMARKS.md).
    """
    if device.type != "cuda":
        return 256, 2048
    props = torch.cuda.get_device_properties(device)
    if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
        return 1024, 16384
    return 256, 8192


def parse_generation_overrides(text: str | None) -> dict[str, float | int]:
    """'{"temperature": 0.5}' -> {"temperature": 0.5}; ValueError unless a JSON object of OVERRIDABLE keys."""
    if text is None:
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"override_generation_config must be a JSON object: {e}") from e
    if not isinstance(values, dict) or set(values) - set(OVERRIDABLE):
        raise ValueError(f"override_generation_config must be a JSON object of {', '.join(OVERRIDABLE)}, got {text!r}")
    return values


KV_CACHE_MEMORY = Form(parse_kv_cache_memory, "a size in bytes such as 4GiB, or a fraction in (0, 1)", FLOAT.accepts)


@dataclass
class EngineConfig:
    """Settings of one engine. Names follow vLLM's flags where the concept is the same."""

    model: str = "default"  # "default", a Hugging Face folder, a .gguf file, or a dummy shape name
    load_format: str = "auto"  # "auto" or "dummy" (random weights of the model's shape)
    dtype: str = "auto"  # auto: bfloat16 on CUDA and where the CPU has native bf16 matmuls, else float32
    device: str = "auto"  # auto: cuda when torch sees a CUDA device, else cpu
    # Share of the GPU's memory this engine may hold (weights, activations, KV pool), as vLLM's flag.
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # CUDA: no decode graphs (vLLM's flag)
    # auto: Triton kernels on CUDA, PyTorch on CPU; triton on CPU runs under TRITON_INTERPRET=1 (tests).
    attention_backend: str = "auto"
    # int8: CPU linears with int8 weights and activations, one scale per 32 values (vLLM's flag name).
    quantization: str = "none"
    # Our fused CPU kernels (layers/csrc) for norms, SiLU * up, RoPE, paged decode attention and prefill attention
    # (bf16 with AVX512-BF16, float32 with AVX2; where timed faster than SDPA's), and the allocator that caches large
    # step buffers. auto: on in every dtype where a C++ compiler is found (built once, ~1 min on 2 cores; in float32
    # they change only float32 rounding, and greedy parity with transformers holds); always on with int8.
    cpu_kernels: str = "auto"
    # CPU: torch.compile (inductor, frozen weights) of the model, attention opaque, instead of the fused CPU
    # kernels (which it would only see as opaque calls); off by default (BENCHMARKS.md: it decodes slower).
    compile: bool = False
    max_model_len: int | None = None  # default: the model's context length, capped by the KV pool
    # Unset: the defaults of the device the engine runs on (``batch_defaults``), resolved there, not where the
    # config is made (a Ray driver on a CPU may start replicas on GPUs): read them as ``resolved_*``.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Bytes (an int, or text such as "4GiB"), or a fraction (0, 1) of the memory available after loading the
    # weights. Default: 4 GiB, at most a quarter of available memory.
    kv_cache_memory: int | float | str | None = field(default=None, metadata=read_as(KV_CACHE_MEMORY))
    seed: int = 0
    # "rerank": score query-document pairs (Qwen3-Reranker); "embed": one normalized vector a text (Qwen3-Embedding);
    # "auto": rerank or embed where the model's name says so, else generate.
    task: str = "auto"
    tokenizer: str | None = None  # a tokenizer folder ("default": the default model's), e.g. for dummy weights
    # Sampling values a request leaves unset (vLLM's flags): "auto" takes the model's generation_config.json,
    # "vllm" OpenAI's defaults, a folder its generation_config.json (models/generation_config.py) ...
    generation_config: str = "auto"
    # ... and this JSON object's values over them, e.g. '{"temperature": 0.5}'.
    override_generation_config: str | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda: no CUDA device is visible to torch (torch.cuda.is_available() is False)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be none or int8, got {self.quantization!r}")
        if self.quantization == "int8" and self.resolved_device.type != "cpu":
            raise ValueError("quantization int8 runs on the CPU only (its kernel is CPU code)")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be auto, on or off, got {self.cpu_kernels!r}")
        if self.cpu_kernels == "on" and self.resolved_device.type != "cpu":
            raise ValueError("cpu_kernels on: the CPU kernels run on the CPU only")
        if self.cpu_kernels == "off" and self.quantization == "int8":
            raise ValueError("quantization int8 runs in the CPU kernels: it cannot have cpu_kernels off")
        if self.compile and self.resolved_device.type != "cpu":
            raise ValueError("compile runs on the CPU only (CUDA replays decode steps as CUDA graphs)")
        if self.compile and (self.quantization == "int8" or self.cpu_kernels == "on"):
            raise ValueError("compile replaces the CPU kernels: it cannot run with quantization int8 or cpu_kernels on")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {util!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if (value is not None or name == "block_size") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_kv_cache_memory(self.kv_cache_memory)
        kv = self.kv_cache_memory
        if kv is not None and (kv <= 0 or (isinstance(kv, float) and kv >= 1)):
            raise ValueError(f"kv_cache_memory must be a byte count or a fraction in (0, 1), got {kv!r}")
        if isinstance(kv, float) and self.resolved_device.type == "cuda":
            raise ValueError("on CUDA, size the KV cache with gpu_memory_utilization (or kv_cache_memory in bytes)")
        parse_generation_overrides(self.override_generation_config)  # refused before anything loads

    @property
    def generation_overrides(self) -> dict[str, float | int]:
        """``override_generation_config`` as a dict."""
        return parse_generation_overrides(self.override_generation_config)

    @property
    def resolved_task(self) -> str:
        """The task "auto" stands for: rerank for a model whose name says reranker, embed for one whose name says
        embedding (vLLM needs --task embed for Qwen3-Embedding, whose config.json names Qwen3ForCausalLM), else
        generate."""
        if self.task != "auto":
            return self.task
        name = str(self.model).rstrip("/").rsplit("/", 1)[-1].lower()  # the model's own name, not its parent folders
        return "rerank" if "reranker" in name else "embed" if "embedding" in name else "generate"

    @property
    def resolved_device(self) -> torch.device:
        """The device "auto" stands for: CUDA when torch sees one, else the CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def resolved_max_num_seqs(self) -> int:
        """Most sequences in one step: as set, else the device's default."""
        return self.max_num_seqs or batch_defaults(self.resolved_device)[0]

    @property
    def resolved_max_num_batched_tokens(self) -> int:
        """A step's token budget: as set, else the device's default."""
        return self.max_num_batched_tokens or batch_defaults(self.resolved_device)[1]

    @property
    def resolved_attention_backend(self) -> str:
        """The attention kernels: Triton on CUDA, PyTorch's on CPU, unless set."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.resolved_device.type == "cuda" else "torch"

    @property
    def uses_cpu_kernels(self) -> bool:
        """Whether the model runs our fused CPU kernels (what ``cpu_kernels`` auto stands for, resolved)."""
        if self.resolved_device.type != "cpu" or self.cpu_kernels == "off" or self.compile:
            return False
        if self.cpu_kernels == "on" or self.quantization == "int8":
            return True
        return has_cxx_compiler()

    @property
    def caches_step_buffers(self) -> bool:
        """Whether a CPU engine makes the CPU kernels' caching allocator PyTorch's (layers/host_allocator.py):
        wherever the kernels may be built (not with ``cpu_kernels`` off), ``--compile`` too."""
        if self.resolved_device.type != "cpu" or self.cpu_kernels == "off":
            return False
        return self.uses_cpu_kernels or has_cxx_compiler()

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype to run in; "auto" picks the fastest one the device has (bfloat16 on CUDA; float16 is
        never the fastest on CPU)."""
        if self.resolved_device.type == "cuda":
            return torch.bfloat16 if self.dtype == "auto" else DTYPES[self.dtype]
        if self.dtype == "auto":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        if self.dtype != "float32" and not cpu_has_native_bf16():
            logger.warning("%s on a CPU without AVX512-BF16/AMX is several times slower than float32", self.dtype)
        return DTYPES[self.dtype]
