"""The architecture facts our model code needs, read from a checkpoint's config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Qwen2/Qwen3 decoder.

    Qwen2 and Qwen3 differ only in ``attention_bias`` (Qwen2 has a qkv bias) and ``qk_norm``
    (Qwen3 normalises queries and keys per head); Qwen3 also decouples ``head_dim`` from
    ``hidden_size / num_attention_heads``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token per element byte: 2 (K and V) x layers x KV heads x head_dim."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face config dict; a missing or bad field raises ValueError naming it."""

        def need(name: str, kind: type = int) -> Any:
            if name not in cfg or cfg[name] is None:
                raise ValueError(f"{source}: missing field '{name}'")
            value = cfg[name]
            if kind is float and isinstance(value, int):
                value = float(value)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ValueError(f"{source}: field '{name}' must be {kind.__name__}, got {value!r}")
            return value

        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: field 'architectures' is {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        qwen3 = arch == "Qwen3ForCausalLM"
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has a qkv bias (its config has no switch); Qwen3 reads the flag.
            attention_bias=bool(cfg.get("attention_bias", False)) if qwen3 else True,
            qk_norm=qwen3,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        """Read ``folder/config.json`` (and eos ids from ``generation_config.json`` when present)."""
        import json

        path = folder / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model folder")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            gen = json.loads(gen_path.read_text())
            if gen.get("eos_token_id") is not None:
                cfg = {**cfg, "eos_token_id": gen["eos_token_id"]}
        return cls.from_hf_dict(cfg, source=str(path))
