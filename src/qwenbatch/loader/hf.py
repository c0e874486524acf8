"""Load a Hugging Face checkpoint folder (config.json + *.safetensors) into our model code."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from qwenbatch.models.config import ModelConfig
from qwenbatch.models.registry import model_class

logger = logging.getLogger(__name__)


def instantiate(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model on the meta device, then give it uninitialised storage on ``device``.

    Nothing is initialised twice: the caller fills every parameter (from a checkpoint or randomly).
    """
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty re-creates parameters, which unties them
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_hf_model(folder: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Load ``folder``'s safetensors (one file or sharded) into a freshly built model.

    Files are memory-mapped and copied tensor by tensor, so peak memory is the model plus one
    tensor. Missing tensors, unexpected ones and shape mismatches raise ValueError naming the
    file and the tensor.
    """
    cfg = ModelConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files in the model folder")
    model = instantiate(cfg, dtype, device)
    expected = model.checkpoint_names()
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in expected:
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # some tied checkpoints still store the head
                    raise ValueError(f"{path}: unexpected tensor '{name}' for {cfg.architecture}")
                ours, rows = expected[name]
                target = params[ours].data[rows]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{path}: tensor '{name}' has shape {tuple(tensor.shape)}, "
                        f"config.json implies {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{folder}: checkpoint is missing tensors: {shown}")
    logger.info("loaded %s (%d tensors from %d files) as %s", folder, len(seen), len(files), dtype)
    return model
