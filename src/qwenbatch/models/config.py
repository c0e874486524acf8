"""The architecture facts our model code needs, read from a checkpoint's config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # per-head q/k RMSNorm, an optional qkv bias


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts MLP of Qwen2-MoE / Qwen3-MoE: each token's MLP is the sum of its ``experts_per_token``
    best-scored experts' SwiGLUs (of width ``intermediate_size``), weighted by their softmax scores (renormalised
    over the chosen ones where ``norm_topk_prob``); Qwen2-MoE adds a shared expert of ``shared_intermediate_size``
    behind a sigmoid gate. Layers listed in ``mlp_only_layers``, and those not at a multiple of
    ``decoder_sparse_step``, keep a dense MLP of the model's ``intermediate_size``."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has the experts rather than a dense MLP (transformers' rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Qwen2/Qwen3 decoder, dense or mixture-of-experts.

    Qwen2 and Qwen3 differ only in ``attention_bias`` (Qwen2 has a qkv bias) and ``qk_norm``
    (Qwen3 normalises queries and keys per head); Qwen3 also decouples ``head_dim`` from
    ``hidden_size / num_attention_heads``. The -MoE architectures add ``moe`` (None for dense models).
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
    moe: MoeConfig | None = None

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
        qwen3 = arch in _QWEN3_ARCHITECTURES
        qkv_bias = bool(cfg.get("qkv_bias", True)) if arch == "Qwen2MoeForCausalLM" else True
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
            # Qwen2 always has a qkv bias (its config has no switch), Qwen2-MoE unless qkv_bias says not; Qwen3
            # reads the flag.
            attention_bias=bool(cfg.get("attention_bias", False)) if qwen3 else qkv_bias,
            qk_norm=qwen3,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            moe=_moe_config(cfg, arch, need, source) if arch.endswith("MoeForCausalLM") else None,
        )

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The decoder layers whose MLP is the experts (none for a dense model)."""
        if self.moe is None:
            return ()
        return tuple(i for i in range(self.num_hidden_layers) if self.moe.is_sparse(i))

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


def _moe_config(cfg: dict[str, Any], arch: str, need, source: str) -> MoeConfig | None:
    # transformers 5 saves the expert count as num_local_experts; the published configs say num_experts.
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 0:
        raise ValueError(f"{source}: missing or bad field 'num_experts': {num_experts!r}")
    if num_experts == 0:  # transformers' rule: every layer dense
        return None
    per_token = need("num_experts_per_tok")
    if not 1 <= per_token <= num_experts:
        raise ValueError(
            f"{source}: num_experts_per_tok ({per_token}) must be between 1 and num_experts ({num_experts})"
        )
    step = int(cfg.get("decoder_sparse_step") or 1)
    qwen2 = arch == "Qwen2MoeForCausalLM"
    return MoeConfig(
        num_experts=num_experts,
        experts_per_token=per_token,
        intermediate_size=need("moe_intermediate_size"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        # Qwen2-MoE always has a shared expert (transformers' default width where the config leaves it out).
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 5632 if qwen2 else 0) or 0),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )
