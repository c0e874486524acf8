"""A short soak in CI (benchmarks/soak.py runs the long one): requests at bounded concurrency, a fifth of
the clients hanging up mid-stream or mid-request, a tenth malformed. Afterwards the server must be as a
user relies on it being: no 5xx, every malformed request a 4xx, every answer whole, nothing left in
the engine, every KV block free, no stream left behind."""

from __future__ import annotations

import asyncio

from qwenbatch.bench.soak import SoakConfig, metric_value, run_soak
from qwenbatch.config import EngineConfig
from qwenbatch.server.app import ServerSettings
from server_harness import RunningServer, wait_for

KEY = "soak-key"


def test_a_short_soak_leaves_the_server_clean(tiny_qwen3, tmp_path):
    settings = ServerSettings(served_model_names=["tiny"], api_keys=[KEY], data_dir=tmp_path / "data")
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24, max_num_seqs=8)
    with RunningServer(settings, config) as server:
        soak = SoakConfig(requests=300, concurrency=16, max_tokens=12, api_key=KEY, seed=7)
        report = asyncio.run(run_soak(server.url, soak))
        assert report.server_errors == 0 and report.unexpected == [], report.unexpected
        assert report.statuses.get("disconnected", 0) >= 30  # the hang-ups happened
        assert sum(n for status, n in report.statuses.items() if status.startswith("4")) >= 15
        assert sum(report.statuses.values()) == 300
        assert (report.left_running, report.left_waiting, report.kv_cache_usage) == (0, 0, 0)
        assert report.clean
        engine, bm = server.engine, server.engine.block_manager
        assert not engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks
        wait_for(lambda: not server.app.state.serving.engine._streams, "every stream to be dropped")


def test_metric_value_reads_a_prometheus_exposition():
    text = '# TYPE qwenbatch:x gauge\nqwenbatch:x{model_name="a"} 3.0\n'
    assert metric_value(text, "qwenbatch:x") == 3.0 and metric_value(text, "qwenbatch:y") is None
