"""The Files API and the store under it, as users of OpenAI's Batch API rely on them.

Through the official ``openai`` SDK against a real server: an upload comes back byte for byte and is
gone after a delete; listing pages through every file once, newest first; a wrong purpose is a 400 and
an oversized upload a 413 that leaves nothing behind, while uploads are not bound by the JSON body limit;
each API key sees only its own files (another's are 404, never 403); files survive a restart; no id
reaches a path outside the data folder. Then ``BatchStore`` alone: the batch records the worker will
write, their listing, cancel transitions, restart and owner isolation, and atomic blob writes.
"""

from __future__ import annotations

import http.client
import io
import re
import sqlite3
import threading
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from openai import OpenAI

from qwenbatch.batch_api.storage import (
    BatchError,
    BatchRecord,
    BatchStore,
    FileRecord,
    FileTooLarge,
    KeyQuota,
    QuotaExceeded,
    RequestCounts,
)
from qwenbatch.cli import build_parser
from qwenbatch.commands.serve import api_keys, serve_options
from qwenbatch.config import EngineConfig
from qwenbatch.server.app import ServerSettings
from qwenbatch.server.guard import owner_id
from server_harness import RunningServer, slow_steps

KEY_A, KEY_B, KEY_LISTER = "key-a", "key-b", "key-lister"
BODY_LIMIT = 4096
FILE_LIMIT = 1000
LINE = b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
FILE_ID = re.compile(r"file-[0-9a-f]{24}")


def engine_config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", kv_cache_memory=2**24)


def client_for(server: RunningServer, key: str = "none") -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def leftovers(data_dir: Path) -> list[str]:
    """Blobs lying in the store's folders (finished and half-written)."""
    return sorted(p.name for folder in ("files", "tmp") for p in (data_dir / folder).iterdir())


@pytest.fixture(scope="module")
def keyed(tiny_qwen3, tmp_path_factory):
    """A server with three API keys, a 4096-byte body limit and the default (200 MB) file limit."""
    settings = ServerSettings(
        served_model_names=["tiny"],
        api_keys=[KEY_A, KEY_B, KEY_LISTER],
        max_body_bytes=BODY_LIMIT,
        data_dir=tmp_path_factory.mktemp("keyed") / "data",
    )
    with RunningServer(settings, engine_config(tiny_qwen3)) as server:
        yield server


@pytest.fixture(scope="module")
def small_files(tiny_qwen3, tmp_path_factory):
    """An open server (no keys) that takes files of at most 1000 bytes."""
    data_dir = tmp_path_factory.mktemp("small") / "data"
    settings = ServerSettings(served_model_names=["tiny"], data_dir=data_dir, max_file_bytes=FILE_LIMIT)
    with RunningServer(settings, engine_config(tiny_qwen3)) as server:
        yield server


@pytest.fixture()
def a(keyed):
    with client_for(keyed, KEY_A) as c:
        yield c


@pytest.fixture()
def b(keyed):
    with client_for(keyed, KEY_B) as c:
        yield c


# -- upload, retrieve, content, delete --------------------------------------------------------------


def test_an_upload_comes_back_byte_for_byte_and_is_gone_after_delete(a, keyed):
    data = LINE * 3
    created = a.files.create(file=("requests.jsonl", data), purpose="batch")
    assert FILE_ID.fullmatch(created.id), created.id
    assert created.object == "file" and created.bytes == len(data) and created.filename == "requests.jsonl"
    assert created.purpose == "batch" and created.status == "processed" and created.created_at > 0
    assert a.files.retrieve(created.id) == created
    content = a.files.content(created.id)
    assert content.content == data
    assert content.response.headers["content-type"] == "application/octet-stream"

    deleted = a.files.delete(created.id)
    assert deleted.id == created.id and deleted.deleted is True and deleted.object == "file"
    for call in (a.files.retrieve, a.files.content, a.files.delete):
        with pytest.raises(openai.NotFoundError) as e:
            call(created.id)
        assert e.value.type == "not_found_error", e.value.body
    assert created.id not in leftovers(keyed.app.state.store.data_dir)


