"""Durable state of the Files and Batch APIs: one SQLite database plus one blob per file, under ``data_dir``.

Layout: ``qwenbatch.db`` (the rows), ``files/<file_id>`` (file contents), ``tmp/`` (blobs being written),
``batches/<batch_id>/`` (the batch worker's own progress files). Ids are random and opaque; a path on disk
is derived only from an id that matched a row, never from what a request says.

Concurrency: every call opens its own connection, so the store holds no state to lock and the asyncio
loop's threads, the batch worker and even another process on the same ``data_dir`` can use it at once
(SQLite serializes the writers; the busy timeout waits them out). A connection costs tens of
microseconds, nothing next to the HTTP request around it.

Durability: WAL mode, so readers (GET /v1/files, batch polls) never wait on the worker's writes nor it on
them; ``synchronous=NORMAL``, so a commit skips its fsync: the database stays consistent through a crash or
power loss, and only a power loss can drop the last commits. Every blob is fsynced before the row naming
it is written, so what a power loss can take is a row, never the bytes a surviving row points to; and the
worker's frequent progress updates do not each wait on the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import sqlite3
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

SCHEMA_VERSION = 1
FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
BATCH_STATUSES = frozenset(
    {"validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"}
)
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")  # the worker resumes these
CANCELLABLE = ("validating", "in_progress", "finalizing")
_CHUNK_BYTES = 2**20
_STALE_TMP_S = 3600  # a younger tmp blob may be another server's upload still being written

# Run by every BatchStore that opens the database. The write lock comes first (IMMEDIATE): begun deferred, the script
# read the schema and then wrote its version, and in WAL mode a write committed by another process in between (a
# server's worker) fails that upgrade at once ("database is locked"), without waiting out the busy timeout.
_SCHEMA = f"""
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY,  -- insertion order, the list order (created_at ties within a second)
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    status TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    expires_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    request_total INTEGER NOT NULL,
    request_completed INTEGER NOT NULL,
    request_failed INTEGER NOT NULL,
    metadata TEXT,  -- JSON object or NULL
    errors TEXT  -- JSON list of {{code, message, param, line}} or NULL
);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
PRAGMA user_version = {SCHEMA_VERSION};
COMMIT;
"""


@dataclass(frozen=True)
class KeyQuota:
    """What one owner (API key) may hold in the store at once; None is no limit. Only the owner's own
    acts are refused (uploads, new batches): a batch's output file is always stored, but it counts."""

    max_files: int | None = None
    max_bytes: int | None = None
    max_open_batches: int | None = None  # batches not yet finished (UNFINISHED)


class QuotaExceeded(ValueError):
    """The owner would hold more than its KeyQuota allows; ``limit`` names the quota's field."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class FileTooLarge(ValueError):
    """An upload passed ``limit`` bytes; nothing of it was kept."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the file is over the limit of {limit} bytes")
        self.limit = limit


@dataclass(frozen=True)
class FileRecord:
    """One stored file; ``to_openai()`` is OpenAI's file object."""

    id: str  # "file-" + 24 hex digits
    owner: str  # the identity of the key that made it (guard.owner_id); "" on a server without keys
    bytes: int
    created_at: int  # Unix seconds
    filename: str  # as the client named it; only echoed back, never used as a path
    purpose: str  # "batch" (uploads) or "batch_output" (the worker's output and error files)
    status: str = "processed"

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": self.status,
            "status_details": None,
        }


@dataclass(frozen=True)
class RequestCounts:
    """How many of a batch's requests there are, and how many have finished each way."""

    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(frozen=True)
class BatchError:
    """One of a batch's ``errors`` (OpenAI's shape): why the batch, or one line of its input, failed."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based line of the input file, when the error is about one line


@dataclass(frozen=True)
class BatchRecord:
    """A snapshot of one batch (change it with ``BatchStore.update_batch``); ``to_openai()`` is OpenAI's batch."""

    id: str  # "batch_" + 24 hex digits
    owner: str  # as FileRecord.owner
    endpoint: str  # e.g. "/v1/chat/completions"
    input_file_id: str
    completion_window: str  # "24h"
    status: str  # one of BATCH_STATUSES
    created_at: int  # this and every *_at: Unix seconds, None until it happens
    expires_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = RequestCounts()
    metadata: dict[str, str] | None = None
    errors: list[BatchError] | None = None

    def to_openai(self) -> dict:
        errors = None if self.errors is None else {"object": "list", "data": [asdict(e) for e in self.errors]}
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": asdict(self.request_counts),
            "metadata": self.metadata,
        }


_FILE_COLUMNS = tuple(f.name for f in fields(FileRecord))
_BATCH_SCALARS = tuple(f.name for f in fields(BatchRecord) if f.name not in ("request_counts", "metadata", "errors"))
_BATCH_UPDATABLE = frozenset(f.name for f in fields(BatchRecord)) - {"id", "owner", "created_at"}


