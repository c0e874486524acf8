"""The monitoring stack in deploy/: alert rules, their unit tests, Prometheus' config, the compose file, Grafana's
provisioning and dashboard, and a real Prometheus scraping a live server.

- ``promtool check rules / check config / test rules`` on the files as shipped (Debian's ``prometheus`` package);
  the unit tests must show every alert rule firing and every alert not firing.
- compose.yaml: validated by ``docker compose config`` (or Debian's ``docker-compose``) where one is installed, and
  always checked for the wiring between the files: mounts that exist, the secret that the server, Prometheus'
  scrape config and compose name alike, the scrape target and Grafana's data source pointing at the services.
- Every metric and label the dashboard and the alerts query is exported by a live server (a tiny model), and every
  exported metric is on the dashboard.
- ``prometheus`` itself scrapes a live server through its API key (and is refused without it), loads the alert
  rules without evaluation errors, and answers the dashboard's queries and the TTFT quantile with what the
  server's own /metrics says.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qwenbatch.config import EngineConfig
from qwenbatch.server.app import ServerSettings
from qwenbatch.server.metrics import ServerMetrics
from server_harness import RunningServer, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus-alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus-alerts.test.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus.yml"
COMPOSE = DEPLOY / "compose.yaml"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
SECRET_PATH = "/run/secrets/qwenbatch_api_key"
API_KEY = "sk-monitoring-test"
MODEL = "tiny"
METRIC = re.compile(r"qwenbatch:[a-zA-Z_][a-zA-Z0-9_:]*")
SELECTOR = re.compile(r"(qwenbatch:[a-zA-Z0-9_:]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!=|!~|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}
# Exported but deliberately not on the dashboard: the peaks only matter when sizing, which `bench` reports.
NOT_ON_DASHBOARD = {"qwenbatch:gpu_memory_peak_allocated_bytes", "qwenbatch:gpu_memory_peak_reserved_bytes"}


def missing(what: str, package: str):
    """Skip where the tool is not installed; in CI (CI set), where .ci/run installs it, fail instead."""
    reason = f"{what} is not installed (Debian: apt-get install {package})"
    if os.environ.get("CI"):
        pytest.fail(reason + "; CI must install it")
    pytest.skip(reason)


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"`{name}`", "prometheus")
    return path


def run(*cmd: str, cwd: Path = DEPLOY, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"] if "alert" in rule]


def dashboard_exprs() -> list[str]:
    """Every PromQL query of the dashboard: its panels' targets and its query variables."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def label_values_query(expr: str) -> tuple[str, str] | None:
    """``label_values(METRIC, LABEL)`` (a Grafana variable query) as (METRIC, LABEL)."""
    m = re.fullmatch(r"label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)", expr.strip())
    return (m[1], m[2]) if m else None


