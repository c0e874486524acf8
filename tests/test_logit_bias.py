"""OpenAI's logit_bias and vLLM's allowed_token_ids: what a classification job sets to keep a one-token answer
among its labels. The bias moves the draw, not the logprobs; only allowed tokens are ever sampled."""

from __future__ import annotations

import httpx
import pytest
import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.layers.cpu_kernels import greedy_tokens, mask_to_allowed, sample_tokens, token_logprobs
from qwenbatch.layers.sampler import SamplerKernels, SamplingRow, sample, token_bits

PATHS = {"torch": None, "cpu-kernels": SamplerKernels(greedy_tokens, sample_tokens, token_logprobs, mask_to_allowed)}


def test_token_bits_hold_exactly_the_ids_given():
    ids = {0, 31, 32, 63, 999, 1000}  # bit 31 is the int32 word's sign
    bits = token_bits(sorted(ids), 1001)
    assert bits.dtype == torch.int32 and bits.shape == (32,)
    back = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().nonzero().flatten()
    assert set(back.tolist()) == ids


@pytest.mark.parametrize("kernels", PATHS.values(), ids=PATHS.keys())
def test_the_bias_moves_the_pick_but_not_the_logprobs(kernels):
    logits = (torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    best = logits.float().argmax(dim=-1).tolist()

    def pick(**params) -> tuple[list[int], list]:
        rows = [SamplingRow(SamplingParams(temperature=0, logprobs=2, **params), [], torch.tensor([]), None, ())] * 3
        out = sample(logits, rows, kernels)
        return out.token_ids, out.logprobs

    plain, plain_logprobs = pick()
    assert plain == best
    raised, raised_logprobs = pick(logit_bias={4321: 100.0})
    assert raised == [4321] * 3
    banned, _ = pick(logit_bias={t: -100.0 for t in best})
    assert all(b != t for b, t in zip(banned, best, strict=True))
    # The draw's token gets its logprob listed; the top-2 and their values are the unbiased model's.
    for before, after in zip(plain_logprobs, raised_logprobs, strict=True):
        assert {t: v for t, v in after.items() if t != 4321} == pytest.approx(before)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24)


def test_only_allowed_tokens_are_sampled_and_a_large_bias_wins(llm):
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    allowed = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=[5, 9, 300])
    drawn = [t for out in llm.generate(prompts, allowed, use_tqdm=False) for t in out.outputs[0].token_ids]
    assert set(drawn) == {5, 9, 300}  # all three drawn over 48 tokens, and nothing else
    biased = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logit_bias={77: 100})
    assert all(out.outputs[0].token_ids == [77] * 6 for out in llm.generate(prompts, biased, use_tqdm=False))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(prompts[:1], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)


def test_invalid_values_are_refused_naming_the_parameter():
    for params, name in (
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {t: 1 for t in range(1025)}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**params)


def test_the_server_takes_logit_bias_and_allowed_token_ids(tiny_server):
    url = tiny_server.url
    vocab = tiny_server.app.state.serving.engine.inputs.vocab_size
    [a] = tiny_server.app.state.serving.engine.inputs.encode("a")

    def chat(**fields) -> httpx.Response:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Pick"}], "max_tokens": 4, **fields}
        return httpx.post(url + "/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=60)

    for fields in ({"logit_bias": {str(a): 100}}, {"allowed_token_ids": [a]}):
        response = chat(**fields)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "aaaa"
    for fields, param in (
        ({"logit_bias": {str(vocab): 1}}, "logit_bias"),
        ({"logit_bias": {"5": 300}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias.five"),
        ({"allowed_token_ids": [vocab]}, "allowed_token_ids"),
    ):
        response = chat(**fields)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.json()