class BatchStore:
    """Files and batches of every owner; a row of another owner is treated as if it did not exist."""

    def __init__(self, data_dir: Path | str, quota: KeyQuota | None = None) -> None:
        """Open (creating if need be) the store under ``data_dir``; ValueError if a newer qwenbatch made it."""
        self.data_dir = Path(data_dir)
        self.quota = quota or KeyQuota()
        self.db_path = self.data_dir / "qwenbatch.db"
        self.files_dir = self.data_dir / "files"
        self.tmp_dir = self.data_dir / "tmp"
        self.batches_dir = self.data_dir / "batches"
        for folder in (self.files_dir, self.tmp_dir, self.batches_dir):
            folder.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(self.db_path, timeout=30)) as conn:
            conn.execute("PRAGMA journal_mode=WAL")  # persistent: set once here, not per connection
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ValueError(
                    f"{self.db_path} has schema version {version}, newer than this qwenbatch's {SCHEMA_VERSION}"
                )
            conn.executescript(_SCHEMA)
        self._sweep_tmp()

    # -- files --------------------------------------------------------------------------------------

    def create_file(
        self,
        owner: str,
        filename: str,
        purpose: str,
        source: BinaryIO | str | os.PathLike,
        max_bytes: int | None = None,
    ) -> FileRecord:
        """Store the bytes of ``source`` (read in chunks from its current position, or the file at that path).

        Raises FileTooLarge past ``max_bytes`` and QuotaExceeded when the owner would hold more files or
        bytes than the quota allows, leaving nothing behind.
        """
        if isinstance(source, str | os.PathLike):
            with open(source, "rb") as f:
                return self.create_file(owner, filename, purpose, f, max_bytes)
        tmp = self.tmp_dir / secrets.token_hex(16)
        try:
            size = _copy_synced(source, tmp, max_bytes)
            return self._commit_file(owner, filename, purpose, tmp, size, enforce_quota=True)
        finally:
            tmp.unlink(missing_ok=True)  # already moved away unless something failed

    def add_file_from_path(
        self, owner: str, filename: str, purpose: str, tmp_path: Path | str, file_id: str | None = None
    ) -> FileRecord:
        """Adopt a finished file (the worker's output): moved, not copied, so it must be on data_dir's disk
        (write it under ``batch_dir(...)``). With ``file_id``, idempotent: when that file exists already
        (a crash came after its row, before the batch named it) it is returned and ``tmp_path`` dropped."""
        path = Path(tmp_path)
        if file_id is not None and (existing := self.get_file(owner, file_id)) is not None:
            path.unlink(missing_ok=True)
            return existing
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # on disk before the row that names it
        return self._commit_file(owner, filename, purpose, path, path.stat().st_size, file_id)

    def get_file(self, owner: str, file_id: str) -> FileRecord | None:
        """The file, or None if there is none of that id for this owner."""
        if not FILE_ID.fullmatch(file_id):
            return None
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return None if row is None else FileRecord(**{name: row[name] for name in _FILE_COLUMNS})

    def file_path(self, owner: str, file_id: str) -> Path | None:
        """Where the file's bytes lie, or None if there is no such file for this owner."""
        record = self.get_file(owner, file_id)
        return None if record is None else self.files_dir / record.id

    def list_files(
        self, owner: str, purpose: str | None = None, limit: int = 10_000, after: str | None = None, order: str = "desc"
    ) -> list[FileRecord]:
        """Up to ``limit`` files, newest first (``order="desc"``) or oldest first, starting after the file
        ``after`` in that order; ValueError if ``after`` is not one of this owner's files."""
        where, params = ["owner = ?"], [owner]
        if purpose is not None:
            where.append("purpose = ?")
            params.append(purpose)
        with self._connect() as conn:
            rows = _page(conn, "files", owner, where, params, limit, after, order)
        return [FileRecord(**{name: row[name] for name in _FILE_COLUMNS}) for row in rows]

    def delete_file(self, owner: str, file_id: str) -> bool:
        """Delete the file (row, then bytes); False if there was none of that id for this owner."""
        if not FILE_ID.fullmatch(file_id):
            return False
        with self._connect() as conn:
            deleted = conn.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount > 0
        if deleted:
            (self.files_dir / file_id).unlink(missing_ok=True)
        return deleted

    # -- batches ------------------------------------------------------------------------------------

    def create_batch(
        self,
        owner: str,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        expires_at: int | None,
    ) -> BatchRecord:
        """A new batch in status "validating"; QuotaExceeded when the owner has its most open batches."""
        record = BatchRecord(
            id=_new_id("batch_"),
            owner=owner,
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=completion_window,
            status="validating",
            created_at=int(time.time()),
            expires_at=expires_at,
            metadata=metadata,
        )
        columns = _batch_columns({f.name: getattr(record, f.name) for f in fields(record)})
        with self._connect(immediate=True) as conn:  # the count and the insert in one write transaction
            limit = self.quota.max_open_batches
            if limit is not None:
                placeholders = ", ".join("?" * len(UNFINISHED))
                sql = f"SELECT COUNT(*) FROM batches WHERE owner = ? AND status IN ({placeholders})"
                open_batches = conn.execute(sql, (owner, *UNFINISHED)).fetchone()[0]
                if open_batches >= limit:
                    message = f"this key has {open_batches} unfinished batches; the limit is {limit}"
                    raise QuotaExceeded("max_open_batches", message + " (wait for one to finish or cancel one)")
            conn.execute(
                f"INSERT INTO batches ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                tuple(columns.values()),
            )
        return record

    def get_batch(self, owner: str, batch_id: str) -> BatchRecord | None:
        """The batch, or None if there is none of that id for this owner."""
        if not BATCH_ID.fullmatch(batch_id):
            return None
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)).fetchone()
        return None if row is None else _batch_from_row(row)

    def list_batches(self, owner: str, limit: int = 20, after: str | None = None) -> list[BatchRecord]:
        """Up to ``limit`` batches, newest first, starting after the batch ``after``; ValueError if
        ``after`` is not one of this owner's batches."""
        with self._connect() as conn:
            rows = _page(conn, "batches", owner, ["owner = ?"], [owner], limit, after, "desc")
        return [_batch_from_row(row) for row in rows]

    def update_batch(
        self, batch_id: str, *, if_status: Collection[str] | None = None, **changes: Any
    ) -> BatchRecord | None:
        """Set BatchRecord fields of a batch (the worker's writes; any owner) and return the new record.

        With ``if_status``, only if the batch's status is one of those (compare-and-set, so the worker
        cannot overwrite a cancel that came in meanwhile); None when it was not. KeyError for an unknown
        id; TypeError for a field that does not exist or cannot change (id, owner, created_at).
        """
        unknown = changes.keys() - _BATCH_UPDATABLE
        if unknown or not changes:
            raise TypeError(f"update_batch() sets some of {sorted(_BATCH_UPDATABLE)}, got {sorted(changes)}")
        if "status" in changes and changes["status"] not in BATCH_STATUSES:
            raise ValueError(f"status must be one of {sorted(BATCH_STATUSES)}, got {changes['status']!r}")
        columns = _batch_columns(changes)
        sql = f"UPDATE batches SET {', '.join(f'{c} = ?' for c in columns)} WHERE id = ?"
        params = [*columns.values(), batch_id]
        if if_status is not None:
            sql += f" AND status IN ({', '.join('?' * len(if_status))})"
            params += list(if_status)
        with self._connect() as conn:
            updated = conn.execute(sql, params).rowcount > 0
            row = conn.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise KeyError(batch_id)
        return _batch_from_row(row) if updated else None

    def request_cancel(self, owner: str, batch_id: str) -> BatchRecord | None:
        """Move an unfinished batch to "cancelling" (the worker then stops it and sets "cancelled").

        A batch already cancelling or finished is returned unchanged; None if there is no such batch.
        """
        if not BATCH_ID.fullmatch(batch_id):
            return None
        with self._connect() as conn:
            conn.execute(
                f"UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND owner = ?"
                f" AND status IN ({', '.join('?' * len(CANCELLABLE))})",
                (int(time.time()), batch_id, owner, *CANCELLABLE),
            )
            row = conn.execute("SELECT * FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)).fetchone()
        return None if row is None else _batch_from_row(row)

    def unfinished_batches(self, owner: str | None = None) -> list[BatchRecord]:
        """The batches the worker has still to finish (status in UNFINISHED), oldest first: every owner's,
        or ``owner``'s."""
        where, params = f"status IN ({', '.join('?' * len(UNFINISHED))})", list(UNFINISHED)
        if owner is not None:
            where, params = where + " AND owner = ?", [*params, owner]
        with self._connect() as conn:
            rows = conn.execute(f"SELECT * FROM batches WHERE {where} ORDER BY seq", params).fetchall()
        return [_batch_from_row(row) for row in rows]

    def batch_dir(self, batch_id: str) -> Path:
        """The worker's own folder for a batch (``<data_dir>/batches/<id>/``), created."""
        if not BATCH_ID.fullmatch(batch_id):
            raise ValueError(f"not a batch id: {batch_id!r}")
        folder = self.batches_dir / batch_id
        folder.mkdir(exist_ok=True)
        return folder

    # -- internals ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _connect(self, immediate: bool = False) -> Iterator[sqlite3.Connection]:
        """A new connection whose statements form one transaction (committed unless an error escapes);
        ``immediate`` takes the write lock at once, so what it reads stays true until it commits."""
        conn = sqlite3.connect(self.db_path, timeout=30)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA synchronous=NORMAL")
            with conn:
                if immediate:
                    conn.execute("BEGIN IMMEDIATE")
                yield conn
        finally:
            conn.close()

    def _commit_file(
        self,
        owner: str,
        filename: str,
        purpose: str,
        blob: Path,
        size: int,
        file_id: str | None = None,
        enforce_quota: bool = False,
    ) -> FileRecord:
        """Move a synced blob into ``files/`` under ``file_id`` (default: a new one), then insert its row (the
        blob goes if that fails, or if ``enforce_quota`` and the owner would hold too much)."""
        record = FileRecord(file_id or _new_id("file-"), owner, size, int(time.time()), filename, purpose)
        path = self.files_dir / record.id
        os.replace(blob, path)
        _fsync_dir(self.files_dir)
        try:
            with self._connect(immediate=enforce_quota) as conn:  # the quota check and the insert: one step
                if enforce_quota:
                    self._check_file_quota(conn, owner, size)
                conn.execute(
                    f"INSERT INTO files ({', '.join(_FILE_COLUMNS)}) VALUES ({', '.join('?' * len(_FILE_COLUMNS))})",
                    tuple(getattr(record, name) for name in _FILE_COLUMNS),
                )
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return record

    def _check_file_quota(self, conn: sqlite3.Connection, owner: str, size: int) -> None:
        files, stored = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM files WHERE owner = ?", (owner,)
        ).fetchone()
        quota, advice = self.quota, " (delete files to make room)"
        if quota.max_files is not None and files >= quota.max_files:
            raise QuotaExceeded("max_files", f"this key holds {files} files; the limit is {quota.max_files}" + advice)
        if quota.max_bytes is not None and stored + size > quota.max_bytes:
            message = f"this key holds {stored} bytes and the file has {size}; the limit is {quota.max_bytes} bytes"
            raise QuotaExceeded("max_bytes", message + advice)

    def _sweep_tmp(self) -> None:
        """Remove the tmp blobs of uploads a crash cut short."""
        cutoff = time.time() - _STALE_TMP_S
        for path in self.tmp_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()


