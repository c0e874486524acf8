"""Structured outputs: an output that must match a JSON schema, a regex, a choice or a Lark grammar (vLLM's
``structured_outputs``, OpenAI's ``response_format``) gets only tokens the match allows, and ends when it is
complete; a bad schema or regex is refused before the request runs."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch

from qwenbatch import LLM, SamplingParams, StructuredOutputs
from qwenbatch.layers import sampler
from qwenbatch.layers.cpu_kernels import greedy_tokens, mask_to_allowed, sample_tokens, token_logprobs
from qwenbatch.layers.sampler import SamplerKernels, SamplingRow, sample

PATHS = {"torch": None, "cpu-kernels": SamplerKernels(greedy_tokens, sample_tokens, token_logprobs, mask_to_allowed)}
# Bounded values only: a random tiny model would fill a free string or number until max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "count", "ok"],
    "additionalProperties": False,
}
COMPACT = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)


def check_schema(text: str) -> bool:
    value = json.loads(text)
    assert set(value) == {"answer", "count", "ok"}, value
    assert value["answer"] in ("yes", "no") and 0 <= value["count"] <= 99 and isinstance(value["ok"], bool), value
    return True


def test_exactly_one_kind_of_match_is_set_with_a_valid_value():
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")
    for kwargs in ({}, {"regex": "a", "choice": ["a"]}, {"json": SCHEMA, "json_object": True}):
        with pytest.raises(ValueError, match="exactly one"):
            StructuredOutputs(**kwargs)
    for kwargs in ({"choice": []}, {"choice": ["a", ""]}, {"regex": ""}, {"json": 5}):
        with pytest.raises(ValueError, match="structured_outputs"):
            StructuredOutputs(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


def allowed_bits(allowed: list[int], vocab: int) -> torch.Tensor:
    mask = torch.zeros((vocab + 31) // 32 * 32, dtype=torch.bool)
    mask[allowed] = True
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    return ((mask.view(-1, 32).long() * weights).sum(-1)).to(torch.int64).to(torch.int32)


@pytest.mark.parametrize("kernels", PATHS.values(), ids=PATHS.keys())
def test_the_sampler_takes_only_allowed_tokens_and_flags_only_the_models_non_finite_logits(kernels):
    vocab, gen = 151_936, torch.Generator().manual_seed(3)
    logits = (torch.randn(6, vocab, generator=gen) * 3).bfloat16()
    logits[5, 17] = float("nan")
    before = logits.clone()
    settings = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.1),
        SamplingParams(temperature=1.0),  # no mask, beside masked rows
        SamplingParams(temperature=0),
    ]
    allowed = [[7, 90_000, 151_935], [5, 6], [1000 + 31 * i for i in range(50)], [3, 4, 40_000], None, [1, 2]]
    rows = [
        SamplingRow(p, [9, 9], torch.tensor([7]), None, (), None if a is None else lambda a=a: allowed_bits(a, vocab))
        for p, a in zip(settings, allowed, strict=True)
    ]
    for _ in range(20):
        out = sample(logits, rows, kernels)
        for token, allow in zip(out.token_ids[:5], allowed, strict=False):  # the NaN row fails its request
            assert allow is None or token in allow
    assert torch.equal(logits.view(torch.int16), before.view(torch.int16))  # the caller's logits untouched
    assert out.non_finite == [False] * 5 + [True]  # the mask's -inf are not the model's; its NaN is
    assert out.token_ids[0] == max(allowed[0], key=lambda t: logits[0, t].item())
    assert set(out.logprobs[1]) == {5, 6}  # only allowed tokens have mass
    assert sum(torch.tensor(list(out.logprobs[1].values())).exp()).item() == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_mask_kernel_and_the_pytorch_path_keep_exactly_the_allowed_logits(dtype):
    vocab, gen = 1000, torch.Generator().manual_seed(4)  # 31 words and a part
    logits = (torch.randn(5, vocab, generator=gen) * 3).to(dtype)
    logits[3, 999] = float("inf")
    bits = torch.randint(-(2**31), 2**31 - 1, (5, 32), dtype=torch.int32, generator=gen)
    bits[0, :10], bits[1, 5:20] = 0, -1  # whole words clear and set: the fills and copies
    allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten(1)[:, :vocab].bool()
    want = torch.where(allowed, logits, float("-inf"))
    rows = [SamplingRow(SamplingParams(), [], torch.tensor([]), None, (), lambda b=b: b) for b in bits]
    for kernel in (mask_to_allowed, None):
        got, flags = sampler._masked_to_allowed(logits, rows, list(range(5)), kernel)
        assert flags == [False, False, False, True, False]
        finite = [0, 1, 2, 4]
        assert torch.equal(got[finite].float(), want[finite].float()), kernel


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24)


def test_outputs_match_their_schema_regex_choice_and_grammar(llm):
    prompts = [list(range(10 + i, 30 + i)) for i in range(3)]
    colours = ("red", "green", "dark blue")
    kinds = {
        "schema": (COMPACT, check_schema),
        "regex": (StructuredOutputs(regex=r"[a-c]{2,4}-\d\d"), lambda t: re.fullmatch(r"[a-c]{2,4}-\d\d", t)),
        "choice": (StructuredOutputs(choice=list(colours)), lambda t: t in colours),
        "grammar": (StructuredOutputs(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'), lambda t: re.fullmatch(
            r"\([1-9](\+[1-9])*\)", t)),
    }  # fmt: skip
    for name, (spec, check) in kinds.items():
        params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=200, structured_outputs=spec)
        for out in llm.generate(prompts, params, use_tqdm=False):
            for completion in out.outputs:
                assert completion.finish_reason == "stop", (name, completion)
                assert check(completion.text), (name, completion.text)
    complete = SamplingParams(ignore_eos=True, max_tokens=50, structured_outputs=StructuredOutputs(choice=["a+b"]))
    [done] = llm.generate(prompts[:1], complete, use_tqdm=False)
    assert (done.outputs[0].text, done.outputs[0].finish_reason) == ("a+b", "stop")  # ends when the match does
    free = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    assert free[0].outputs[0].finish_reason == "length"  # the tiny random model writes no JSON of its own


def test_a_bad_schema_regex_or_grammar_is_refused_before_it_runs(llm):
    for spec, words in (
        (StructuredOutputs(regex="(unclosed"), "unclosed group"),
        (StructuredOutputs(regex="(unclosed"), "unclosed group"),  # refused again: refusals are not cached
        (StructuredOutputs(json={"type": "nonsense"}), "nonsense"),
        (StructuredOutputs(json="{not json"), "key must be a string"),
        (StructuredOutputs(grammar="start: UNDEFINED"), "UNDEFINED"),
    ):
        with pytest.raises(ValueError, match=words):
            llm.generate([[1, 2, 3]], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", "max_tokens": 200, **body}, timeout=60)


def test_the_server_takes_response_format_and_structured_outputs(tiny_server):
    url, messages = tiny_server.url, [{"role": "user", "content": "Answer in JSON."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    # The whitespace a random model would add forever is cut by disable_any_whitespace (vLLM's option, which
    # structured_outputs may carry beside a response_format).
    compact = {"disable_any_whitespace": True}
    for fields in (
        {"structured_outputs": {"json": SCHEMA, **compact}},
        {"response_format": schema_format, "structured_outputs": compact},
    ):
        response = post(url, "/v1/chat/completions", {"messages": messages, **fields})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check_schema(choice["message"]["content"])
    padded = post(url, "/v1/chat/completions", {"messages": messages, "response_format": schema_format,
                                                "temperature": 0, "max_tokens": 30})  # fmt: skip
    assert padded.json()["choices"][0]["message"]["content"].startswith("{\n   ")  # as vLLM, whitespace allowed
    response = post(url, "/v1/completions", {"prompt": "Pick", "structured_outputs": {"choice": ["left", "right"]}})
    assert response.json()["choices"][0]["text"] in ("left", "right")
    obj = post(url, "/v1/chat/completions", {"messages": messages, "response_format": {"type": "json_object"}})
    assert obj.json()["choices"][0]["message"]["content"].lstrip().startswith("{")


BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format",
     "nonsense"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "unclosed"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "cannot both"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "words"), BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_a_bad_structured_output_is_400_naming_its_field(tiny_server, fields, param, words):
    response = post(
        tiny_server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **fields}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
