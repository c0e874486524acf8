"""`run-batch --backend ray --ray-address` on a Ray cluster of two nodes started the way a real one is.

A head (`ray start --head`) and a second node (`ray start --address`) run on this machine, one CPU each, on
127.0.0.1 with ports of their own; the job then connects to the running cluster rather than starting one.
Each of the two replicas asks for one CPU, so one lands on each node: the job finishes only if both nodes
take work. Its results must equal an in-process run's (greedy, ``ignore_eos``). The cluster uses token
authentication, so the job must present the cluster's token as a real deployment's would. Only the processes of this
cluster are stopped afterwards, found by the temporary folder on their command lines (``ray stop`` would
stop every Ray process on the machine).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import psutil
import pytest

from qwenbatch.cli import main
from server_harness import free_port

pytest.importorskip("ray", reason="Ray is not installed: pip install 'qwenbatch[ray]'")

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 120  # one `ray start` on a loaded two-core machine
JOB_TIMEOUT_S = 240
LINES = 8


# Ports handed to this module's nodes so far: free_port() only knows what is bound now, and a node's worker range
# stays unbound until its workers start, so two draws (or the two nodes) could otherwise get the same port.
_GIVEN_PORTS: set[int] = set()


def _new_port() -> int:
    while (port := free_port()) in _GIVEN_PORTS:
        pass
    _GIVEN_PORTS.add(port)
    return port


def node_ports() -> list[str]:
    """Every port a node would otherwise take by default, so that two nodes on one machine do not collide."""
    worker_low = _new_port()
    while any(p in _GIVEN_PORTS for p in range(worker_low + 1, worker_low + 21)):
        worker_low = _new_port()
    _GIVEN_PORTS.update(range(worker_low, worker_low + 21))
    return [
        f"--node-manager-port={_new_port()}",
        f"--object-manager-port={_new_port()}",
        f"--dashboard-agent-listen-port={_new_port()}",
        f"--dashboard-agent-grpc-port={_new_port()}",
        f"--runtime-env-agent-port={_new_port()}",
        f"--metrics-export-port={_new_port()}",
        f"--min-worker-port={worker_low}",
        f"--max-worker-port={worker_low + 20}",
    ]


def ray_start(args: list[str], temp_dir: Path) -> None:
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", "--disable-usage-stats", f"--temp-dir={temp_dir}"]
    result = subprocess.run(
        [RAY, "start", *args, *common, *node_ports()],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        env=ray_env(),
    )
    assert result.returncode == 0, f"ray start {args}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"


# Token authentication, as a cluster should run, with this test's own token: every node and every driver (the
# job too) must present it. Set explicitly, it also keeps a token left in ~/.ray by another run out of the way.
AUTH_TOKEN = secrets.token_hex(32)


def ray_env() -> dict[str, str]:
    return {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": AUTH_TOKEN,
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }


def stop_cluster(temp_dir: Path) -> None:
    """SIGTERM, then SIGKILL, to every process whose command line names ``temp_dir`` (this cluster's only)."""
    mine = [p for p in psutil.process_iter(["pid", "cmdline"]) if str(temp_dir) in " ".join(p.info["cmdline"] or [])]
    mine = [p for p in mine if p.pid != os.getpid()]
    for process in mine:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(mine, timeout=3)  # some of Ray's take 15 s and more to end themselves
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=15)


def alive_nodes(address: str) -> int:
    """How many nodes the cluster at ``address`` counts alive, asked by a driver of its own."""
    code = (
        f"import ray; ray.init(address={address!r}, log_to_driver=False, configure_logging=False); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=START_TIMEOUT_S, env=ray_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return int(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def two_node_cluster() -> Iterator[str]:
    """The address (127.0.0.1:PORT) of a running head plus one more node; stopped afterwards."""
    # Short: Ray's unix sockets live under it, and a socket path may not exceed 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="qbray-", dir="/tmp"))
    address = f"127.0.0.1:{_new_port()}"
    try:
        head = [
            "--head",
            f"--port={address.split(':')[1]}",
            "--include-dashboard=false",
            f"--dashboard-port={_new_port()}",
        ]
        ray_start(head, temp_dir)
        ray_start([f"--address={address}"], temp_dir)
        deadline = time.monotonic() + START_TIMEOUT_S
        while (nodes := alive_nodes(address)) < 2:
            assert time.monotonic() < deadline, f"the second node did not join: {nodes} alive"
            time.sleep(2)
        assert nodes == 2
        yield address
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def batch_lines(path: Path) -> Path:
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"Line {i}: the quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        }
        for i in range(LINES)
    ]
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def texts(path: Path) -> dict[str, str]:
    results = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results), results
    by_id = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in results}
    assert len(by_id) == len(results), "a custom_id answered twice"
    return by_id


def test_run_batch_on_an_existing_two_node_ray_cluster_equals_in_process(two_node_cluster, tiny_qwen3, tmp_path):
    engine = ["--model", str(tiny_qwen3), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    inp = batch_lines(tmp_path / "in.jsonl")
    reference, out = tmp_path / "reference.jsonl", tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(inp), "-o", str(reference), *engine]) == 0

    job = [
        sys.executable,
        "-m",
        "qwenbatch.cli",
        "run-batch",
        "-i",
        str(inp),
        "-o",
        str(out),
        "--backend",
        "ray",
        "--ray-address",
        two_node_cluster,
        "--num-replicas",
        "2",
        *engine,
    ]
    result = subprocess.run(job, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, env=ray_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert texts(out) == texts(reference)
    assert len(texts(out)) == LINES