def test_an_upload_is_not_bound_by_the_json_body_limit(a):
    data = bytes(range(256)) * 400  # 100 KB against a 4 KiB body limit
    created = a.files.create(file=("big.jsonl", data), purpose="batch")
    assert created.bytes == len(data)
    assert a.files.content(created.id).content == data
    too_big = httpx.post(
        a.base_url.join("completions"), json={"prompt": "x" * BODY_LIMIT}, headers={"Authorization": f"Bearer {KEY_A}"}
    )
    assert too_big.status_code == 413  # the limit still holds for everything else


# -- listing ----------------------------------------------------------------------------------------


def test_listing_pages_through_every_file_once_newest_first(keyed):
    store: BatchStore = keyed.app.state.store
    with client_for(keyed, KEY_LISTER) as lister:
        uploads = [lister.files.create(file=(f"f{i}.jsonl", LINE), purpose="batch").id for i in range(5)]
        output = keyed.app.state.store.data_dir / "batches" / "output.jsonl"
        output.write_bytes(LINE)
        made = store.add_file_from_path(owner_id(KEY_LISTER), "batch_out.jsonl", "batch_output", output)
        newest_first = [made.id, *reversed(uploads)]

        assert [f.id for f in lister.files.list(limit=2)] == newest_first  # the SDK follows the cursor
        first = lister.files.list(limit=2)
        assert [f.id for f in first.data] == newest_first[:2] and first.has_more
        page = httpx.get(
            str(lister.base_url.join("files")),
            params={"limit": 4, "after": newest_first[1]},
            headers={"Authorization": f"Bearer {KEY_LISTER}"},
        ).json()
        assert [f["id"] for f in page["data"]] == newest_first[2:]
        assert (page["first_id"], page["last_id"], page["has_more"]) == (newest_first[2], newest_first[-1], False)

        assert [f.id for f in lister.files.list(order="asc")] == newest_first[::-1]
        assert [f.id for f in lister.files.list(purpose="batch")] == newest_first[1:]
        assert [f.id for f in lister.files.list(purpose="batch_output")] == [made.id]
        assert lister.files.content(made.id).content == LINE and not output.exists()


@pytest.mark.parametrize(
    ("params", "param"), [({"after": "file-" + "0" * 24}, "after"), ({"limit": 0}, "limit"), ({"order": "up"}, "order")]
)
def test_bad_listing_parameters_are_400_naming_them(a, params, param):
    with pytest.raises(openai.BadRequestError) as e:
        a.files.list(**params)
    assert e.value.param == param, e.value.body


# -- rejected uploads -------------------------------------------------------------------------------


def test_a_purpose_other_than_batch_is_400_naming_purpose(a):
    with pytest.raises(openai.BadRequestError) as e:
        a.files.create(file=("x.jsonl", LINE), purpose="fine-tune")
    assert e.value.param == "purpose" and "purpose" in e.value.message, e.value.body


