"""Convert a GGUF file (llama.cpp's format) into a Hugging Face folder our loader reads.

Quantized tensors are dequantized to float32, which keeps their values exactly; the tokenizer
and chat template come from the GGUF metadata (through ``transformers``' converter).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor name -> Hugging Face name; "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_tensor_name(gguf_name: str, path: Path) -> str:
    """The Hugging Face name of a GGUF tensor; ValueError naming the file for an unknown one."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ValueError(f"{path}: unknown GGUF tensor '{gguf_name}'")


def _field(reader, key: str, path: Path, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is not None:
            return default
        raise ValueError(f"{path}: GGUF metadata has no '{key}'")
    return field.contents()


def hf_config(reader, path: Path, vocab_size: int, tied: bool) -> dict:
    """config.json contents from the GGUF metadata."""
    arch = _field(reader, "general.architecture", path)
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture '{arch}' is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    heads = int(_field(reader, f"{arch}.attention.head_count", path))
    hidden = int(_field(reader, f"{arch}.embedding_length", path))
    cfg = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", path, heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", path, hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", path, 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", path)),
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", path)),
    }
    if "tokenizer.ggml.bos_token_id" in reader.fields:
        cfg["bos_token_id"] = int(_field(reader, "tokenizer.ggml.bos_token_id", path))
    if "tokenizer.ggml.padding_token_id" in reader.fields:
        cfg["pad_token_id"] = int(_field(reader, "tokenizer.ggml.padding_token_id", path))
    return cfg


# generation_config.json keys from the sampling values a GGUF converter recorded (llama.cpp's convert_hf_to_gguf
# takes them from the model's own generation_config.json).
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def generation_config(reader, eos_token_id) -> dict:
    """generation_config.json contents: the eos ids, and the sampling values the GGUF records, if any (its
    float32 values as the decimals they were written from: 0.6, not 0.6000000238)."""
    sampling = {}
    for key, name in _SAMPLING_KEYS.items():
        if key in reader.fields:
            value = reader.fields[key].contents()
            sampling[name] = float(f"{value:.7g}") if isinstance(value, float) else value
    return {"eos_token_id": eos_token_id, **sampling}


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Write ``out_dir``/{config.json, generation_config.json, model.safetensors, tokenizer files}."""
    import gguf  # deferred: parsing support is needed only when converting

    reader = gguf.GGUFReader(str(path))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, path)
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        tensors[name] = torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))
    tied = "lm_head.weight" not in tensors
    vocab_size = tensors["model.embed_tokens.weight"].shape[0]
    cfg = hf_config(reader, path, vocab_size, tied)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(reader, cfg["eos_token_id"])))
    _save_tokenizer(path, out_dir)
    logger.info("converted %s -> %s", path, out_dir)


def _save_tokenizer(path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out_dir))
