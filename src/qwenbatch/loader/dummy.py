"""Random weights of a named shape, for benchmarks (vLLM's ``--load-format dummy``)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from qwenbatch.loader.hf import instantiate
from qwenbatch.models.config import ModelConfig

_QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "eos_token_id": [151645, 151643],
}

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": _QWEN3_0_6B,
    "qwen3-reranker-0.6b": _QWEN3_0_6B,
    "qwen3-4b": {
        **_QWEN3_0_6B,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rope_theta": 5_000_000.0,
        "max_position_embeddings": 262144,
    },
    # Qwen3-30B-A3B: 128 experts of width 768, 8 of them a token (3.3 B of its 30.5 B parameters).
    "qwen3-30b-a3b": {
        **_QWEN3_0_6B,
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "eos_token_id": [151645, 151643],
    },
}


def dummy_config(shape: str) -> ModelConfig:
    """The ModelConfig of a named shape, or of a folder holding a config.json."""
    if shape.lower() in SHAPES:
        return ModelConfig.from_hf_dict(SHAPES[shape.lower()], source=f"dummy shape '{shape}'")
    folder = Path(shape)
    if folder.is_dir():
        return ModelConfig.from_folder(folder)
    raise ValueError(f"unknown dummy shape '{shape}'; use one of {', '.join(SHAPES)} or a config folder")


def load_dummy_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> nn.Module:
    """Build ``cfg``'s model with small random weights (norms at 1), reproducible from ``seed``."""
    model = instantiate(cfg, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, 0.02, generator=gen)
    return model
