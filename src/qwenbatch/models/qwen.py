"""Qwen2 and Qwen3 decoders, dense and mixture-of-experts, in plain PyTorch over packed batches and a paged KV
cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenbatch.layers.activation import SiluAndMul
from qwenbatch.layers.attention import AttentionMetadata
from qwenbatch.layers.moe import GroupedExperts, TopKRouter
from qwenbatch.layers.norm import RMSNorm
from qwenbatch.layers.rotary import Rope, RotaryEmbedding
from qwenbatch.models.config import ModelConfig


class QwenAttention(nn.Module):
    """GQA self-attention with a fused qkv projection; Qwen2 adds a bias, Qwen3 per-head q/k RMSNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        return self.o_proj(meta.attend(q, k, v, kv_cache, self.scale))


class QwenMLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class QwenSparseMoeBlock(nn.Module):
    """The MLP of a Qwen2-MoE / Qwen3-MoE sparse layer: the router's top-k experts, weighted; Qwen2-MoE adds a
    shared expert scaled by sigmoid(``shared_expert_gate``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.gate = TopKRouter(cfg.hidden_size, moe.num_experts, moe.experts_per_token, moe.norm_topk_prob)
        self.experts = GroupedExperts(moe.num_experts, cfg.hidden_size, moe.intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = QwenMLP(cfg.hidden_size, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.gate(x))
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class QwenDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QwenAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = index in cfg.sparse_layers
        self.mlp = QwenSparseMoeBlock(cfg) if sparse else QwenMLP(cfg.hidden_size, cfg.intermediate_size)
        # Set by the loader where a kernel runs the whole layer for some steps (layers/fused_decode.py): it
        # says which (``accepts(meta)``) and returns what this forward returns.
        self.fused_decode = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer on the hidden states ``x + residual`` (``x`` alone where ``residual`` is None), returned the same
        way: the MLP's output and the residual stream it is still to be added to, so that each residual add runs in
        the norm after it (``RMSNorm.add_and_norm``). The residual stream is updated in place: ``residual``, or ``x``
        where it is None. A fused decode layer (``fused_decode``) computes the same, the same way."""
        if self.fused_decode is not None and self.fused_decode.accepts(meta):
            return self.fused_decode(x, residual, rope, kv_cache, meta)
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add_and_norm(x, residual)
        h = self.post_attention_layernorm.add_and_norm(self.self_attn(h, rope, kv_cache, meta), residual)
        return self.mlp(h), residual


class QwenModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(QwenDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Set by the loader where every layer is fused (layers/fused_decode.py): runs them all in one call for the
        # steps it ``accepts``, as the loop below would.
        self.fused_decode = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        if self.fused_decode is not None and self.fused_decode.accepts(meta):
            x, residual = self.fused_decode(x, rope, kv_caches, meta)
            return self.norm.add_and_norm(x, residual)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)


class QwenForCausalLM(nn.Module):
    """Qwen2ForCausalLM / Qwen3ForCausalLM and their -MoE forms: the decoder plus a (possibly tied) LM head.

    ``forward`` returns hidden states for all packed tokens; ``compute_logits`` is applied only
    to the rows that sample, so a prefill of 2,000 tokens does not pay for 2,000 x vocab logits.
    """

    # checkpoint name fragment -> (our fused parameter, which slice)
    stacked_params = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = QwenModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def reserve_positions(self, length: int, device: torch.device) -> None:
        """Make the rotary table cover positions [0, length) before a forward reads them."""
        self.model.rotary.reserve(length, device)

    def checkpoint_names(self) -> dict[str, tuple[str, slice | tuple[int, slice]]]:
        """Map every checkpoint tensor name this model expects to (our parameter, the part of it the tensor
        fills: rows, or an expert's index and rows where the experts are stacked)."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        qkv_rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        names: dict[str, tuple[str, slice | tuple[int, slice]]] = {}
        # remove_duplicate=True drops a tied lm_head.weight: the checkpoint does not carry it.
        for ours, param in self.named_parameters(remove_duplicate=True):
            if ".experts." in ours:
                names.update(_expert_names(ours, param.shape))
                continue
            stacked = [s for s in self.stacked_params if f".{s[1]}." in ours]
            if not stacked:
                names[ours] = (ours, slice(None))
            inter = param.shape[0] // 2  # a gate_up_proj's: the model's, or its shared expert's, width
            gate_up_rows = {0: slice(0, inter), 1: slice(inter, 2 * inter)}
            for ckpt_part, fused, part in stacked:
                rows = qkv_rows[part] if fused == "qkv_proj" else gate_up_rows[part]
                names[ours.replace(fused, ckpt_part)] = (ours, rows)
        return names


def _expert_names(ours: str, shape: torch.Size) -> dict[str, tuple[str, tuple[int, slice]]]:
    """The checkpoint's per-expert tensors (``...experts.{e}.gate_proj.weight``, as the published checkpoints and
    transformers' save_pretrained store them) that fill our stacked ``...experts.gate_up_proj`` or ``down_proj``."""
    prefix, stacked = ours.rsplit(".", 1)
    if stacked == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": (ours, (e, slice(None))) for e in range(shape[0])}
    inter = shape[1] // 2
    names = {}
    for e in range(shape[0]):
        names[f"{prefix}.{e}.gate_proj.weight"] = (ours, (e, slice(0, inter)))
        names[f"{prefix}.{e}.up_proj.weight"] = (ours, (e, slice(inter, 2 * inter)))
    return names
