"""Model sources: a Hugging Face folder, a GGUF file, the embedded default, or dummy weights."""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qwenbatch.loader.default_model import cache_root, default_model_dir
from qwenbatch.loader.dummy import dummy_config, load_dummy_model
from qwenbatch.loader.gguf import convert_gguf
from qwenbatch.loader.hf import CheckpointReader, load_hf_checkpoint
from qwenbatch.loader.kernels import int8_quantized_weights
from qwenbatch.models.config import ModelConfig

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")
# Raised whenever a conversion writes something new, so that GGUF files converted before are converted again
# (2: generation_config.json holds the GGUF's sampling values).
CONVERSION_FORMAT = 2


@dataclass
class LoadedModel:
    """A model ready to run, where its tokenizer lives (None for dummy shapes without one), and its weights
    as the files hold them (None for dummy weights), for layers that re-read them more exactly; ``folder``:
    the Hugging Face folder it was read from (None for dummy weights)."""

    model: nn.Module
    config: ModelConfig
    tokenizer_dir: Path | None
    checkpoint: CheckpointReader | None = None
    folder: Path | None = None


def resolve_model_dir(model: str) -> Path:
    """The Hugging Face folder behind ``model``: "default", a folder, or a .gguf file (converted once)."""
    if model == "default":
        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf_dir(path)
    if path.exists():
        raise ValueError(f"--model {model}: not a model folder or a .gguf file")
    raise FileNotFoundError(f"--model {model}: no such folder or file (models are not downloaded from a hub)")


def check_model_source(model: str, load_format: str = "auto") -> None:
    """Fail fast, reading no weights, when ``model`` cannot be a model (a server checks before it listens)."""
    if load_format == "dummy":
        dummy_config(model)
        return
    if model == "default":
        return
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"--model {model}: the folder has no config.json")
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return
    if path.exists():
        raise ValueError(f"--model {model}: not a model folder or a .gguf file")
    raise FileNotFoundError(f"--model {model}: no such folder or file (models are not downloaded from a hub)")


def _converted_gguf_dir(path: Path) -> Path:
    stat = path.resolve().stat()
    source = f"{CONVERSION_FORMAT}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".build-") as tmp:
        out = Path(tmp) / "out"
        convert_gguf(path, out)
        shutil.rmtree(folder, ignore_errors=True)
        out.rename(folder)
    return folder


def model_config_of(config) -> ModelConfig:
    """The architecture of an EngineConfig's model, without loading weights."""
    if config.load_format == "dummy":
        return dummy_config(config.model)
    return ModelConfig.from_folder(resolve_model_dir(config.model))


def load_model(
    model: str,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    without_head: bool = False,
    quantization: str = "none",
    reads_head: bool = False,
) -> LoadedModel:
    """Load ``model`` in ``dtype`` on ``device``; ``load_format="dummy"`` builds random weights of its shape;
    ``without_head``: the checkpoint may lack the LM head (an embedding model). With ``quantization`` int8 the
    weights it will quantize are left unread (``prepare_kernels`` reads them from the checkpoint), but for the LM
    head's where ``reads_head`` (a reranker takes its "yes" and "no" rows before the head is quantized)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if load_format == "dummy":
        cfg = dummy_config(model)
        folder = Path(model)
        tokenizer_dir = folder if (folder / "tokenizer.json").is_file() else None
        return LoadedModel(load_dummy_model(cfg, dtype, device, seed), cfg, tokenizer_dir)
    folder = resolve_model_dir(model)
    cfg = ModelConfig.from_folder(folder)
    unread = None
    if quantization == "int8":
        unread = lambda m: int8_quantized_weights(m) - ({"lm_head.weight"} if reads_head else set())  # noqa: E731
    model, checkpoint = load_hf_checkpoint(folder, dtype, device, without_head, unread)
    return LoadedModel(model, cfg, folder, checkpoint, folder)