def test_an_upload_without_a_file_is_400_naming_file(keyed):
    response = httpx.post(
        keyed.url + "/v1/files", data={"purpose": "batch"}, headers={"Authorization": f"Bearer {KEY_A}"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "file"


def test_a_file_of_exactly_the_limit_is_taken(small_files):
    with client_for(small_files) as c:
        created = c.files.create(file=("edge.jsonl", b"x" * FILE_LIMIT), purpose="batch")
        assert created.bytes == FILE_LIMIT
        c.files.delete(created.id)
    assert leftovers(small_files.app.state.store.data_dir) == []


@pytest.mark.parametrize("size", [FILE_LIMIT + 1, 200_000], ids=["just-over", "far-over"])
def test_an_oversized_upload_is_413_naming_the_limit_and_leaves_nothing(small_files, size):
    with client_for(small_files) as c:
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("big.jsonl", b"x" * size), purpose="batch")
        assert e.value.status_code == 413 and str(FILE_LIMIT) in e.value.message, e.value.body
        assert c.files.list().data == []
    assert leftovers(small_files.app.state.store.data_dir) == []


def test_a_chunked_upload_past_the_limit_is_cut_off_with_413(small_files):
    boundary = "qwenbatch-test-boundary"

    def body():
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        for _ in range(100):
            yield b"x" * 1000
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    response = httpx.post(small_files.url + "/v1/files", content=body(), headers=headers, timeout=60)
    assert response.status_code == 413, response.text
    assert str(FILE_LIMIT) in response.json()["error"]["message"]
    assert leftovers(small_files.app.state.store.data_dir) == []
    with client_for(small_files) as c:  # and the server goes on serving uploads
        assert c.files.create(file=("ok.jsonl", LINE), purpose="batch").bytes == len(LINE)


# -- keys and owners --------------------------------------------------------------------------------


def test_another_keys_file_is_404_everywhere_and_not_listed(a, b):
    mine = a.files.create(file=("mine.jsonl", LINE), purpose="batch")
    for call in (b.files.retrieve, b.files.content, b.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(mine.id)
    assert mine.id not in [f.id for f in b.files.list()]
    with pytest.raises(openai.BadRequestError):  # nor can its id serve as B's cursor
        b.files.list(after=mine.id)
    assert a.files.content(mine.id).content == LINE  # B's delete did nothing


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v1/files"), ("POST", "/v1/files"), ("GET", "/v1/files/file-" + "0" * 24)]
)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}], ids=["no-key", "wrong-key"])
def test_requests_without_a_valid_key_are_401(keyed, method, path, headers):
    files = {"file": ("x.jsonl", LINE)} if method == "POST" else None
    response = httpx.request(method, keyed.url + path, headers=headers, files=files, data={"purpose": "batch"})
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "authentication_error"


def test_the_sdk_reports_a_wrong_key_as_an_authentication_error(keyed):
    with client_for(keyed, "nope") as c, pytest.raises(openai.AuthenticationError):
        c.files.list()


def test_serve_takes_keys_from_repeated_flags_a_key_file_or_the_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# team keys\n\n  key-c  \nkey-d\n")
    parse = build_parser().parse_args
    flags = ["serve", "--api-key", "key-a", "--api-key", "key-b", "--api-key-file", str(key_file)]
    monkeypatch.setenv("QWENBATCH_API_KEY", "env-1, env-2")
    # Flags win over the environment.
    assert api_keys(serve_options(parse(flags))) == ["key-a", "key-b", "key-c", "key-d"]
    assert api_keys(serve_options(parse(["serve"]))) == ["env-1", "env-2"]
    key_file.write_text("# only comments\n\n")
    with pytest.raises(ValueError, match="holds no keys"):  # never an open server by accident
        api_keys(serve_options(parse(["serve", "--api-key-file", str(key_file)])))


# -- restart ----------------------------------------------------------------------------------------


def test_files_survive_a_restart_on_the_same_data_dir(tiny_qwen3, tmp_path):
    settings = ServerSettings(served_model_names=["tiny"], data_dir=tmp_path / "data")
    data = LINE * 10
    with RunningServer(settings, engine_config(tiny_qwen3)) as first, client_for(first) as c:
        created = c.files.create(file=("keep.jsonl", data), purpose="batch")
    with RunningServer(settings, engine_config(tiny_qwen3)) as second, client_for(second) as c:
        assert c.files.retrieve(created.id) == created
        assert c.files.content(created.id).content == data
        assert [f.id for f in c.files.list()] == [created.id]


# -- path tricks ------------------------------------------------------------------------------------


