"""The Batch API's worker: runs stored batches through this server's own engine, at a lower priority.

A batch goes ``validating`` → ``in_progress`` → ``finalizing`` → ``completed`` (or ``failed`` at
validation, ``cancelling`` → ``cancelled``, ``expired``). Each state is in the store before the work
of the next begins, so a server killed anywhere resumes where it stopped:

- validating: the input file is checked line by line (every error reported, OpenAI's shape) and
  copied into the batch's own folder, so deleting the upload later cannot break the run;
- in_progress: the lines go through ``batch.runner.run_batch`` (run-batch's exactly-once result log:
  a restart skips every line already answered) into the serving layer the HTTP routes call, at the
  scheduler's ``BACKGROUND_PRIORITY``, so interactive requests are served first;
- finalizing: the results are put in input order and split into the output file (answers) and the
  error file (errors), each recorded as soon as it exists, so a restart does not make it twice.

Fairness: each key's batches run one at a time, oldest first, and the keys' runs go on side by side, each
with an even share of the lines in flight (``fair_share.FairShare``), so a key's small batch is not stuck
behind another key's large one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sqlite3
import time
from pathlib import Path

import orjson

from qwenbatch.batch.backends import EngineUnavailable, ServingBackend
from qwenbatch.batch.fair_share import FairShare
from qwenbatch.batch.jsonl import DUPLICATE, ResultLog, bounded_lines, parse_lines, write_in_input_order
from qwenbatch.batch.runner import BatchOptions, run_batch, succeeded
from qwenbatch.batch_api.storage import BatchError, BatchRecord, BatchStore, RequestCounts, derived_file_id
from qwenbatch.engine.async_engine import EngineState
from qwenbatch.engine.scheduler import BACKGROUND_PRIORITY
from qwenbatch.serving.api import OpenAIServingAPI
from qwenbatch.serving.protocol import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RERANK_URL

logger = logging.getLogger(__name__)

ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, RERANK_URL, EMBEDDINGS_URL)
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # OpenAI's only window
MAX_REPORTED_ERRORS = 100  # a failed validation lists this many line errors at most
PROGRESS_INTERVAL_S = 1.0  # how often request_counts are written while a batch runs
# After an error that is not one batch's (the store locked or its disk failing), the worker waits this
# long, doubling up to the cap, and starts over from the store: nothing is lost, the batch resumes.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0
_PARAM_OF_CODE = {"invalid_url": "url", "invalid_method": "method", "invalid_body": "body", DUPLICATE: "custom_id"}


class BatchWorker:
    """Runs the store's unfinished batches from the app's event loop: one at a time per key, oldest first,
    the keys side by side with fair shares of ``capacity``."""

    def __init__(self, serving: OpenAIServingAPI, store: BatchStore, capacity: int, max_line_bytes: int) -> None:
        self.serving = serving
        self.store = store
        self.capacity = capacity  # lines in flight, all keys together: fill the engine, leave room in the queue
        self.max_line_bytes = max_line_bytes  # a line longer than the longest request body fails validation
        self.fair_share = FairShare(capacity)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._owner_runs: dict[str, asyncio.Task] = {}  # owner -> the task running its batches, one by one
        self._running: dict[str, asyncio.Task] = {}  # batch id -> its run_batch, while in progress
        # "starting", "running", "retrying" (after an error, with last_error) or "stopped" (the engine is gone)
        self.state = "starting"
        self.last_error: str | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop at once; what is not finished stays in the store, resumed at the next start. Never raises."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.exception("the batch worker failed while stopping")

    def notify(self) -> None:
        """A batch was created or cancelled: look at the store again."""
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        """Stop the batch's run if it is running (its status is "cancelling" already)."""
        if (run := self._running.get(batch_id)) is not None:
            run.cancel()
        self.notify()

    async def _loop(self) -> None:
        """Supervise ``_run_batches``: any error that is not one batch's own is logged, reported (``state``,
        ``last_error``) and retried with backoff; only the engine's end stops the worker."""
        delay = RETRY_FIRST_S
        while True:
            try:
                await self._run_batches()
                self.state = "stopped"
                return
            except EngineUnavailable as e:
                logger.warning("batch worker stopped: %s; unfinished batches resume at the next start", e)
                self.state, self.last_error = "stopped", str(e)
                return
            except Exception as e:
                logger.exception("batch worker error; retrying in %.0f s", delay)
                self.state, self.last_error = "retrying", f"{type(e).__name__}: {e}"
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)

    async def _run_batches(self) -> None:
        """Start a run for every key with unfinished batches; a run's error that is not one batch's own
        (the store, the disk, the engine) ends them all and goes to the supervisor."""
        engine = self.serving.engine
        while engine.state is EngineState.LOADING:
            await asyncio.sleep(0.1)
        try:
            while engine.state is EngineState.READY:
                self._wake.clear()
                batches = await asyncio.to_thread(self.store.unfinished_batches)
                self.state = "running"
                for owner in dict.fromkeys(batch.owner for batch in batches):  # the oldest batch's key first
                    if owner not in self._owner_runs:
                        self._owner_runs[owner] = asyncio.create_task(self._run_owner(owner))
                wake = asyncio.ensure_future(self._wake.wait())
                try:
                    runs = {wake, *self._owner_runs.values()}
                    await asyncio.wait(runs, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake.cancel()
                for owner, run in list(self._owner_runs.items()):
                    if run.done():
                        del self._owner_runs[owner]
                        run.result()  # raises the run's error, if it had one
        finally:
            runs, self._owner_runs = list(self._owner_runs.values()), {}
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)

    async def _run_owner(self, owner: str) -> None:
        """Run ``owner``'s unfinished batches one at a time, oldest first, until it has none."""
        while batches := await asyncio.to_thread(self.store.unfinished_batches, owner):
            batch = batches[0]
            try:
                await self._process(batch)
            except (asyncio.CancelledError, EngineUnavailable, sqlite3.Error, OSError):
                raise  # not this batch's fault: the supervisor retries, the batch resumes where it was
            except Exception:  # a broken batch must not stop the others
                logger.exception("batch %s failed in the worker", batch.id)
                await self._fail(batch, "internal_error", "the server failed while running the batch")

    async def _process(self, batch: BatchRecord) -> None:
        if batch.status == "validating":
            batch = await asyncio.to_thread(self._validate, batch)
        if batch.status == "in_progress" and not _expired(batch):
            batch = await self._execute(batch)
        if batch.status in ("finalizing", "cancelling") or _expired(batch):
            await asyncio.to_thread(self._finalize, batch)

    # -- validating -----------------------------------------------------------------------------------

    def _validate(self, batch: BatchRecord) -> BatchRecord:
        """Check every line; copy the input into the batch's folder; → in_progress, or failed with the errors."""
        source = self.store.file_path(batch.owner, batch.input_file_id)
        if source is None:
            return self._set(batch, "failed", [BatchError("invalid_file", "the input file was deleted")], 0)
        folder = self.store.batch_dir(batch.id)
        tmp = folder / "input.jsonl.tmp"
        shutil.copyfile(source, tmp)
        errors, total = [], 0
        # No line may be longer than the longest request body: read in bounded pieces, never whole.
        with open(tmp, encoding="utf-8-sig", errors="replace") as f:
            for line in parse_lines(bounded_lines(f, self.max_line_bytes), "openai", endpoints=(batch.endpoint,)):
                total += 1
                if not line.valid:
                    message = line.error_message
                    if line.error_code == "invalid_url":
                        message = f"line {line.number}: the url does not match the batch's endpoint {batch.endpoint}"
                    code, param = line.error_code, _PARAM_OF_CODE.get(line.error_code)
                    errors.append(BatchError(code, message, param, line.number))
        if not total:
            errors.append(BatchError("empty_file", "the input file has no request line"))
        if errors:
            shutil.rmtree(folder, ignore_errors=True)
            return self._set(batch, "failed", errors[:MAX_REPORTED_ERRORS], total)
        os.replace(tmp, folder / "input.jsonl")
        return self._set(batch, "in_progress", None, total)

    def _set(self, batch: BatchRecord, status: str, errors: list[BatchError] | None, total: int) -> BatchRecord:
        """Leave validating for ``status``, unless a cancel came first (then the batch as it is now)."""
        stamp = "failed_at" if status == "failed" else "in_progress_at"
        changes = {"status": status, stamp: int(time.time()), "request_counts": RequestCounts(total=total)}
        if errors is not None:
            changes["errors"] = errors
        updated = self.store.update_batch(batch.id, if_status=("validating",), **changes)
        return updated or self.store.get_batch(batch.owner, batch.id)

    # -- in progress ----------------------------------------------------------------------------------

    async def _execute(self, batch: BatchRecord) -> BatchRecord:
        """Run the lines not yet answered; → finalizing, or the batch as a cancel or its expiry left it."""
        folder = self.store.batch_dir(batch.id)
        results = folder / "results.jsonl"
        counts = await asyncio.to_thread(_count_results, results, batch.request_counts.total)

        def on_result(result: dict) -> None:
            nonlocal counts
            ok = succeeded(result)
            counts = RequestCounts(counts.total, counts.completed + ok, counts.failed + (not ok))

        backend = ServingBackend(self.serving, self.capacity, BACKGROUND_PRIORITY, self.fair_share, batch.owner)
        options = BatchOptions(input_format="openai", resume=True, progress=False)
        run = asyncio.ensure_future(run_batch(folder / "input.jsonl", results, backend, options, on_result))
        self._running[batch.id] = run
        self.fair_share.join(batch.owner)
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=PROGRESS_INTERVAL_S)
                current = await asyncio.to_thread(
                    self.store.update_batch, batch.id, if_status=("in_progress",), request_counts=counts
                )
                if current is None or _expired(current):  # cancelled (maybe by another process), or out of time
                    run.cancel()
            await run
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the server is stopping: the batch stays in progress, resumed at the next start
        finally:
            del self._running[batch.id]
            self.fair_share.leave(batch.owner)
            if not run.done():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run  # its result log is closed (flushed and synced) before we go
        current = await asyncio.to_thread(self.store.get_batch, batch.owner, batch.id)
        if current.status != "in_progress" or _expired(current):
            return current
        updated = await asyncio.to_thread(
            self.store.update_batch,
            batch.id,
            if_status=("in_progress",),
            status="finalizing",
            finalizing_at=int(time.time()),
            request_counts=counts,
        )
        return updated or await asyncio.to_thread(self.store.get_batch, batch.owner, batch.id)

    # -- finalizing -----------------------------------------------------------------------------------

    def _finalize(self, batch: BatchRecord) -> None:
        """Write the output and error files from what is done, then the final status."""
        folder = self.store.batch_dir(batch.id)
        results, input_path = folder / "results.jsonl", folder / "input.jsonl"
        if results.is_file():  # cut a torn last line (a crash mid-write), exactly as run-batch resumes its log
            log = ResultLog(results)
            log.open(resume=True)
            log.close()
        counts = _count_results(results, batch.request_counts.total)
        if results.is_file() and input_path.is_file():
            with open(input_path, encoding="utf-8-sig", errors="replace") as f:
                order = [(line.custom_id, line.occurrence) for line in parse_lines(f, "openai")]
            write_in_input_order(results, order)
            outputs, errors = _split(results, folder)
            # Ids derived from the batch: finalizing again after a crash reuses a file already stored.
            for path, kind, field in ((outputs, "output", "output_file_id"), (errors, "error", "error_file_id")):
                if path and getattr(batch, field) is None:
                    name, file_id = f"{batch.id}_{kind}.jsonl", derived_file_id(batch.id, kind)
                    record = self.store.add_file_from_path(batch.owner, name, "batch_output", path, file_id)
                    batch = self.store.update_batch(batch.id, **{field: record.id})
        if batch.status == "cancelling":
            final = "cancelled"
        elif batch.status == "finalizing":
            final = "completed"
        else:
            final = "expired"
        self.store.update_batch(batch.id, status=final, request_counts=counts, **{f"{final}_at": int(time.time())})
        shutil.rmtree(folder, ignore_errors=True)  # the input copy and the result log; the files are kept
        logger.info("batch %s %s: %d completed, %d failed", batch.id, final, counts.completed, counts.failed)

    async def _fail(self, batch: BatchRecord, code: str, message: str) -> None:
        await asyncio.to_thread(
            self.store.update_batch,
            batch.id,
            status="failed",
            failed_at=int(time.time()),
            errors=[BatchError(code, message)],
        )