def derived_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's ``kind`` ("output" or "error") file: the same every time it is written."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _copy_synced(source: BinaryIO, dest: Path, max_bytes: int | None) -> int:
    """Copy ``source`` into a new file ``dest`` and fsync it; the byte count. FileTooLarge past ``max_bytes``."""
    size = 0
    with open(dest, "xb") as out:
        while chunk := source.read(_CHUNK_BYTES):
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise FileTooLarge(max_bytes)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return size


def _fsync_dir(folder: Path) -> None:
    """Make a rename into ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _page(
    conn: sqlite3.Connection,
    table: str,
    owner: str,
    where: list[str],
    params: list,
    limit: int,
    after: str | None,
    order: str,
) -> list[sqlite3.Row]:
    """Rows of ``table`` matching ``where``, in insertion order or its reverse, after the row of id ``after``."""
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if after is not None:
        row = conn.execute(f"SELECT seq FROM {table} WHERE id = ? AND owner = ?", (after, owner)).fetchone()
        if row is None:
            raise ValueError(f"after: there is no object with id {after!r}")
        where = [*where, "seq > ?" if order == "asc" else "seq < ?"]
        params = [*params, row["seq"]]
    sql = f"SELECT * FROM {table} WHERE {' AND '.join(where)} ORDER BY seq {order.upper()} LIMIT ?"
    return conn.execute(sql, [*params, limit]).fetchall()


def _batch_columns(values: dict[str, Any]) -> dict[str, Any]:
    """BatchRecord field values -> batches columns (the counts split in three, metadata and errors as JSON)."""
    columns: dict[str, Any] = {}
    for name, value in values.items():
        if name == "request_counts":
            columns.update(request_total=value.total, request_completed=value.completed, request_failed=value.failed)
        elif name == "metadata":
            columns[name] = None if value is None else json.dumps(value)
        elif name == "errors":
            columns[name] = None if value is None else json.dumps([asdict(e) for e in value])
        else:
            columns[name] = value
    return columns


def _batch_from_row(row: sqlite3.Row) -> BatchRecord:
    return BatchRecord(
        **{name: row[name] for name in _BATCH_SCALARS},
        request_counts=RequestCounts(row["request_total"], row["request_completed"], row["request_failed"]),
        metadata=None if row["metadata"] is None else json.loads(row["metadata"]),
        errors=None if row["errors"] is None else [BatchError(**e) for e in json.loads(row["errors"])],
    )
