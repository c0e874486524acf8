"""AsyncEngine: the LLMEngine loop on one background thread, and the engine client its callers use.

The thread loads the model, then steps the engine while there is work and sleeps when there is
none. Everything that touches the engine's state (adding, aborting, changing limits) is handed
to that thread as a command, so the engine itself needs no locks and the event loop never waits
on the model. Outputs go back to the event loop once per step with ``call_soon_threadsafe``.

Callers (the serving layer) see only this client, as vLLM's servers see its ``EngineClient``: the
input processor (tokenizer, chat template, request validation: thread-safe, its work run off the
event loop by ``process_inputs``), ``config_snapshot``, ``open_streams``, ``abort``, ``update_limits``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from qwenbatch.config import EngineConfig
from qwenbatch.engine.input_processor import InputProcessor
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.engine.request import EngineRequest
from qwenbatch.engine.stats import IterationStats, SchedulerStats
from qwenbatch.outputs import RequestOutput

logger = logging.getLogger(__name__)

StatsCallback = Callable[[IterationStats, SchedulerStats], None]
T = TypeVar("T")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's settings as they are now, published by the engine thread (GET /config shows them)."""

    config: EngineConfig  # as changed by update_limits
    dtype: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    # The kernels chosen at load for this machine, timings included (as in the log and bench JSON).
    linear_kernels: str
    prefill_attention: str
    decode_attention: str
    # What a request's unset sampling values become (OpenAI's, or the model's generation config's).
    default_sampling_params: dict

    def as_dict(self) -> dict:
        values = dataclasses.asdict(self.config)
        values.update(
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            num_kv_blocks=self.num_kv_blocks,
            num_kv_tokens=self.num_kv_blocks * self.block_size,
            linear_kernels=self.linear_kernels,
            prefill_attention=self.prefill_attention,
            decode_attention=self.decode_attention,
            default_sampling_params=self.default_sampling_params,
        )
        return values


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineNotReadyError(RuntimeError):
    """The engine is still loading, has died or has stopped; the message says which."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the client should retry later."""


class _Aborted:
    """Put into a request's stream when it is aborted, so its reader stops waiting."""


_ABORTED = _Aborted()


