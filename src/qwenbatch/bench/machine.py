"""What this machine can do, measured in the same run as a benchmark: GEMM rate, copy and read bandwidth, RSS."""

from __future__ import annotations

import platform
import statistics
import threading
import time

import psutil
import torch

from qwenbatch.cpuinfo import processor_fields

# The extensions that pick our CPU kernels.
_KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_kind(cpuinfo: str | None = None) -> dict:
    """The CPU's model name, family and model number, the vector and matrix extensions that pick its kernels, and
    the machine, from ``cpuinfo`` (default: /proc/cpuinfo's text; its first processor): recorded with every figure,
    since the machine kind varies from session to session. In VMs the name may say only "AMD EPYC": the family and
    model number tell Zen 3 (25, 1) from Zen 4 (25, 17) and Zen 5 (26, 2). Fields a CPU does not report (an ARM
    one has no family) are left out; the name is then "unknown"."""
    fields = processor_fields(cpuinfo)
    flags = fields.get("flags", "").split()
    kind: dict = {"model": fields.get("model name", "unknown")}
    for field, name in (("cpu family", "family"), ("model", "model_number")):
        if fields.get(field, "").isdigit():
            kind[name] = int(fields[field])
    kind.update(flags=[f for f in _KERNEL_FLAGS if f in flags], machine=platform.machine())
    return kind


def describe_cpu(kind: dict) -> str:
    """One line for a report: 'AMD EPYC (family 25, model 1; avx2), x86_64'."""
    labels = (("family", "family"), ("model_number", "model"))
    numbers = [f"{label} {kind[key]}" for key, label in labels if key in kind]
    details = "; ".join(filter(None, [", ".join(numbers), " ".join(kind["flags"])]))
    return f"{kind['model']}" + (f" ({details})" if details else "") + f", {kind['machine']}"


def gemm_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Best GFLOP/s of ``repeats`` ``size``-cubed matrix products in ``dtype``: the machine's capability
    (on a shared machine a median mixes in the neighbours' load)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e9


def copy_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Median GB/s of a large tensor copy, counting bytes read plus bytes written."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e9


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Median GB/s of summing a large tensor: bytes read only, as a decode step reads its weights."""
    src = torch.ones(nbytes // 4)
    src.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


class PeakRSS:
    """Samples this process's RSS in a thread while the ``with`` block runs; ``.peak_mib`` after."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, proc.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.peak_bytes = psutil.Process().memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, psutil.Process().memory_info().rss)

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20


class PeakGPUMemory:
    """The CUDA allocator's peaks while the ``with`` block runs (``torch.cuda.reset_peak_memory_stats``
    at the start): what the guides size GPU batches by, with the KV pool's bytes beside them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_allocated = self.peak_reserved = 0

    def __enter__(self) -> PeakGPUMemory:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        self.peak_allocated = torch.cuda.max_memory_allocated(self.device)
        self.peak_reserved = torch.cuda.max_memory_reserved(self.device)


def gpu_memory_report(gpu: PeakGPUMemory, engine, peak_kv_usage: float) -> dict:
    """Peak allocated and reserved GPU memory, the KV pool's share, and the memory the run needed: the
    peak less the part of the (preallocated) KV pool it never filled."""
    pool = engine.runner.kv_cache_bytes
    return {
        "peak_gpu_allocated_mib": gpu.peak_allocated / 2**20,
        "peak_gpu_reserved_mib": gpu.peak_reserved / 2**20,
        "kv_pool_mib": pool / 2**20,
        "kv_pool_share": pool / max(gpu.peak_reserved, 1),
        "gpu_memory_needed_mib": (gpu.peak_allocated - pool * (1 - peak_kv_usage)) / 2**20,
    }
