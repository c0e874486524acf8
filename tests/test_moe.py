"""Qwen2-MoE and Qwen3-MoE checkpoints: loaded as published, computing what transformers computes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.throughput import matmul_params
from qwenbatch.layers.cpu_experts import Int8Experts
from qwenbatch.layers.int8_linear import dequantize, quantize_weight
from qwenbatch.layers.moe import GroupedExperts, TopKRouter, grouped_mm_capturable
from qwenbatch.loader.dummy import dummy_config
from qwenbatch.loader.hf import instantiate, load_hf_model
from qwenbatch.loader.kernels import int8_quantized_weights
from qwenbatch.models.config import ModelConfig
from qwenbatch.models.qwen import QwenForCausalLM
from test_model_parity import PROMPTS, max_logit_error


def test_logits_match_transformers(tiny_moe, hf_reference):
    assert max_logit_error(tiny_moe, hf_reference(tiny_moe)) < 1e-4


@pytest.mark.parametrize("cpu_kernels", ["off", "on"])
def test_greedy_tokens_match_transformers_for_32_steps(tiny_moe, hf_reference, cpu_kernels):
    # A 16-token budget chunks the longest prompt and mixes its chunks with other sequences' decodes.
    llm = LLM(
        model=str(tiny_moe),
        dtype="float32",
        cpu_kernels=cpu_kernels,
        kv_cache_memory=16 * 2**20,
        max_num_batched_tokens=16,
    )
    assert llm.engine.runner.model.model.fused_decode is None  # its sparse layers are not fused: no one-call stack
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.inference_mode():
            expected = hf_reference(tiny_moe).generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32, pad_token_id=0
            )[0, len(prompt) :]
        assert output.outputs[0].token_ids == expected.tolist()


def test_a_compiled_engine_runs_the_experts_as_the_eager_one_does(tiny_moe):
    common = dict(model=str(tiny_moe), dtype="float32", kv_cache_memory=8 * 2**20)
    eager, compiled = LLM(**common), LLM(**common, compile=True)
    sequence = [5, 9, 14, 3, 7, 21, 11, 4, 8, 30, 6, 17]
    want = eager.engine.runner.sequence_logits(sequence)
    torch.testing.assert_close(compiled.engine.runner.sequence_logits(sequence), want, rtol=1e-4, atol=1e-4)


def test_int8_quantizes_the_experts_and_leaves_the_router_as_loaded(tiny_moe):
    # The router's choice must not move with int8 rounding; the experts, most of the bytes, run in the int8 kernel.
    llm = LLM(model=str(tiny_moe), dtype="bfloat16", quantization="int8", kv_cache_memory=8 * 2**20)
    files = load_file(str(tiny_moe / "model.safetensors"))
    sparse = ModelConfig.from_folder(tiny_moe).sparse_layers
    for index in sparse:
        mlp = llm.engine.runner.model.model.layers[index].mlp
        assert torch.equal(mlp.gate.weight, files[f"model.layers.{index}.mlp.gate.weight"].to(torch.bfloat16))
        assert isinstance(mlp.experts, Int8Experts)
    assert llm.engine.runner.linear_kernels.endswith("experts: Int8Experts")  # in the log and bench JSON
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_a_missing_expert_tensor_is_named(tiny_moe, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_moe, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = f"model.layers.{ModelConfig.from_folder(folder).sparse_layers[0]}.mlp.experts.5.up_proj.weight"
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"missing tensors: {name}$"):
        load_hf_model(folder, torch.float32, torch.device("cpu"))


def test_bad_expert_fields_are_named_and_no_experts_is_a_dense_model(tiny_moe):
    cfg = json.loads((tiny_moe / "config.json").read_text())
    assert ModelConfig.from_hf_dict({**cfg, "num_experts": 0}).sparse_layers == ()  # transformers' rule
    with pytest.raises(ValueError, match="missing field 'moe_intermediate_size'"):
        ModelConfig.from_hf_dict({k: v for k, v in cfg.items() if k != "moe_intermediate_size"})
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be between 1 and num_experts \(8\)"):
        ModelConfig.from_hf_dict({**cfg, "num_experts_per_tok": 9})


def test_the_sparse_layers_follow_transformers_rule(tiny_moe, hf_reference):
    ours = load_hf_model(tiny_moe, torch.float32, torch.device("cpu"))
    for layer, theirs in zip(ours.model.layers, hf_reference(tiny_moe).model.layers, strict=True):
        assert hasattr(layer.mlp, "experts") == hasattr(theirs.mlp, "experts")


def test_flops_count_the_experts_a_token_runs():
    # Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B of them activated a token.
    cfg = dummy_config("qwen3-30b-a3b")
    with torch.device("meta"):
        params = dict(QwenForCausalLM(cfg).named_parameters())
    total = sum(p.numel() for p in params.values())
    assert round(total / 1e9, 1) == 30.5
    unused_experts = sum(
        p.numel() * (cfg.moe.num_experts - cfg.moe.experts_per_token) // cfg.moe.num_experts
        for name, p in params.items()
        if ".experts." in name
    )
    not_matmuls = sum(p.numel() for name, p in params.items() if "norm" in name or "embed_tokens" in name)
    layers, head = matmul_params(cfg)
    assert layers + head == total - unused_experts - not_matmuls
    assert int((layers + head + params["model.embed_tokens.weight"].numel()) / 1e8) == 33


def test_int8_experts_compute_each_tokens_experts_on_their_int8_weights():
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=8, hidden_size=64, intermediate_size=32)
    for stacked in (experts.gate_up_proj, experts.down_proj):
        for e in range(8):  # the weights int8 would hold, so that only the kernel's rounding of x is left
            stacked.data[e] = dequantize(*quantize_weight(torch.randn(stacked.shape[1:]) * 0.1))
    router = TopKRouter(64, 8, top_k=2, renormalise=True)
    router.weight.data.normal_()
    x = torch.randn(40, 64)
    weights, chosen = router(x)
    with torch.inference_mode():
        want = experts(x, weights, chosen)
        got = Int8Experts(experts, five_bit=False)(x, weights, chosen)
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * float(want.abs().max()))


def test_int8_reads_the_weights_it_quantizes_from_the_checkpoint_alone(tiny_moe, monkeypatch):
    # The loader leaves the linears' and experts' weights unread (never resident in full) and quantizing reads
    # them from the files: the engine's tokens are those of one that loaded them first.
    import qwenbatch.loader as loader
    from qwenbatch.loader.hf import CheckpointReader

    read = []
    read_into = CheckpointReader.read_into
    monkeypatch.setattr(
        CheckpointReader, "read_into", lambda self, name, t: (read.append(name), read_into(self, name, t))
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = dict(model=str(tiny_moe), dtype="bfloat16", quantization="int8", kv_cache_memory=8 * 2**20)
    lazily = [o.outputs[0].token_ids for o in LLM(**common).generate(PROMPTS, params, use_tqdm=False)]
    quantized = (".experts.", "qkv_proj.weight", "o_proj.weight", "lm_head.weight")
    assert read and not any(part in name for name in read for part in quantized)
    model = instantiate(ModelConfig.from_folder(tiny_moe), torch.bfloat16, torch.device("meta"))
    assert set(read).isdisjoint(int8_quantized_weights(model))
    monkeypatch.setattr(loader, "int8_quantized_weights", lambda model: set())
    loaded_first = [o.outputs[0].token_ids for o in LLM(**common).generate(PROMPTS, params, use_tqdm=False)]
    assert lazily == loaded_first


def test_only_qwen2_moe_reads_qkv_bias_and_has_a_shared_expert():
    # transformers' Qwen2Attention always has the bias; Qwen2-MoE's follows its config's qkv_bias.
    shape = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    shape |= {"num_attention_heads": 4, "qkv_bias": False}
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert ModelConfig.from_hf_dict({**shape, "architectures": ["Qwen2ForCausalLM"]}).attention_bias
    qwen2_moe = ModelConfig.from_hf_dict({**shape, **moe, "architectures": ["Qwen2MoeForCausalLM"]})
    assert not qwen2_moe.attention_bias
    assert qwen2_moe.moe.shared_intermediate_size == 5632  # transformers' default where the config leaves it out
    assert (
        ModelConfig.from_hf_dict(
            {**shape, **moe, "architectures": ["Qwen3MoeForCausalLM"]}
        ).moe.shared_intermediate_size
        == 0
    )


def test_decode_graphs_hold_the_experts_only_where_torch_runs_them_as_one_kernel(monkeypatch):
    cuda = torch.device("cuda")
    cases = [
        ((9, 0), torch.bfloat16, True),
        ((10, 0), torch.bfloat16, True),
        ((8, 0), torch.bfloat16, False),  # A100: torch's fallback reads the group ends on the host
        ((9, 0), torch.float32, False),
    ]
    for capability, dtype, capturable in cases:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert grouped_mm_capturable(dtype, cuda) is capturable
    assert not grouped_mm_capturable(torch.bfloat16, torch.device("cpu"))
