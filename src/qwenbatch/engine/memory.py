"""How many bytes the KV pool gets, on CPU and on CUDA, and what a device's memory looks like now."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

DEFAULT_KV_CACHE_CAP = 4 * 2**30  # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE)
# Host memory a block's bookkeeping takes, per token slot, once it holds a cached prefix: the Block, its tuple
# of token ids and their int objects, its entries in the block manager's hash map and free queue.
BLOCK_BOOKKEEPING_BYTES_PER_TOKEN = 64


def num_kv_blocks(budget: int, kv_bytes_per_token: int, block_size: int, on_host: bool) -> int:
    """How many blocks of ``block_size`` tokens ``budget`` bytes hold: their K/V and, for a pool in host
    memory, their bookkeeping too, which bounds the RSS of a tiny model's many small blocks."""
    per_token = kv_bytes_per_token + (BLOCK_BOOKKEEPING_BYTES_PER_TOKEN if on_host else 0)
    return budget // (per_token * block_size)


def kv_cache_budget(setting: int | float | None) -> int:
    """CPU: bytes for the KV pool as set, a fraction of available memory (checked after loading the weights),
    or by default 4 GiB capped at a quarter of what is available."""
    available = psutil.virtual_memory().available
    if setting is None:
        return min(DEFAULT_KV_CACHE_CAP, available // 4)
    if isinstance(setting, float):
        return int(setting * available)
    return setting


def gpu_kv_cache_budget(total: int, free: int, step_peak: int, utilization: float) -> int:
    """CUDA, as vLLM's ``--gpu-memory-utilization``: of ``utilization`` x ``total`` bytes, what is left
    once the memory in use now (``total - free``: the weights, the CUDA context, other processes) and the
    transient peak of a worst-case step (``step_peak``) are taken out. ValueError when nothing is left."""
    budget = int(total * utilization) - (total - free) - step_peak
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no room for the KV cache: "
            f"{(total - free) / gib:.2f} GiB in use after loading, a worst-case step needs "
            f"{step_peak / gib:.2f} GiB more, of {total * utilization / gib:.2f} GiB allowed "
            f"({total / gib:.2f} GiB on the device); raise it or lower max_num_batched_tokens"
        )
    return budget


@dataclass
class GPUMemory:
    """A CUDA device's memory as torch's allocator sees it, in bytes."""

    total: int
    allocated: int
    reserved: int
    peak_allocated: int  # since start-up or the last reset_peak_memory_stats
    peak_reserved: int

    @classmethod
    def read(cls, device: torch.device) -> GPUMemory:
        _free, total = torch.cuda.mem_get_info(device)
        return cls(
            total,
            torch.cuda.memory_allocated(device),
            torch.cuda.memory_reserved(device),
            torch.cuda.max_memory_allocated(device),
            torch.cuda.max_memory_reserved(device),
        )
