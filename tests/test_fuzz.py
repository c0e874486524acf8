"""Fuzzing the server with schemathesis from its own OpenAPI schema: every route, a bounded number of
generated requests each (valid and invalid), sent with an API key to a live server on the tiny model over
loopback. No answer may be a 5xx, and answers must match the schema where it documents them. The examples
are derandomized (the same every run), so a failure reproduces."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from qwenbatch.config import EngineConfig
from qwenbatch.server.app import ServerSettings, build_app
from server_harness import RunningServer

KEY = "fuzz-key"
EXAMPLES_PER_ROUTE = 25


@pytest.fixture(scope="module")
def fuzzed_server(tiny_qwen3, tmp_path_factory):
    """A keyed server with short sequences, so that whatever lengths are generated, each answer is quick."""
    settings = ServerSettings(
        served_model_names=["tiny"], api_keys=[KEY], data_dir=tmp_path_factory.mktemp("fuzz") / "data"
    )
    config = EngineConfig(
        model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24, max_num_seqs=8, max_model_len=128
    )
    with RunningServer(settings, config) as server:
        yield server


def openapi_document() -> dict:
    """The server's OpenAPI document, from an app that is built but never started (nothing loads)."""
    with tempfile.TemporaryDirectory() as folder:
        settings = ServerSettings(served_model_names=["tiny"], api_keys=[KEY], data_dir=Path(folder))
        return build_app(settings, EngineConfig(model="tiny")).openapi()


schema = schemathesis.openapi.from_dict(openapi_document())


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_ROUTE,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_generated_request_gets_a_server_error(case, fuzzed_server):
    case.call_and_validate(
        base_url=fuzzed_server.url,
        headers={"Authorization": f"Bearer {KEY}"},
        checks=[not_a_server_error, response_schema_conformance],
        timeout=60,
    )