def metrics_text(url: str) -> str:
    response = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def exported_series(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name (``qwenbatch:x_bucket``, ``qwenbatch:y_total``, ...) -> the label sets it has."""
    series: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(dict(sample.labels))
    return series


def sample_value(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def complete(url: str, prompt: str, max_tokens: int = 4) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(
        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    )
    assert response.status_code == 200, response.text


def idle_metrics(url: str) -> str:
    """/metrics once nothing runs or waits (every finished request's stats are in)."""

    def check() -> str | None:
        text = metrics_text(url)
        quiet = sample_value(text, "qwenbatch:num_requests_running") == 0
        return text if quiet and sample_value(text, "qwenbatch:num_requests_waiting") == 0 else None

    return wait_for(check, "the server to be idle")


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    """A live server on the tiny Qwen3 with an API key; one request already served."""
    settings = ServerSettings(
        served_model_names=[MODEL], api_keys=[API_KEY], data_dir=tmp_path_factory.mktemp("monitoring-data")
    )
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24)
    with RunningServer(settings, config) as srv:
        complete(srv.url, "The quick brown fox")
        yield srv


# -- alert rules -------------------------------------------------------------------------------------


def test_alert_rules_pass_promtool_check():
    result = run(tool("promtool"), "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_alert_unit_tests_pass_and_show_every_alert_firing_and_not_firing():
    result = run(tool("promtool"), "test", "rules", ALERT_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout

    suite = load_yaml(ALERT_TESTS)
    assert suite["rule_files"] == [ALERTS.name]
    fired: set[tuple[str, str]] = set()
    quiet: set[str] = set()
    for case in suite["tests"]:
        for check in case.get("alert_rule_test", []):
            if check.get("exp_alerts"):
                fired |= {(check["alertname"], a["exp_labels"]["severity"]) for a in check["exp_alerts"]}
            else:
                quiet.add(check["alertname"])
    # Every rule (two share QwenbatchRequestsWaitingTooLong, told apart by severity) is seen firing ...
    assert {(r["alert"], r["labels"]["severity"]) for r in alert_rules()} == fired
    # ... and every alert is seen not firing.
    assert {r["alert"] for r in alert_rules()} == quiet


def test_alert_unit_tests_catch_a_broken_threshold(tmp_path):
    """The unit tests are not vacuous: the KV-cache alert at 0.99 instead of 0.95 fails them."""
    rules = ALERTS.read_text()
    assert rules.count("qwenbatch:kv_cache_usage_perc > 0.95") == 1
    (tmp_path / ALERTS.name).write_text(rules.replace("kv_cache_usage_perc > 0.95", "kv_cache_usage_perc > 0.99"))
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    result = run(tool("promtool"), "test", "rules", ALERT_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "QwenbatchKVCacheNearlyFull" in result.stdout + result.stderr


# -- Prometheus' config and the compose file -----------------------------------------------------------


def test_prometheus_config_passes_promtool_check(tmp_path):
    promtool = tool("promtool")
    result = run(promtool, "check", "config", "--syntax-only", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    # The full check also reads the credentials file and the rule files it names: run it on a copy whose
    # credentials file exists here, with the rules beside it as in the Prometheus container.
    text = PROMETHEUS_CONFIG.read_text()
    assert text.count(f"credentials_file: {SECRET_PATH}") == 1
    key = tmp_path / "api-key"
    key.write_text(API_KEY + "\n")
    (tmp_path / "prometheus.yml").write_text(text.replace(SECRET_PATH, str(key)))
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    result = run(promtool, "check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def bind_mounts(service: dict) -> dict[str, Path]:
    """A service's bind mounts: container path -> host path (relative ones resolved from deploy/)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (DEPLOY / source).resolve()
    return mounts


def test_compose_wires_the_files_together():
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    assert set(services) == {"qwenbatch", "prometheus", "grafana"}

    # qwenbatch: built from the repository's Dockerfile, its keys from the secret, serving on the port scraped.
    qb = services["qwenbatch"]
    assert (DEPLOY / qb["build"]["context"]).resolve() == ROOT
    assert (ROOT / qb["build"]["dockerfile"]).is_file(), "compose.yaml builds from a Dockerfile at the repo root"
    env = qb["environment"]
    assert env["QWENBATCH_HOST"] == "0.0.0.0" and env["QWENBATCH_API_KEY_FILE"] == SECRET_PATH
    port = env["QWENBATCH_PORT"]
    assert [p.rsplit(":", 1)[1] for p in qb["ports"]] == [port]
    assert f"qwenbatch-data:{env['QWENBATCH_DATA_DIR']}" in qb["volumes"]  # the Batch API's state outlives it

    # Prometheus: the config and rules from deploy/ where the config expects them, the same secret.
    prom = services["prometheus"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prom["image"]), prom["image"]
    flags = dict(flag.removeprefix("--").split("=", 1) for flag in prom["command"] if "=" in flag)
    mounts = bind_mounts(prom)
    config_path = flags["config.file"]
    assert mounts[config_path] == PROMETHEUS_CONFIG
    config = load_yaml(PROMETHEUS_CONFIG)
    for rule_file in config["rule_files"]:
        assert mounts[str(Path(config_path).parent / rule_file)] == ALERTS
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "qwenbatch"  # the name QwenbatchDown looks for
    assert job["static_configs"] == [{"targets": [f"qwenbatch:{port}"]}]
    assert job["authorization"]["credentials_file"] == SECRET_PATH
    assert Path(SECRET_PATH).parent == Path("/run/secrets")
    assert qb["secrets"] == prom["secrets"] == [Path(SECRET_PATH).name]
    assert "${QWENBATCH_API_KEY_FILE:?" in compose["secrets"][Path(SECRET_PATH).name]["file"]  # required

    # Grafana: provisioning and the dashboard from deploy/, the data source pointing at Prometheus.
    grafana = services["grafana"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"]), grafana["image"]
    mounts = bind_mounts(grafana)
    assert mounts["/etc/grafana/provisioning/datasources"] == PROVISIONING / "datasources"
    assert mounts["/etc/grafana/provisioning/dashboards"] == PROVISIONING / "dashboards"
    (dashboard_path,) = [target for target, source in mounts.items() if source == DASHBOARD]
    (provider,) = load_yaml(PROVISIONING / "dashboards" / "qwenbatch.yml")["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == str(Path(dashboard_path).parent)
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_path
    (source,) = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    listen = flags.get("web.listen-address", "0.0.0.0:9090")
    assert source["type"] == "prometheus" and source["url"] == f"http://prometheus:{listen.rsplit(':', 1)[1]}"
    assert source["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]

    # Every file mounted exists; every named volume is declared.
    for service in services.values():
        for host_path in bind_mounts(service).values():
            assert host_path.exists(), host_path
        for volume in service.get("volumes", []):
            name = volume.split(":")[0]
            assert name.startswith((".", "/")) or name in compose["volumes"], name


def compose_command() -> list[str]:
    if shutil.which("docker") and run("docker", "compose", "version").returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    missing("neither `docker compose` nor `docker-compose`", "docker-compose")


def test_compose_file_is_valid_and_needs_the_key_file(tmp_path):
    cmd = [*compose_command(), "-f", str(COMPOSE), "config"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QWENBATCH_", "GRAFANA_", "COMPOSE_"))}
    refused = run(*cmd, "-q", env=env)
    assert refused.returncode != 0 and "QWENBATCH_API_KEY_FILE" in refused.stderr
    key = tmp_path / "api-key"
    key.write_text(API_KEY + "\n")
    result = run(*cmd, env={**env, "QWENBATCH_API_KEY_FILE": str(key)})
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(resolved["services"]) == {"qwenbatch", "prometheus", "grafana"}
    assert resolved["secrets"]["qwenbatch_api_key"]["file"] == str(key)


def test_dashboard_is_well_formed():
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            # Every metric in it is filtered to the chosen model.
            selectors = SELECTOR.findall(target["expr"])
            assert len(selectors) == len(METRIC.findall(target["expr"])), target["expr"]
            for _, matchers in selectors:
                assert ("model_name", "=", "$model_name") in MATCHER.findall(matchers), target["expr"]
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]


# -- names against a live server -------------------------------------------------------------------------


def check_names(expr: str, series: dict[str, list[dict[str, str]]]) -> None:
    """Every metric ``expr`` names is exported; every label it matches or groups by is on it."""
    names = set(METRIC.findall(expr))
    assert names, f"no qwenbatch metric in {expr!r}"
    for name in names:
        assert name in series, f"{name} (in {expr!r}) is not in /metrics"
    labels_of = {name: set().union(*series[name]) for name in names}
    for name, matchers in SELECTOR.findall(expr):
        for label, op, value in MATCHER.findall(matchers):
            if label in TARGET_LABELS:
                continue
            assert label in labels_of[name], f"{name} has no label {label} (in {expr!r})"
            if op == "=" and "$" not in value:
                assert any(s.get(label) == value for s in series[name]), f'{name}{{{label}="{value}"}} never appears'
    exported = set().union(*labels_of.values()) | TARGET_LABELS
    for group in GROUPING.findall(expr):
        for label in filter(None, (part.strip() for part in group.split(","))):
            assert label in exported, f"grouping by {label}, which none of {sorted(names)} has (in {expr!r})"
    if (query := label_values_query(expr)) is not None:
        assert query[1] in labels_of[query[0]], expr


def test_every_metric_of_the_dashboard_and_the_alerts_is_exported(server):
    text = idle_metrics(server.url)
    assert sample_value(text, "qwenbatch:time_to_first_token_seconds_count") >= 1  # histograms have series
    # The GPU gauges exist only on CUDA: take them from the same class, built as on a CUDA server.
    as_on_cuda = generate_latest(ServerMetrics(MODEL, "cuda").registry).decode()
    series = exported_series(as_on_cuda) | exported_series(text)
    for expr in dashboard_exprs():
        check_names(expr, series)
    for rule in alert_rules():
        if rule["alert"] != "QwenbatchDown":  # the only one on Prometheus' own `up`
            check_names(rule["expr"], series)

    # And the other way: every exported metric is on the dashboard (histograms through their buckets).
    on_board = {name for expr in dashboard_exprs() for name in METRIC.findall(expr)}
    families = [*text_string_to_metric_families(as_on_cuda), *text_string_to_metric_families(text)]
    for family in families:
        name = family.name
        shown = {"histogram": f"{name}_bucket", "counter": f"{name}_total"}.get(family.type, name)
        assert shown in on_board or name in NOT_ON_DASHBOARD, f"{name} is exported but not on the dashboard"


# -- a real Prometheus ---------------------------------------------------------------------------------------


class Prometheus:
    """``prometheus`` on 127.0.0.1:<free port> with a config written to ``folder``; always stopped on exit."""

    def __init__(self, binary: str, folder: Path, config: dict) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = folder / "prometheus.log"
        self.cmd = [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]

    def __enter__(self) -> Prometheus:
        self.log_file = self.log.open("w")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self.log_file, stderr=self.log_file)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log_file.close()

    def get(self, path: str, **params) -> dict:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
        response = httpx.get(self.url + path, params=params, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()}")
        try:
            return httpx.get(self.url + "/-/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False


def test_real_prometheus_scrapes_the_server_with_its_key(server, tmp_path):
    binary = tool("prometheus")
    key_file = tmp_path / "api-key"
    key_file.write_text(API_KEY + "\n")  # as the server reads --api-key-file: one key a line
    target = f"127.0.0.1:{server.port}"
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": "qwenbatch",
                "authorization": {"type": "Bearer", "credentials_file": str(key_file)},
                "static_configs": [{"targets": [target]}],
            },
            {"job_name": "qwenbatch-without-key", "static_configs": [{"targets": [target]}]},
        ],
    }
    with Prometheus(binary, tmp_path, config) as prom:
        deadline = time.monotonic() + 60  # to start and scrape
        wait_for(prom.ready, "prometheus to be ready", timeout=60)

        def up(job: str) -> float | None:
            result = prom.query(f'up{{job="{job}"}}')
            return float(result[0]["value"][1]) if result else None

        wait_for(lambda: up("qwenbatch") == 1, "a scrape with the key", timeout=deadline - time.monotonic())
        wait_for(lambda: up("qwenbatch-without-key") is not None, "a scrape without the key", timeout=10)
        assert up("qwenbatch-without-key") == 0
        (refused,) = [t for t in prom.get("/api/v1/targets")["activeTargets"] if t["scrapePool"].endswith("-key")]
        assert "401" in refused["lastError"], refused

        for prompt in ("Python is a", "def add(a, b):", "Batch inference pushes"):
            complete(server.url, prompt)
        text = idle_metrics(server.url)
        ttft_count = sample_value(text, "qwenbatch:time_to_first_token_seconds_count")
        assert ttft_count >= 4  # the fixture's request and these three
        # What the server's own /metrics says now that it is idle, and Prometheus must come to store.
        expected = {
            name: sample_value(text, name)
            for name in (
                "qwenbatch:num_requests_running",
                "qwenbatch:num_requests_waiting",
                "qwenbatch:time_to_first_token_seconds_count",
                "qwenbatch:e2e_request_latency_seconds_count",
                "qwenbatch:generation_tokens_total",
            )
        }

        def stored() -> dict[str, float]:
            return {
                name: float(result[0]["value"][1]) if (result := prom.query(f'{name}{{job="qwenbatch"}}')) else None
                for name in expected
            }

        wait_for(lambda: stored() == expected, f"Prometheus to store {expected}", timeout=15)
        (running,) = prom.query("qwenbatch:num_requests_running")
        assert running["metric"] == {
            "__name__": "qwenbatch:num_requests_running",
            "job": "qwenbatch",
            "instance": target,
            "model_name": MODEL,
        }

        # The quantile lies within the highest bucket the server's own /metrics has observations up to.
        buckets = [
            (float(s.labels["le"]), s.value)
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "qwenbatch:time_to_first_token_seconds_bucket"
        ]
        upper = min(le for le, count in buckets if count == ttft_count)
        p99_expr = 'histogram_quantile(0.99, rate(qwenbatch:time_to_first_token_seconds_bucket{job="qwenbatch"}[30s]))'

        def p99() -> float | None:
            result = prom.query(p99_expr)
            value = float(result[0]["value"][1]) if result else math.nan
            return None if math.isnan(value) else value

        value = wait_for(p99, "a TTFT quantile", timeout=10)
        assert 0 < value <= upper, (value, upper)

        # The dashboard's queries all parse and, the GPU gauges aside, return series from this CPU server.
        for expr in dashboard_exprs():
            if (query := label_values_query(expr)) is not None:
                values = prom.get(f"/api/v1/label/{query[1]}/values", **{"match[]": query[0]})
                assert values == [MODEL], expr
                continue
            promql = expr.replace("$model_name", MODEL).replace("$__rate_interval", "5m")
            result = prom.query(promql)
            assert result or "gpu_memory" in expr, f"no series for the dashboard's {promql!r}"

        # The alert rules loaded and evaluate without errors; none fires on this healthy server.
        def evaluated() -> list[dict] | None:
            rules = [rule for group in prom.get("/api/v1/rules")["groups"] for rule in group["rules"]]
            return rules if all(rule["health"] != "unknown" for rule in rules) else None

        rules = wait_for(evaluated, "the alert rules to be evaluated", timeout=15)
        assert len(rules) == len(alert_rules())
        assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]
        assert prom.get("/api/v1/alerts")["alerts"] == []
