"""prompt_logprobs (vLLM's): each prompt token's logprob given those before it, the top ones at each position and the
token's rank, as an evaluation job scores texts. Checked against transformers' logits in float32, across chunked
prefill, a cached prefix (which must be computed again), a preemption mid-prompt and streaming."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from qwenbatch import LLM, SamplingParams

PROMPT = [100 + (7 * i) % 150 for i in range(40)]  # 40 tokens: three chunks at a budget of 16


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> torch.Tensor:
    """transformers' log-probabilities [40, vocab] at each position of PROMPT, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def assert_matches(out, reference: torch.Tensor, k: int) -> None:
    logprobs, ranks = out.prompt_logprobs, out.prompt_token_ranks
    assert len(logprobs) == len(ranks) == len(PROMPT)
    assert logprobs[0] is None and ranks[0] is None
    for i in range(1, len(PROMPT)):
        row, token = reference[i - 1], PROMPT[i]
        assert logprobs[i][token] == pytest.approx(row[token].item(), abs=1e-4), f"position {i}"
        assert ranks[i] == int((row > row[token]).sum()) + 1, f"position {i}"
        top = row.topk(k).indices.tolist()
        assert set(logprobs[i]) == set(top) | {token}, f"position {i}"
        for t in top:
            assert logprobs[i][t] == pytest.approx(row[t].item(), abs=1e-4)


def assert_same(a: list[dict[int, float] | None], b: list[dict[int, float] | None]) -> None:
    assert [e and set(e) for e in a] == [e and set(e) for e in b]
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x == pytest.approx(y, abs=1e-5)


@pytest.mark.parametrize("cpu_kernels", ["on", "off"])
def test_prompt_logprobs_equal_transformers_across_chunks(tiny_checkpoint, reference, cpu_kernels):
    llm = LLM(str(tiny_checkpoint), dtype="float32", max_num_batched_tokens=16, cpu_kernels=cpu_kernels)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, n=2)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert_matches(out, reference, 3)
    assert len(out.outputs) == 2  # both samples, the prompt's logprobs once
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_cached_prefix_is_computed_again(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), dtype="float32", max_num_batched_tokens=16)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # caches the prompt's blocks
    fresh = LLM(str(tiny_qwen3), dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    cached = llm.generate([PROMPT], params, use_tqdm=False)[0]
    expected = fresh.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(cached.prompt_logprobs) == len(PROMPT)
    assert_same(cached.prompt_logprobs, expected.prompt_logprobs)
    assert cached.prompt_token_ranks == expected.prompt_token_ranks
    assert all(len(entry) == 1 for entry in cached.prompt_logprobs[1:])  # k = 0: the prompt's token alone


def test_a_sequence_preempted_mid_prompt_reports_each_position_once(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), dtype="float32", max_num_batched_tokens=16, max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    engine.add_request("low", PROMPT, params, priority=1)
    engine.step()  # the first 16 of its 40 prompt tokens
    engine.add_request("high", PROMPT[:20], SamplingParams(temperature=0, max_tokens=2))
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step())
    assert engine.scheduler.num_preemptions == 1
    alone = LLM(str(tiny_qwen3), dtype="float32").generate([PROMPT], params, use_tqdm=False)[0]
    assert_same(finished["low"].prompt_logprobs, alone.prompt_logprobs)
    assert finished["low"].prompt_token_ranks == alone.prompt_token_ranks


def test_a_streaming_request_sends_them_in_its_first_output(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), dtype="float32")
    engine = llm.engine
    engine.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2), stream=True)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert len(deltas) == 4
    assert len(deltas[0].prompt_logprobs) == len(PROMPT)
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_a_second_sample_from_a_cached_prompt_waits_for_the_first_ones_logprobs(tiny_qwen3):
    # The second sequence takes the cached prompt and samples at once; the first still computes its logprobs in
    # chunks of 16. No delta may carry a partial list.
    llm = LLM(str(tiny_qwen3), dtype="float32", max_num_batched_tokens=16)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # caches the prompt
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, n=2)
    engine.add_request("s", PROMPT, params, stream=True)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    carrying = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is deltas[0] and len(carrying[0].prompt_logprobs) == len(PROMPT)
    assert sum(len(c.token_ids) for d in deltas for c in d.outputs) == 6  # held back, not lost


