"""Fixtures: tiny random Qwen2/Qwen3 checkpoints with a real (tiny, trained) BPE tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from qwenbatch.cpuinfo import cpu_flags

torch.set_num_threads(min(2, os.cpu_count() or 1))
# Without a GPU, Triton kernels (the CUDA path's attention) run in Triton's interpreter on CPU tensors;
# it must be chosen before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def kernel_targets(*targets: str) -> list[str]:
    """The CPU kernels' build targets a test runs its case on, less "avx2" where this CPU's own build ("native") is
    the AVX2 code already (AVX2, FMA and F16C, no AVX-512): the same code paths built a second time, ~1.5 min of CI
    on 2 cores."""
    flags = cpu_flags()
    native_is_avx2 = {"avx2", "fma", "f16c"} <= flags and "avx512f" not in flags
    return [t for t in targets if not (t == "avx2" and native_is_avx2)]


# Qwen's shape, short: tools offered in a system turn, an assistant's calls as <tool_call> blocks.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Python is a programming language. It is widely used for data science and the web.",
    "用一句话介绍Python编程语言。Python是一种高级编程语言。",
    "Batch inference pushes thousands of prompts through one model as fast as possible.",
    "def add(a, b):\n    return a + b\n",
    "Emoji 🙂 and symbols # @ / % survive tokenization.",
]


def make_tokenizer(folder: Path, extra_tokens: tuple[str, ...] = ()) -> int:
    """Train a small byte-level BPE and save it as a Hugging Face fast tokenizer; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    hf.add_tokens(ADDED_TOKENS + list(extra_tokens))
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(folder))
    return len(hf)


def tiny_shape(vocab: int) -> dict:
    """The tiny test models' config values (Qwen2 and Qwen3 alike) for a vocabulary of ``vocab``."""
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        eos_token_id=2,
        bos_token_id=0,
        pad_token_id=0,
    )


def make_checkpoint(folder: Path, arch: str, seed: int = 0, extra_tokens: tuple[str, ...] = ()) -> Path:
    """A tiny random checkpoint of ``arch`` ("qwen2" or "qwen3") saved the way real ones are."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    folder.mkdir(parents=True, exist_ok=True)
    common = tiny_shape(make_tokenizer(folder, extra_tokens))
    if arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=10000.0)
    else:
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1_000_000.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen2":  # biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(str(folder))
    return folder


def make_moe_checkpoint(folder: Path, arch: str, seed: int = 0) -> Path:
    """A tiny random mixture-of-experts checkpoint saved the way real ones are (one tensor per expert):
    "qwen3_moe" (renormalised top-2 of 8 experts, layer 1 dense) or "qwen2_moe" (a shared expert behind its gate,
    experts in every other layer, a qkv bias)."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    folder.mkdir(parents=True, exist_ok=True)
    common = tiny_shape(make_tokenizer(folder))
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **common, **moe, mlp_only_layers=[1], norm_topk_prob=True, head_dim=32, tie_word_embeddings=True
        )
    else:
        cfg = Qwen2MoeConfig(
            **common, **moe, decoder_sparse_step=2, shared_expert_intermediate_size=48, tie_word_embeddings=False
        )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session", params=["qwen3_moe", "qwen2_moe"])
def tiny_moe(request, tmp_path_factory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' float32 model of a checkpoint folder, loaded once a module: ``hf_reference(folder)``."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(folder):
        if folder not in cache:
            cache[folder] = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        return cache[folder]

    return get


@pytest.fixture
def fake_cuda(monkeypatch):
    """Call it to make torch see one CUDA device (an H200's name and memory) for config code from then on;
    nothing can run on it."""
    from types import SimpleNamespace

    h200 = SimpleNamespace(name="NVIDIA H200", total_memory=140 * 2**30, multi_processor_count=132)

    def enable() -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: h200)

    return enable


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_reranker(tmp_path_factory) -> Path:
    """A tiny random Qwen3 whose tokenizer has single "yes" and "no" tokens, in a folder named like a reranker."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-reranker"), "qwen3", seed=1, extra_tokens=("yes", "no"))


@pytest.fixture(scope="session", params=["qwen2", "qwen3"])
def tiny_checkpoint(request, tiny_qwen2, tiny_qwen3) -> Path:
    return tiny_qwen2 if request.param == "qwen2" else tiny_qwen3


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded default model's cached folder (built once, about a minute, on a fresh machine)."""
    from qwenbatch.loader.default_model import default_model_dir as build

    return build()


@pytest.fixture(scope="session")
def tiny_server(tiny_qwen3):
    """A server on the tiny Qwen3 checkpoint, float32, answering to "tiny" and "tiny-alias"."""
    from qwenbatch.config import EngineConfig
    from qwenbatch.server.app import ServerSettings
    from server_harness import RunningServer

    settings = ServerSettings(served_model_names=["tiny", "tiny-alias"])
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24)
    with RunningServer(settings, config) as server:
        yield server
