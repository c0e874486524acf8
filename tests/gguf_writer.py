"""Write a tiny Hugging Face checkpoint as a GGUF file, the way llama.cpp's converter lays it out; copy a GGUF file
less its tokenizer's arrays."""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{_HF_TO_GGUF_LAYER[rest]}"


def write_gguf(
    checkpoint: Path, out: Path, quantize: bool = True, qtype: str = "Q8_0", sampling: dict | None = None
) -> dict[str, np.ndarray]:
    """Write ``checkpoint`` as ``out``; 2-D weights as ``qtype`` when ``quantize``; ``sampling``: values for the
    writer's ``add_sampling_<name>`` (temp, top_k, ...), as llama.cpp's converter records a generation config.
    Returns the HF-named float32 values a faithful reader must recover (the dequantized ones)."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = cfg["model_type"]
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    if "head_dim" in cfg and arch == "qwen3":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])

    vocab = dict(tok["model"]["vocab"])
    special = {}
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
        special[added["id"]] = added["special"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [
        gguf.TokenType.CONTROL
        if special.get(i)
        else gguf.TokenType.USER_DEFINED
        if i in special
        else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template((checkpoint / "chat_template.jinja").read_text())
    for name, value in (sampling or {}).items():
        getattr(w, f"add_sampling_{name}")(value)

    expected = {}
    for name, value in load_file(str(checkpoint / "model.safetensors")).items():
        value = value.astype(np.float32)
        if quantize and value.ndim == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            q = gguf.quants.quantize(value, kind)
            w.add_tensor(gguf_name(name), q, raw_shape=q.shape, raw_dtype=kind)
            expected[name] = gguf.quants.dequantize(q, kind).reshape(value.shape)
        else:
            w.add_tensor(gguf_name(name), value)
            expected[name] = value
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


# GGUF value types by their sizes in bytes; 8 is a string, 9 an array (gguf-py's GGUFValueType).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


def _skip_value(data: memoryview, pos: int, kind: int) -> tuple[int, int]:
    """(offset past the value of type ``kind`` at ``pos``, the array's length or 0)."""
    if kind == _STRING:
        return pos + 8 + int.from_bytes(data[pos : pos + 8], "little"), 0
    if kind != _ARRAY:
        return pos + _SCALAR_SIZES[kind], 0
    item, count = int.from_bytes(data[pos : pos + 4], "little"), int.from_bytes(data[pos + 4 : pos + 12], "little")
    pos += 12
    if item in _SCALAR_SIZES:
        return pos + count * _SCALAR_SIZES[item], count
    for _ in range(count):
        pos, _ = _skip_value(data, pos, item)
    return pos, count


def copy_without_vocabulary(src: Path, out: Path) -> None:
    """Copy the GGUF file ``src`` to ``out`` less its tokenizer's arrays (tokens, types, merges), with the vocabulary
    size they gave written as ``<arch>.vocab_size``: the same tensors, byte for byte, for readers that build a model
    only. transformers parses every metadata field of a file twice while loading its model: for Qwen's 151,936
    tokens and merges, ~40 s of its 57 s load of the default model. (gguf-py's GGUFReader, which it uses, would parse
    them here too: this walks the header itself and copies the tensors' bytes as they are.)"""
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        _copy_header_less_vocabulary(memoryview(mapped), out)


def _copy_header_less_vocabulary(data: memoryview, out: Path) -> None:
    assert bytes(data[:4]) == b"GGUF" and int.from_bytes(data[4:8], "little") == 3, "GGUF version 3"
    num_tensors, num_fields = int.from_bytes(data[8:16], "little"), int.from_bytes(data[16:24], "little")
    kept, arch, vocab_size, alignment, pos = [], None, None, 32, 24
    for _ in range(num_fields):
        start, key_len = pos, int.from_bytes(data[pos : pos + 8], "little")
        key = bytes(data[pos + 8 : pos + 8 + key_len]).decode()
        kind = int.from_bytes(data[pos + 8 + key_len : pos + 12 + key_len], "little")
        value = pos + 12 + key_len
        pos, count = _skip_value(data, value, kind)
        if key == "general.architecture":
            arch = bytes(data[value + 8 : pos]).decode()
        elif key == "general.alignment":
            alignment = int.from_bytes(data[value:pos], "little")
        if key == "tokenizer.ggml.tokens":
            vocab_size = count
        if not (key.startswith("tokenizer.") and kind == _ARRAY):
            kept.append(data[start:pos])
    assert arch is not None and vocab_size is not None, "a GGUF with general.architecture and tokenizer.ggml.tokens"
    infos_start = pos
    for _ in range(num_tensors):
        pos += 8 + int.from_bytes(data[pos : pos + 8], "little")  # the name
        pos += 4 + 8 * int.from_bytes(data[pos : pos + 4], "little") + 4 + 8  # dims, type, offset
    tensors_start = -(-pos // alignment) * alignment
    key = f"{arch}.vocab_size".encode()
    vocab_field = len(key).to_bytes(8, "little") + key + _UINT32.to_bytes(4, "little")
    vocab_field += vocab_size.to_bytes(4, "little")
    if any(bytes(field[8 : 8 + len(key)]) == key and int.from_bytes(field[:8], "little") == len(key) for field in kept):
        vocab_field = b""  # the file gives it already
    with open(out, "wb") as f:
        f.write(bytes(data[:16]) + (len(kept) + bool(vocab_field)).to_bytes(8, "little"))
        for field in kept:
            f.write(field)
        f.write(vocab_field)
        f.write(data[infos_start:pos])
        f.write(bytes(-f.tell() % alignment))
        f.write(data[tensors_start:])