class AsyncEngine:
    """Runs ``LLMEngine`` on a thread and serves its outputs to asyncio callers."""

    def __init__(
        self,
        engine_factory: Callable[[], LLMEngine],
        max_waiting_seqs: int,
        on_stats: StatsCallback | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._engine_factory = engine_factory
        self.max_waiting_seqs = max_waiting_seqs
        self._on_stats = on_stats
        self._on_fatal = on_fatal
        self.engine: LLMEngine | None = None  # the engine thread's alone: callers use the methods below
        self._inputs: InputProcessor | None = None
        self._snapshot: EngineSnapshot | None = None
        self.state = EngineState.LOADING
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._num_waiting = 0  # sequences waiting in the engine after the last step
        self._num_submitted = 0  # sequences handed to the thread and not yet in the published num_waiting
        self._num_added = 0  # of those, the ones the thread has added since it last published stats
        self._count_lock = threading.Lock()

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="qwenbatch-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, stop the thread and wait for it."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.state is not EngineState.DEAD:
            self.state = EngineState.STOPPED
        for stream in self._streams.values():  # their requests were aborted with the engine
            stream.put_nowait(_ABORTED)

    @property
    def is_healthy(self) -> bool:
        """True while the engine is loaded and its thread runs."""
        return self.state is EngineState.READY and self._thread is not None and self._thread.is_alive()

    def _check_ready(self) -> None:
        """EngineNotReadyError saying why the engine cannot take requests, if it cannot."""
        if not self.is_healthy or self._inputs is None:
            if self.state is EngineState.LOADING:
                raise EngineNotReadyError("the model is still loading")
            raise EngineNotReadyError(f"the engine is not running ({self.state.value}: {self.error})")

    @property
    def inputs(self) -> InputProcessor:
        """The loaded model's input processor (tokenizer, chat template, validation); thread-safe.
        EngineNotReadyError while there is none."""
        self._check_ready()
        return self._inputs

    async def process_inputs(self, work: Callable[[InputProcessor], T]) -> T:
        """``work(inputs)`` on a worker thread: tokenizing a long conversation or thousands of documents
        would stall every other request on the event loop."""
        inputs = self.inputs
        return await asyncio.get_running_loop().run_in_executor(None, work, inputs)

    def config_snapshot(self) -> EngineSnapshot:
        """The engine's settings now; EngineNotReadyError while it is not running."""
        self._check_ready()
        return self._snapshot

    @property
    def max_model_len(self) -> int | None:
        """The longest prompt + output, once loaded (None before)."""
        return self._snapshot.max_model_len if self._snapshot is not None else None

    # -- requests ---------------------------------------------------------------------------------

    def check_capacity(self, num_seqs: int = 1) -> None:
        """Before making a request of ``num_seqs`` sequences (prompts x n): ValueError when it alone is over
        the waiting queue's bound (it can never be admitted), QueueFullError when the queue has no room
        for all of it now."""
        self._check_ready()
        if num_seqs > self.max_waiting_seqs:
            raise ValueError(
                f"the request makes {num_seqs} sequences (prompts x n); at most {self.max_waiting_seqs} can wait"
            )
        with self._count_lock:
            waiting = self._num_waiting + self._num_submitted
        if waiting + num_seqs > self.max_waiting_seqs:
            raise QueueFullError(
                f"{waiting} sequences are waiting and this request adds {num_seqs} (the bound is "
                f"{self.max_waiting_seqs}); retry later"
            )

    def open_streams(self, requests: list[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queue ``requests`` together, or none of them, and return one output stream for each: deltas if
        it streams, else one final output.

        The capacity check and the queueing are one step on the event loop, so concurrent callers that
        each passed ``check_capacity`` before tokenizing cannot together pass the waiting queue's bound:
        QueueFullError (or ValueError, as ``check_capacity``) when the queue has no room for all their
        sequences now. Stopping a stream early (the client went away) aborts its request and frees its
        blocks; a stream ends without a finished output if its request is aborted by ``abort``.
        """
        num_seqs = sum(len(r.seqs) for r in requests)
        self.check_capacity(num_seqs)
        ids = [r.request_id for r in requests]
        if len(set(ids)) < len(ids) or not self._streams.keys().isdisjoint(ids):
            clash = next(i for i in ids if i in self._streams or ids.count(i) > 1)  # only on this error path
            raise ValueError(f"request_id {clash!r} is already running")
        queues = [asyncio.Queue() for _ in requests]
        self._streams.update(zip(ids, queues, strict=True))
        with self._count_lock:
            self._num_submitted += num_seqs
        self._submit(lambda: self._add_all(requests))
        return [self._read(request_id, stream) for request_id, stream in zip(ids, queues, strict=True)]

    async def _read(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request from the event loop: its stream ends and its blocks are freed."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put_nowait(_ABORTED)
        self._submit(lambda: self.engine.abort(request_id))

    async def update_limits(self, **limits: int) -> EngineSnapshot:
        """Change ``max_num_seqs`` / ``max_num_batched_tokens`` from the next step on; the settings after."""
        self._check_ready()
        engine = self.engine
        done: concurrent.futures.Future = concurrent.futures.Future()

        def apply() -> None:
            try:
                engine.update_limits(**limits)
                self._publish_snapshot()
                done.set_result(self._snapshot)
            except Exception as e:  # handed back to the caller, e.g. a ValueError for a bad value
                done.set_exception(e)

        self._submit(apply)
        return await asyncio.wrap_future(done)

    # -- the engine thread ------------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _add_all(self, requests: list[EngineRequest]) -> None:
        with self._count_lock:  # counted as submitted until the next published stats count them as waiting
            self._num_added += sum(len(r.seqs) for r in requests)
        for request in requests:
            if request.request_id not in self._streams:
                continue  # aborted before it reached the engine
            try:
                self.engine.add(request)
            except ValueError as e:
                self._deliver([(request.request_id, e)])

    def _run(self) -> None:
        try:
            self.engine = self._engine_factory()
        except BaseException as e:
            self._die(e, "the engine failed to load")
            return
        self._inputs = self.engine.inputs
        self._publish_snapshot()
        self.state = EngineState.READY
        logger.info("engine ready")
        try:
            self._loop_forever()
        except BaseException as e:
            self._die(e, "the engine loop died")

    def _loop_forever(self) -> None:
        engine = self.engine
        idle_stats_pending = True  # publish the state once the engine is loaded (the KV pool's size, say)
        while not self._stopping:
            if self._run_commands():
                idle_stats_pending = True  # e.g. an abort while idle: its stats must not wait for the next step
            if not engine.has_unfinished():
                if idle_stats_pending:
                    self._publish_stats()
                    idle_stats_pending = False
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            outputs = engine.step()
            if outputs:
                self._deliver([(out.request_id, out) for out in outputs])
            self._publish_stats()
            idle_stats_pending = True
        engine.abort_all()
        self._publish_stats()

    def _run_commands(self) -> int:
        """Run the queued commands; how many ran."""
        ran = 0
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return ran
            command()
            ran += 1

    def _publish_snapshot(self) -> None:
        engine = self.engine
        self._snapshot = EngineSnapshot(
            engine.config,
            str(engine.dtype).removeprefix("torch."),
            engine.max_model_len,
            engine.block_manager.num_blocks,
            engine.block_manager.block_size,
            engine.runner.linear_kernels,
            engine.runner.prefill_attention,
            engine.runner.decode_attention,
            dataclasses.asdict(engine.sampling_defaults),
        )

    def _publish_stats(self) -> None:
        scheduler_stats = self.engine.scheduler_stats()
        with self._count_lock:
            self._num_waiting = scheduler_stats.num_waiting
            self._num_submitted -= self._num_added
            self._num_added = 0
        iteration = self.engine.take_iteration_stats()
        if self._on_stats is not None:
            self._on_stats(iteration, scheduler_stats)

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, items)

    def _dispatch(self, items: list[tuple[str, Any]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)
                if isinstance(item, BaseException) or item.finished:
                    del self._streams[request_id]  # its last item: a stream nobody reads leaves nothing behind

    def _die(self, error: BaseException, what: str) -> None:
        # A bad --model or a missing file is a one-line error; anything else keeps its traceback.
        expected = isinstance(error, ValueError | OSError)
        logger.error("%s: %s", what, error, exc_info=None if expected else error)
        self.error = error
        self.state = EngineState.DEAD
        failure = EngineNotReadyError(f"{what}: {error}")
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, failure)
        if self._on_fatal is not None:
            self._on_fatal(error)

    def _fail_all(self, failure: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(failure)