def _expired(batch: BatchRecord) -> bool:
    return batch.status == "in_progress" and batch.expires_at is not None and time.time() > batch.expires_at


def _count_results(results: Path, total: int) -> RequestCounts:
    """The request counts a result log holds (a torn last line, from a kill mid-write, is not counted)."""
    completed = failed = 0
    if results.is_file():
        with open(results, "rb") as f:
            for raw in f:
                try:
                    result = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    break
                ok = succeeded(result)
                completed += ok
                failed += not ok
    return RequestCounts(total, completed, failed)


def _split(results: Path, folder: Path) -> tuple[Path | None, Path | None]:
    """Answers and errors of the (ordered) result log in two files; None for one that would be empty."""
    paths = {True: folder / "output.jsonl", False: folder / "errors.jsonl"}
    counts = {True: 0, False: 0}
    with open(results, "rb") as src, open(paths[True], "wb") as ok_file, open(paths[False], "wb") as error_file:
        files = {True: ok_file, False: error_file}
        for raw in src:
            ok = succeeded(orjson.loads(raw))
            files[ok].write(raw)
            counts[ok] += 1
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    for ok, path in paths.items():
        if not counts[ok]:
            path.unlink()
    return (paths[True] if counts[True] else None), (paths[False] if counts[False] else None)
