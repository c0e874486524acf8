"""Our model code against transformers on the same weights, float32."""

from __future__ import annotations

import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.layers.attention import StepLayout, TorchAttentionMetadata
from qwenbatch.loader.hf import load_hf_model

PROMPTS = [
    [5, 17, 42, 99, 3, 250, 7],
    [300, 12],
    list(range(10, 90, 3)),
    [1] * 5 + [200, 201, 202],
]


def our_logits(model, token_ids: list[int]) -> torch.Tensor:
    """All-position logits of one fresh prompt through our packed/paged path."""
    cfg = model.config
    block_size = 16
    blocks = -(-len(token_ids) // block_size)
    dtype = model.lm_head.weight.dtype
    kv = [
        torch.empty(2, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
        for _ in range(cfg.num_hidden_layers)
    ]
    n = len(token_ids)
    layout = StepLayout(block_size)
    layout.add_prefill(token_ids, list(range(blocks)), 0)
    meta = TorchAttentionMetadata.build(layout, torch.device("cpu"))
    with torch.inference_mode():
        model.model.rotary.reserve(n, torch.device("cpu"))
        hidden = model(torch.tensor(token_ids), torch.arange(n), kv, meta)
        return model.compute_logits(hidden)


def max_logit_error(folder, reference) -> float:
    """The largest difference between our float32 logits of ``folder``'s model and ``reference``'s over PROMPTS."""
    ours = load_hf_model(folder, torch.float32, torch.device("cpu"))
    error = 0.0
    for prompt in PROMPTS:
        with torch.inference_mode():
            expected = reference(torch.tensor([prompt])).logits[0]
        error = max(error, (our_logits(ours, prompt) - expected).abs().max().item())
    return error


def test_logits_match_transformers(tiny_checkpoint, hf_reference):
    assert max_logit_error(tiny_checkpoint, hf_reference(tiny_checkpoint)) < 1e-4


def test_greedy_tokens_match_transformers_for_32_steps(tiny_checkpoint, hf_reference):
    ref = hf_reference(tiny_checkpoint)
    llm = LLM(model=str(tiny_checkpoint), dtype="float32", kv_cache_memory=16 * 2**20)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        with torch.inference_mode():
            expected = ref.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=32,
                min_new_tokens=32,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected
