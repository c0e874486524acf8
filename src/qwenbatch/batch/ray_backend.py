"""The Ray backend: N actors, each holding one in-process engine; the driver spreads requests over them.

Results come back to the driver, which alone writes the result log, so the exactly-once and
resume guarantees are those of a local run. One replica per GPU where there are GPUs, else the
machine's cores split evenly between replicas.
"""

from __future__ import annotations

import asyncio
import os

from qwenbatch.config import EngineConfig


class _Replica:
    """One engine in a Ray actor process."""

    def __init__(self, engine_config: EngineConfig, num_threads: int) -> None:
        import torch

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        torch.set_num_threads(num_threads)
        from qwenbatch.batch.backends import in_process_backend

        self.backend = in_process_backend(engine_config)

    async def start(self) -> int:
        await self.backend.start()
        return self.backend.capacity

    async def send(self, url: str, body: dict) -> tuple[int, dict]:
        return await self.backend.send(url, body)

    async def close(self) -> None:
        await self.backend.close()


class RayBackend:
    """``num_replicas`` Ray actors; ``address`` joins a running cluster (default: start a local one)."""

    def __init__(self, engine_config: EngineConfig, num_replicas: int, address: str | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        try:
            import ray  # noqa: F401
        except ImportError as e:
            raise ValueError("the Ray backend needs the ray extra: pip install 'qwenbatch[ray]'") from e
        self.engine_config = engine_config
        self.num_replicas = num_replicas
        self.address = address
        self.capacity = 0
        self._replicas: list = []
        self._in_flight: list[int] = []

    async def start(self) -> None:
        import ray

        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before Ray forks its workers
        if not ray.is_initialized():
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        threads = max(1, cpus // self.num_replicas)
        options = {"num_gpus": 1} if gpus >= self.num_replicas else {"num_cpus": min(threads, cpus)}
        actor = ray.remote(_Replica).options(**options)
        self._replicas = [actor.remote(self.engine_config, threads) for _ in range(self.num_replicas)]
        capacities = await asyncio.gather(*(r.start.remote() for r in self._replicas))
        self.capacity = sum(capacities)
        self._in_flight = [0] * self.num_replicas

    async def send(self, url: str, body: dict) -> tuple[int, dict]:
        i = min(range(self.num_replicas), key=self._in_flight.__getitem__)
        self._in_flight[i] += 1
        try:
            status, response = await self._replicas[i].send.remote(url, body)
        finally:
            self._in_flight[i] -= 1
        return status, response

    async def close(self) -> None:
        import ray

        await asyncio.gather(*(r.close.remote() for r in self._replicas), return_exceptions=True)
        for replica in self._replicas:
            ray.kill(replica)
        self._replicas = []