def test_a_one_token_prompt_has_only_the_first_entry(tiny_qwen3):
    out = LLM(str(tiny_qwen3), dtype="float32").generate(
        [[PROMPT[0]]], SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False
    )[0]
    assert out.prompt_logprobs == [None] and out.prompt_token_ranks == [None]


@pytest.mark.parametrize("value", [-1, 21, 1.5])
def test_prompt_logprobs_out_of_range_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


# -- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def offline(tiny_qwen3):
    """The prompt logprobs of PROMPT as the offline engine gives them (what the server must send)."""
    llm = LLM(str(tiny_qwen3), dtype="float32")
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny", **body}, timeout=60)


def test_echo_with_logprobs_scores_the_prompt_as_an_evaluation_harness_reads_it(tiny_server, offline):
    # lm-evaluation-harness's loglikelihood request to an OpenAI-compatible completions server.
    response = post(tiny_server, "/v1/completions", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(PROMPT) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [offline.prompt_logprobs[i][PROMPT[i]] for i in range(1, len(PROMPT))]
    assert logprobs["token_logprobs"][1 : len(PROMPT)] == pytest.approx(expected, abs=1e-4)
    greedy = [rank == 1 for rank in offline.prompt_token_ranks[1:]]
    tops = logprobs["top_logprobs"][1 : len(PROMPT)]
    assert [lp == max(top.values()) for lp, top in zip(expected, tops, strict=True)] == greedy
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])

    only_prompt = post(tiny_server, "/v1/completions", prompt=PROMPT, max_tokens=0, logprobs=0, echo=True).json()
    choice = only_prompt["choices"][0]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert choice["text"] == tiny_server.app.state.serving.engine.inputs.decode(PROMPT)
    assert choice["finish_reason"] == "length" and "stop_reason" not in choice  # nothing generated
    assert only_prompt["usage"]["completion_tokens"] == 0
    refused = post(tiny_server, "/v1/completions", prompt=PROMPT, max_tokens=0)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_echo_with_logprobs_streams_the_prompt_first(tiny_server, offline):
    body = dict(prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True, stream=True)
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None
    expected = [offline.prompt_logprobs[i][PROMPT[i]] for i in range(1, len(PROMPT))]
    assert first["token_logprobs"][1 : len(PROMPT)] == pytest.approx(expected, abs=1e-4)
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]) == len(PROMPT) + 3


def test_the_prompt_logprobs_field_on_completions_and_chat(tiny_server, offline):
    response = post(tiny_server, "/v1/completions", prompt=PROMPT, max_tokens=1, prompt_logprobs=2)
    assert response.status_code == 200, response.text
    field = response.json()["choices"][0]["prompt_logprobs"]
    assert len(field) == len(PROMPT) and field[0] is None
    tokenizer = tiny_server.app.state.serving.engine.inputs.tokenizer
    for i in range(1, len(PROMPT)):
        entry = field[i]
        assert {int(t) for t in entry} == set(offline.prompt_logprobs[i])
        own = entry[str(PROMPT[i])]
        assert own["logprob"] == pytest.approx(offline.prompt_logprobs[i][PROMPT[i]], abs=1e-4)
        assert own["rank"] == offline.prompt_token_ranks[i]
        assert own["decoded_token"] == tokenizer.token_text(PROMPT[i])
        others = sorted((v for t, v in entry.items() if t != str(PROMPT[i])), key=lambda v: v["rank"])
        assert [v["rank"] for v in others] == sorted({1, 2, 3} - {own["rank"]})[: len(others)]

    chat = post(tiny_server, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], prompt_logprobs=0)
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    plain = post(tiny_server, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}]).json()
    assert "prompt_logprobs" not in plain

    for path, fields in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        refused = post(tiny_server, path, **fields, prompt_logprobs=1, stream=True)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
        refused = post(tiny_server, path, **fields, prompt_logprobs=21)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
