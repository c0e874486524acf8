"""Load a Hugging Face checkpoint folder (config.json + *.safetensors) into our model code."""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qwenbatch.models.config import ModelConfig
from qwenbatch.models.registry import model_class

logger = logging.getLogger(__name__)


_INIT_PATCH = threading.Lock()


@contextlib.contextmanager
def _no_random_init() -> Iterator[None]:
    """nn.Linear and nn.Embedding skip their random initialisation, in the whole process while it lasts (a lock keeps
    two of these from nesting). On the meta device it computes nothing, but torch runs it through its Python
    references, which import torch._dynamo: ~2.4 s of every start."""
    with _INIT_PATCH:
        saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
        try:
            for cls in saved:
                cls.reset_parameters = lambda self: None
            yield
        finally:
            for cls, reset in saved.items():
                cls.reset_parameters = reset


def instantiate(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model on the meta device, then give it uninitialised storage on ``device``.

    Nothing is initialised twice: the caller fills every parameter (from a checkpoint or randomly).
    """
    with torch.device("meta"), _no_random_init():
        model = model_class(cfg)(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty re-creates parameters, which unties them
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie in a .safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_index(path: Path) -> list[TensorEntry]:
    """Parse a .safetensors header (8-byte little-endian length, then JSON); entries in file order."""
    with path.open("rb") as f:
        try:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        except (struct.error, ValueError) as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from e
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        entries.append(
            TensorEntry(
                name, _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + header_len + begin, end - begin
            )
        )
    return sorted(entries, key=lambda e: e.offset)


def _read_into(f, entry: TensorEntry, target: torch.Tensor) -> None:
    """Fill ``target`` with ``entry``'s values: straight into its memory when the dtypes match."""
    f.seek(entry.offset)
    if target.dtype == entry.dtype and target.is_contiguous() and target.device.type == "cpu":
        dest = target
    else:
        dest = torch.empty(entry.shape, dtype=entry.dtype)
    view = memoryview(dest.view(-1).view(torch.uint8).numpy())
    if f.readinto(view) != entry.nbytes:
        raise ValueError(f"{f.name}: tensor '{entry.name}' is truncated")
    if dest is not target:
        target.copy_(dest)


@dataclass(frozen=True)
class _Part:
    """One checkpoint tensor and the part of our parameter it fills: rows, or (expert, rows) of stacked experts."""

    path: Path
    entry: TensorEntry
    rows: slice | tuple[int, slice]


class CheckpointReader:
    """A model's parameters as its folder's safetensors hold them, read on demand by our parameter names.

    The loader fills a model from it; ``--quantization int8`` re-reads linear weights from it in float32,
    since the loaded model may hold a rounded (bfloat16) copy and int8 must see a GGUF's blocks exactly.
    Building it checks the files against ``model``: unexpected tensors, missing ones and shape mismatches
    raise ValueError naming the file and the tensor. A backbone saved without the ``model.`` prefix is read as
    the model's; ``without_head``: the LM head may be absent (an embedding model never computes logits).
    """

    def __init__(self, folder: Path, model: nn.Module, without_head: bool = False) -> None:
        cfg = model.config
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors files in the model folder")
        expected = model.checkpoint_names()
        params = dict(model.named_parameters())
        self.files = files
        self._parts: dict[str, list[_Part]] = {}
        self._shapes = {name: tuple(p.shape) for name, p in params.items()}
        seen: set[str] = set()  # the checkpoint names read, as ``expected`` spells them
        for path in files:
            for entry in read_safetensors_index(path):
                name = entry.name
                if name not in expected and f"model.{name}" in expected:
                    name = f"model.{name}"  # a backbone saved alone (Qwen3-Embedding: embed_tokens, layers.*, norm)
                if name not in expected:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # some tied checkpoints still store the head
                    raise ValueError(f"{path}: unexpected tensor '{entry.name}' for {cfg.architecture}")
                seen.add(name)
                ours, rows = expected[name]
                target_shape = tuple(params[ours].data[rows].shape)
                if entry.shape != target_shape:
                    raise ValueError(
                        f"{path}: tensor '{entry.name}' has shape {entry.shape}, config.json implies {target_shape}"
                    )
                self._parts.setdefault(ours, []).append(_Part(path, entry, rows))
        missing = sorted(set(expected) - seen)
        if missing == ["lm_head.weight"] and without_head:
            missing = []  # an embedding model's checkpoint: no head to read, none to use
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"{folder}: checkpoint is missing tensors: {shown}")

    @property
    def parameter_names(self) -> set[str]:
        """Our parameters that the checkpoint fills."""
        return set(self._parts)

    @property
    def tensor_count(self) -> int:
        return sum(len(parts) for parts in self._parts.values())

    def read_into(self, name: str, target: torch.Tensor) -> None:
        """Fill ``target`` (our parameter ``name``'s shape, any dtype) with the checkpoint's values."""
        for part in self._parts[name]:
            with part.path.open("rb", buffering=0) as f:
                _read_into(f, part.entry, target[part.rows])

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of our parameter ``name`` (a linear's weight, not stacked experts) as the checkpoint
        holds them, in float32 (a new tensor); only those rows are read, so a large weight can be taken in slices."""
        shape = self._shapes[name]
        stop = shape[0] if stop is None else min(stop, shape[0])
        out = torch.empty((stop - start, *shape[1:]), dtype=torch.float32)
        for part in self._parts[name]:
            first, last, _ = part.rows.indices(shape[0])  # the parameter rows this tensor fills
            lo, hi = max(first, start), min(last, stop)
            if lo >= hi:
                continue
            row_bytes = part.entry.nbytes // max(part.entry.shape[0], 1)
            rows = TensorEntry(
                part.entry.name,
                part.entry.dtype,
                (hi - lo, *part.entry.shape[1:]),
                part.entry.offset + (lo - first) * row_bytes,
                (hi - lo) * row_bytes,
            )
            with part.path.open("rb", buffering=0) as f:
                _read_into(f, rows, out[lo - start : hi - start])
        return out

    def read_expert(self, name: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s matrix of our stacked parameter ``name`` (``...experts.gate_up_proj`` or
        ``down_proj``) as the checkpoint holds it, in float32 (a new tensor)."""
        out = torch.empty(self._shapes[name][1:], dtype=torch.float32)
        for part in self._parts[name]:
            if part.rows[0] == expert:
                with part.path.open("rb", buffering=0) as f:
                    _read_into(f, part.entry, out[part.rows[1]])
        return out


def load_hf_model(folder: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """``load_hf_checkpoint``'s model."""
    return load_hf_checkpoint(folder, dtype, device)[0]


def load_hf_checkpoint(
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    without_head: bool = False,
    leave_unread: Callable[[nn.Module], set[str]] | None = None,
) -> tuple[nn.Module, CheckpointReader]:
    """Load ``folder``'s safetensors (one file or sharded) into a freshly built model; with the reader it was
    filled from (for layers that re-read their weights as the files hold them). The parameters named by
    ``leave_unread(model)`` keep their storage unwritten, so that its pages are never touched: ``--quantization
    int8`` reads those weights from the reader as it quantizes them, so they need never be resident in full.

    Each tensor is read from the file straight into its parameter (through a temporary only when
    the dtype differs), so peak memory is the model plus at most one tensor, and the file's pages
    stay in the page cache instead of being counted again in our RSS as an mmap would be.
    Missing tensors, unexpected ones and shape mismatches raise ValueError naming the file and
    the tensor; ``without_head``: a checkpoint without the LM head (an embedding model's) ties it to the
    embeddings, as a placeholder that never runs.
    """
    model = instantiate(ModelConfig.from_folder(folder), dtype, device)
    reader = CheckpointReader(folder, model, without_head)
    if "lm_head.weight" not in reader.parameter_names:  # an embedding checkpoint: the head never runs
        model.lm_head.weight = model.model.embed_tokens.weight
    unread = leave_unread(model) if leave_unread is not None else set()
    for name, param in model.named_parameters():
        if name not in unread:
            reader.read_into(name, param.data)
    logger.info("loaded %s (%d tensors from %d files) as %s", folder, reader.tensor_count, len(reader.files), dtype)
    return model, reader
