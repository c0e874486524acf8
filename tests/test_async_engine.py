"""AsyncEngine alone, as the serving layer uses it: streams, abort, early close, limit changes, readiness."""

from __future__ import annotations

import asyncio

import pytest

from qwenbatch.config import EngineConfig
from qwenbatch.engine.async_engine import AsyncEngine, EngineNotReadyError, EngineState
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.engine.stats import SchedulerStats
from qwenbatch.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tiny_qwen3) -> EngineConfig:
    return EngineConfig(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**22, max_num_seqs=4)


class Harness:
    """An AsyncEngine on the tiny model, with every SchedulerStats it published."""

    def __init__(self, config: EngineConfig) -> None:
        self.stats: list[SchedulerStats] = []
        self.engine = AsyncEngine(
            lambda: LLMEngine(config), max_waiting_seqs=64, on_stats=lambda _, s: self.stats.append(s)
        )

    async def __aenter__(self) -> AsyncEngine:
        self.engine.start()
        while self.engine.state is EngineState.LOADING:
            await asyncio.sleep(0.02)
        assert self.engine.state is EngineState.READY, self.engine.error
        return self.engine

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.engine.stop)

    async def idle(self) -> SchedulerStats:
        """The stats once nothing runs, waits or holds a KV block."""
        for _ in range(500):
            last = self.stats[-1] if self.stats else None
            if last and last.num_running == last.num_waiting == 0 and last.kv_cache_usage == 0.0:
                return last
            await asyncio.sleep(0.02)
        raise AssertionError(f"the engine did not go idle: {self.stats[-1]}")


async def _drain(stream) -> list:
    return [output async for output in stream]


def test_a_streamed_and_a_whole_request_queued_together_get_the_same_greedy_tokens(config):
    async def main():
        async with Harness(config) as engine:
            streamed = engine.inputs.make_request("s", [5, 6, 7, 8], GREEDY, stream=True)
            whole = engine.inputs.make_request("w", [5, 6, 7, 8], GREEDY)
            s, w = engine.open_streams([streamed, whole])
            return await asyncio.gather(_drain(s), _drain(w))

    deltas, [final] = asyncio.run(main())
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    tokens = [t for d in deltas for t in d.outputs[0].token_ids]
    assert tokens == final.outputs[0].token_ids and len(tokens) == GREEDY.max_tokens


def test_abort_ends_the_stream_without_a_final_output_and_frees_the_blocks(config):
    harness = Harness(config)

    async def main():
        async with harness as engine:
            [stream] = engine.open_streams([engine.inputs.make_request("a", [5, 6, 7], LONG, stream=True)])
            first = await anext(stream)
            engine.abort("a")
            rest = await _drain(stream)
            return first, rest, await harness.idle()

    first, rest, idle = asyncio.run(main())
    assert not first.finished and not any(o.finished for o in rest)
    assert idle.kv_cache_usage == 0.0


def test_closing_a_stream_early_aborts_its_request(config):
    harness = Harness(config)

    async def main():
        async with harness as engine:
            [stream] = engine.open_streams([engine.inputs.make_request("c", [5, 6, 7], LONG, stream=True)])
            await anext(stream)
            await stream.aclose()  # what a client that hangs up amounts to
            return await harness.idle()

    assert asyncio.run(main()).num_running == 0


def test_limit_changes_apply_from_the_next_step_and_bad_values_change_nothing(config):
    harness = Harness(config)

    async def main():
        async with harness as engine:
            before = engine.config_snapshot()
            after = await engine.update_limits(max_num_seqs=1)
            with pytest.raises(ValueError, match="max_num_seqs"):
                await engine.update_limits(max_num_seqs=0)
            unchanged = engine.config_snapshot()
            harness.stats.clear()
            requests = [engine.inputs.make_request(f"r{i}", [5, 6, 7 + i], GREEDY) for i in range(3)]
            outputs = await asyncio.gather(*(_drain(s) for s in engine.open_streams(requests)))
            return before, after, unchanged, outputs

    before, after, unchanged, outputs = asyncio.run(main())
    assert before.config.max_num_seqs == 4 and after.config.max_num_seqs == 1
    assert unchanged == after
    assert all(out[-1].finished for out in outputs)
    assert max(s.num_running for s in harness.stats) == 1  # one at a time from then on


def test_nothing_is_served_before_the_model_is_loaded(config):
    engine = AsyncEngine(lambda: LLMEngine(config), max_waiting_seqs=8)  # never started
    with pytest.raises(EngineNotReadyError, match="still loading"):
        engine.inputs  # noqa: B018
    with pytest.raises(EngineNotReadyError, match="still loading"):
        engine.config_snapshot()
    assert engine.max_model_len is None
