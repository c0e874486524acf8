"""Architecture name (config.json's ``architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn

from qwenbatch.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from qwenbatch.models.qwen import QwenForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen2ForCausalLM": QwenForCausalLM,
    "Qwen3ForCausalLM": QwenForCausalLM,
    "Qwen2MoeForCausalLM": QwenForCausalLM,
    "Qwen3MoeForCausalLM": QwenForCausalLM,
}
assert set(_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The class that implements ``cfg.architecture``; ValueError for an unknown one."""
    try:
        return _REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"unknown architecture {cfg.architecture!r}; supported: {', '.join(sorted(_REGISTRY))}"
        ) from None