def raw_get(url: str, target: str, key: str) -> tuple[int, bytes]:
    """GET ``target`` exactly as written (an HTTP client library would normalise the dots away)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", target, headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


TRICKS = [
    "..",
    ".",
    "../qwenbatch.db",
    "..%2Fqwenbatch.db",
    "%2e%2e",
    "%2e%2e%2fqwenbatch.db",
    "file-..%2F..%2Fx",
    "file-../../secret.txt",
    "..%2F..%2Fsecret.txt",
    "file-" + "0" * 24,
    "FILE-" + "A" * 24,
]


@pytest.mark.parametrize("trick", TRICKS)
@pytest.mark.parametrize("suffix", ["", "/content"], ids=["retrieve", "content"])
def test_ids_that_look_like_paths_are_404_and_read_nothing(keyed, trick, suffix):
    data_dir = keyed.app.state.store.data_dir
    (data_dir.parent / "secret.txt").write_text("SECRET")
    status, body = raw_get(keyed.url, f"/v1/files/{trick}{suffix}", KEY_A)
    assert status == 404, body
    assert b"SECRET" not in body and b"SQLite format" not in body


@pytest.mark.parametrize("trick", ["../qwenbatch.db", "file-../../x", "%2e%2e", "../files"])
def test_the_sdk_gets_not_found_for_path_like_ids(a, trick):
    for call in (a.files.retrieve, a.files.content, a.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(trick)


# -- BatchStore (no server) -------------------------------------------------------------------------


@pytest.fixture()
def store(tmp_path) -> BatchStore:
    return BatchStore(tmp_path / "data")


def new_batch(store: BatchStore, owner: str = "alice", **fields) -> BatchRecord:
    args = dict(
        endpoint="/v1/chat/completions",
        input_file_id="file-" + "1" * 24,
        completion_window="24h",
        metadata=None,
        expires_at=None,
    )
    return store.create_batch(owner, **{**args, **fields})


def test_a_file_record_is_openais_file_object(store):
    record = store.create_file("alice", "in.jsonl", "batch", io.BytesIO(LINE))
    assert record.to_openai() == {
        "id": record.id,
        "object": "file",
        "bytes": len(LINE),
        "created_at": record.created_at,
        "filename": "in.jsonl",
        "purpose": "batch",
        "status": "processed",
        "status_details": None,
    }
    assert store.get_file("alice", record.id) == record
    assert store.file_path("alice", record.id).read_bytes() == LINE


def test_a_new_batch_is_validating_and_is_openais_batch_object(store):
    batch = new_batch(store, metadata={"job": "nightly"}, expires_at=2_000_000_000)
    assert re.fullmatch(r"batch_[0-9a-f]{24}", batch.id) and batch.status == "validating"
    assert store.get_batch("alice", batch.id) == batch
    body = batch.to_openai()
    timestamps = ["in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at"]
    assert body == {
        "id": batch.id,
        "object": "batch",
        "endpoint": "/v1/chat/completions",
        "errors": None,
        "input_file_id": "file-" + "1" * 24,
        "completion_window": "24h",
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": batch.created_at,
        "expires_at": 2_000_000_000,
        **dict.fromkeys([*timestamps, "cancelled_at"]),
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": {"job": "nightly"},
    }


def test_batches_list_newest_first_page_by_page(store):
    made = [new_batch(store).id for _ in range(5)]
    new_batch(store, owner="bob")
    pages, after = [], None
    while page := store.list_batches("alice", limit=2, after=after):
        pages.append([b.id for b in page])
        after = page[-1].id
    assert pages == [made[4:2:-1], made[2:0:-1], made[:1]]
    assert [b.id for b in store.list_batches("alice")] == made[::-1]


def test_update_batch_writes_what_the_worker_sets(store):
    batch = new_batch(store)
    errors = [BatchError("invalid_json", "line 3 is not JSON", line=3)]
    updated = store.update_batch(
        batch.id,
        status="in_progress",
        in_progress_at=batch.created_at + 1,
        request_counts=RequestCounts(total=10, completed=4, failed=1),
        errors=errors,
        output_file_id="file-" + "2" * 24,
    )
    assert updated == store.get_batch("alice", batch.id)
    assert updated.status == "in_progress" and updated.request_counts == RequestCounts(10, 4, 1)
    assert updated.to_openai()["errors"] == {
        "object": "list",
        "data": [{"code": "invalid_json", "message": "line 3 is not JSON", "param": None, "line": 3}],
    }
    assert updated.metadata is None and updated.endpoint == batch.endpoint  # untouched fields stay


def test_update_batch_refuses_what_it_cannot_set(store):
    batch = new_batch(store)
    for bad in ({"owner": "bob"}, {"id": "batch_x"}, {"created_at": 0}, {"colour": "red"}, {}):
        with pytest.raises(TypeError):
            store.update_batch(batch.id, **bad)
    with pytest.raises(ValueError, match="status"):
        store.update_batch(batch.id, status="done")
    with pytest.raises(KeyError):
        store.update_batch("batch_" + "0" * 24, status="failed")
    assert store.get_batch("alice", batch.id) == batch


def test_a_conditional_update_does_not_overwrite_a_cancel(store):
    batch = new_batch(store)
    store.request_cancel("alice", batch.id)
    assert store.update_batch(batch.id, if_status=("validating",), status="in_progress") is None
    assert store.get_batch("alice", batch.id).status == "cancelling"
    done = store.update_batch(batch.id, if_status=("cancelling",), status="cancelled", cancelled_at=1)
    assert done.status == "cancelled" and done.cancelled_at == 1


@pytest.mark.parametrize("status", ["validating", "in_progress", "finalizing"])
def test_cancel_moves_an_unfinished_batch_to_cancelling_once(store, status):
    batch = store.update_batch(new_batch(store).id, status=status)
    cancelling = store.request_cancel("alice", batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at >= batch.created_at
    assert store.request_cancel("alice", batch.id) == cancelling  # a second cancel changes nothing


@pytest.mark.parametrize("status", ["completed", "failed", "expired", "cancelled"])
def test_cancel_leaves_a_finished_batch_as_it_is(store, status):
    batch = store.update_batch(new_batch(store).id, status=status)
    assert store.request_cancel("alice", batch.id) == batch


def test_unfinished_batches_are_every_owners_oldest_first(store):
    statuses = ["validating", "completed", "in_progress", "failed", "finalizing", "cancelling", "cancelled"]
    batches = [store.update_batch(new_batch(store, owner=f"o{i}").id, status=s) for i, s in enumerate(statuses)]
    expected = [b.id for b in batches if b.status in ("validating", "in_progress", "finalizing", "cancelling")]
    assert [b.id for b in store.unfinished_batches()] == expected


def test_another_owners_batch_does_not_exist(store):
    batch = new_batch(store, owner="alice")
    assert store.get_batch("bob", batch.id) is None
    assert store.request_cancel("bob", batch.id) is None
    assert store.get_batch("alice", batch.id).status == "validating"
    assert store.list_batches("bob") == []
    with pytest.raises(ValueError, match="after"):
        store.list_batches("bob", after=batch.id)
    assert store.get_batch("alice", "../" + batch.id) is None


def test_a_reopened_store_sees_everything(tmp_path):
    first = BatchStore(tmp_path / "data")
    file = first.create_file("alice", "in.jsonl", "batch", io.BytesIO(LINE))
    batch = first.update_batch(new_batch(first).id, status="in_progress", metadata={"k": "v"})
    second = BatchStore(tmp_path / "data")
    assert second.get_file("alice", file.id) == file
    assert second.file_path("alice", file.id).read_bytes() == LINE
    assert second.get_batch("alice", batch.id) == batch
    assert second.unfinished_batches() == [batch]
    with sqlite3.connect(tmp_path / "data" / "qwenbatch.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_store_made_by_a_newer_version_is_refused(tmp_path):
    BatchStore(tmp_path / "data")
    with sqlite3.connect(tmp_path / "data" / "qwenbatch.db") as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(ValueError, match="schema version 99"):
        BatchStore(tmp_path / "data")


def test_a_store_opens_while_another_process_is_writing(tmp_path):
    # A server's worker writes while a second process (run-batch, a test) opens the same store. Opening took a read
    # snapshot and then wrote the schema's version: in WAL mode a write committed in between makes that upgrade fail
    # at once ("database is locked"), without waiting out the busy timeout.
    store = BatchStore(tmp_path / "data")
    writer = sqlite3.connect(store.db_path, isolation_level=None, check_same_thread=False)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute(
        "INSERT INTO files (id, owner, bytes, created_at, filename, purpose, status) "
        "VALUES ('file-x', 'alice', 0, 0, 'in.jsonl', 'batch', 'processed')"
    )
    threading.Timer(0.5, writer.execute, ("COMMIT",)).start()
    BatchStore(tmp_path / "data")  # waits for the writer, then opens
    assert writer.execute("SELECT count(*) FROM files").fetchone()[0] == 1  # the writer's row was committed
    writer.close()


class FailingReader(io.RawIOBase):
    """A source that gives one chunk, then fails (a client that vanished mid-upload)."""

    def __init__(self) -> None:
        self.calls = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        self.calls += 1
        if self.calls > 1:
            raise OSError("connection reset")
        return b"x" * 100


def test_blob_writes_are_atomic_and_leave_no_tmp_file(store):
    record = store.create_file("alice", "in.jsonl", "batch", io.BytesIO(LINE * 1000), max_bytes=len(LINE) * 1000)
    assert leftovers(store.data_dir) == [record.id]
    with pytest.raises(FileTooLarge) as e:
        store.create_file("alice", "big.jsonl", "batch", io.BytesIO(b"x" * 3 * 2**20), max_bytes=2**20)
    assert e.value.limit == 2**20 and str(2**20) in str(e.value)
    with pytest.raises(OSError, match="connection reset"):
        store.create_file("alice", "cut.jsonl", "batch", FailingReader())
    assert leftovers(store.data_dir) == [record.id]
    assert [f.id for f in store.list_files("alice")] == [record.id]


def test_files_from_a_path_are_copied_and_the_workers_files_moved(store, tmp_path):
    source = tmp_path / "upload.jsonl"
    source.write_bytes(LINE)
    copied = store.create_file("alice", "upload.jsonl", "batch", source)
    assert source.exists() and store.file_path("alice", copied.id).read_bytes() == LINE
    output = store.batch_dir("batch_" + "3" * 24) / "output.jsonl"
    output.write_bytes(LINE * 2)
    moved = store.add_file_from_path("alice", "output.jsonl", "batch_output", output)
    assert not output.exists() and moved.bytes == 2 * len(LINE) and moved.purpose == "batch_output"
    assert store.file_path("alice", moved.id).read_bytes() == LINE * 2


def test_file_ids_are_looked_up_never_used_as_paths(store):
    record = store.create_file("alice", "../../etc/passwd", "batch", io.BytesIO(LINE))
    assert store.file_path("alice", record.id).parent == store.files_dir  # the filename is only a label
    for bad in ("../qwenbatch.db", "qwenbatch.db", "file-../../x", record.id + "/", record.id.upper()):
        assert store.get_file("alice", bad) is None and store.file_path("alice", bad) is None
        assert store.delete_file("alice", bad) is False
    assert store.get_file("bob", record.id) is None and store.delete_file("bob", record.id) is False
    assert store.delete_file("alice", record.id) is True and leftovers(store.data_dir) == []
    with pytest.raises(ValueError):
        store.batch_dir("../escape")


def test_concurrent_uploads_from_threads_all_land(store):
    ids: list[str] = []

    def upload(i: int) -> None:
        for j in range(5):
            ids.append(store.create_file("alice", f"{i}-{j}.jsonl", "batch", io.BytesIO(LINE)).id)

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    listed = store.list_files("alice")
    assert len(set(ids)) == 40 and sorted(f.id for f in listed) == sorted(ids)
    assert all(isinstance(f, FileRecord) and f.bytes == len(LINE) for f in listed)


# -- per-key quotas -----------------------------------------------------------------------------------


def test_a_key_at_its_file_quota_is_refused_and_nothing_is_left(tmp_path):
    store = BatchStore(tmp_path / "data", KeyQuota(max_files=2, max_bytes=3 * len(LINE)))
    for i in range(2):
        store.create_file("alice", f"{i}.jsonl", "batch", io.BytesIO(LINE))
    with pytest.raises(QuotaExceeded, match="holds 2 files; the limit is 2") as e:
        store.create_file("alice", "2.jsonl", "batch", io.BytesIO(LINE))
    assert e.value.limit == "max_files"
    assert len(store.create_file("bob", "b.jsonl", "batch", io.BytesIO(LINE)).id)  # another key's quota is its own
    assert len(store.list_files("alice")) == 2 and len(leftovers(tmp_path / "data")) == 3
    store.delete_file("alice", store.list_files("alice")[0].id)
    limit = 3 * len(LINE)
    with pytest.raises(QuotaExceeded, match=f"holds {len(LINE)} bytes .* the limit is {limit} bytes") as e:
        store.create_file("alice", "big.jsonl", "batch", io.BytesIO(LINE * 3))
    assert e.value.limit == "max_bytes" and len(store.list_files("alice")) == 1
    store.create_file("alice", "fits.jsonl", "batch", io.BytesIO(LINE * 2))


def test_a_batchs_output_file_is_stored_past_the_quota(tmp_path):
    store = BatchStore(tmp_path / "data", KeyQuota(max_files=1))
    store.create_file("alice", "in.jsonl", "batch", io.BytesIO(LINE))
    output = store.batch_dir("batch_" + "0" * 24) / "output.jsonl"
    output.write_bytes(LINE)
    store.add_file_from_path("alice", "out.jsonl", "batch_output", output)
    assert len(store.list_files("alice")) == 2


def test_concurrent_uploads_never_pass_the_file_quota(tmp_path):
    store = BatchStore(tmp_path / "data", KeyQuota(max_files=5))
    refused: list[str] = []

    def upload(i: int) -> None:
        try:
            store.create_file("alice", f"{i}.jsonl", "batch", io.BytesIO(LINE))
        except QuotaExceeded as e:
            refused.append(e.limit)

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.list_files("alice")) == 5 and refused == ["max_files"] * 7
    assert len(leftovers(tmp_path / "data")) == 5


def test_a_key_at_its_open_batch_quota_is_refused_until_one_finishes(tmp_path):
    store = BatchStore(tmp_path / "data", KeyQuota(max_open_batches=2))
    first, _ = new_batch(store), new_batch(store)
    with pytest.raises(QuotaExceeded, match="2 unfinished batches; the limit is 2"):
        new_batch(store)
    new_batch(store, owner="bob")
    store.update_batch(first.id, status="completed")
    new_batch(store)
    assert len(store.list_batches("alice")) == 3


def test_the_server_answers_429_naming_the_flag_of_the_quota(tiny_qwen3, tmp_path, monkeypatch):
    settings = ServerSettings(
        served_model_names=["tiny"], data_dir=tmp_path / "data", max_files_per_key=2, max_open_batches_per_key=1
    )
    line = b'{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", "body": {"max_tokens": 64}}\n'
    with RunningServer(settings, engine_config(tiny_qwen3)) as server:
        slow_steps(monkeypatch, server.engine, 0.01)  # the batch must still be open at the cancel, on any machine
        client = client_for(server)
        upload = client.files.create(file=("a.jsonl", b"".join(line % i for i in range(50))), purpose="batch")
        client.files.create(file=("b.jsonl", LINE), purpose="batch")
        with pytest.raises(openai.RateLimitError) as e:
            client.files.create(file=("c.jsonl", LINE), purpose="batch")
        assert e.value.body["code"] == "quota_exceeded" and "--max-files-per-key" in e.value.body["message"]
        assert len(client.files.list().data) == 2
        running = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with pytest.raises(openai.RateLimitError) as e:
            client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert "--max-open-batches-per-key" in e.value.body["message"]
        assert [b.id for b in client.batches.list().data] == [running.id]
        client.batches.cancel(running.id)
