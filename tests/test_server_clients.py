"""The server driven by the clients people use: the official ``openai`` SDK (sync and async) and LangChain.

Everything runs against the session's ``tiny_server`` (a random tiny Qwen3, so its text is gibberish):
the tests compare the texts and token counts that different paths give for the same greedy request
rather than expecting words. ``ignore_eos`` (through ``extra_body``) fixes the number of tokens.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from qwenbatch.llm import LLM
from qwenbatch.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Python is a", "def add(a, b):", "Batch inference pushes"]
FIXED = {"ignore_eos": True}  # extra_body: exactly max_tokens tokens
NO_THINKING = "<think>\n\n</think>\n\n"  # what the tiny chat template adds when enable_thinking is false


# -- fixtures and helpers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(tiny_server) -> str:
    return tiny_server.url


@pytest.fixture(scope="module")
def client(url):
    with OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_server):
    return tiny_server.engine.tokenizer


def async_client(url: str) -> AsyncOpenAI:
    """A fresh async client (httpx's pool belongs to one event loop, and each test runs its own)."""
    return AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def greedy_chat(client: OpenAI, text: str, max_tokens: int = 8, model: str = "tiny", **kwargs):
    return client.chat.completions.create(
        model=model, messages=user(text), temperature=0, max_tokens=max_tokens, extra_body=FIXED, **kwargs
    )


def greedy_completion(client: OpenAI, prompt, max_tokens: int = 8, **kwargs):
    return client.completions.create(
        model="tiny", prompt=prompt, temperature=0, max_tokens=max_tokens, extra_body=FIXED, **kwargs
    )


def text_alone(client: OpenAI, prompt, max_tokens: int = 8) -> str:
    """The greedy completion of one prompt sent on its own."""
    [choice] = greedy_completion(client, prompt, max_tokens).choices
    return choice.text


def join_chat_stream(chunks) -> tuple[str, str, list, object]:
    """(content, reasoning, finish reasons, usage) reassembled from chat stream chunks."""
    content, reasoning, finish, totals = [], [], [], None
    for chunk in chunks:
        if chunk.usage is not None:
            totals = chunk.usage
        for choice in chunk.choices:
            assert choice.index == 0
            content.append(choice.delta.content or "")
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
    return "".join(content), "".join(reasoning), finish, totals


def reasoning_of(message) -> str:
    return getattr(message, "reasoning_content", None) or ""


def scrape(url: str) -> dict[str, float]:
    """Every sample on /metrics by sample name, summed over labels."""
    text = httpx.get(url + "/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def scrape_until(url: str, name: str, expected: float, deadline_s: float = 10.0) -> dict[str, float]:
    """/metrics once ``name`` reaches ``expected`` (the engine thread publishes a step's stats just
    after handing its outputs over, so a response can arrive a moment before its counters move)."""
    deadline = time.monotonic() + deadline_s
    values = scrape(url)
    while values.get(name, 0.0) < expected and time.monotonic() < deadline:
        time.sleep(0.02)
        values = scrape(url)
    return values


def prompt_tokens_of(tokenizer, messages: list[dict], enable_thinking: bool | None = None) -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking)))


# -- openai SDK: chat -------------------------------------------------------------------------------


def test_chat_non_streaming(client, tokenizer):
    response = greedy_chat(client, "Hello there", max_tokens=8)
    [choice] = response.choices
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens == prompt_tokens_of(tokenizer, user("Hello there"))
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8


def test_chat_stream_reassembles_to_the_non_streaming_answer(client):
    whole = greedy_chat(client, "Tell me a story", max_tokens=12)
    chunks = list(
        greedy_chat(client, "Tell me a story", max_tokens=12, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content, reasoning, finish, totals = join_chat_stream(chunks)
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == reasoning_of(whole.choices[0].message)
    assert finish == ["length"]
    assert totals is not None and totals.model_dump() == whole.usage.model_dump()
    assert chunks[-1].choices == []  # the usage chunk comes last and carries no choice


def test_chat_stream_without_include_usage_sends_no_usage(client):
    chunks = list(greedy_chat(client, "Tell me a story", max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks)


def test_async_chat_streaming_and_not(url):
    async def main():
        async with async_client(url) as aclient:
            kwargs = dict(model="tiny", messages=user("Async hello"), temperature=0, max_tokens=10, extra_body=FIXED)
            whole = await aclient.chat.completions.create(**kwargs)
            stream = await aclient.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
            return whole, chunks

    whole, chunks = asyncio.run(main())
    content, reasoning, finish, totals = join_chat_stream(chunks)
    assert whole.usage.completion_tokens == 10
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == reasoning_of(whole.choices[0].message)
    assert finish == ["length"]
    assert totals.model_dump() == whole.usage.model_dump()


def test_chat_stream_with_n_samples_matches_non_streaming(client):
    kwargs = dict(model="tiny", messages=user("Two answers"), n=2, temperature=1, seed=5, max_tokens=10)
    whole = client.chat.completions.create(**kwargs, extra_body=FIXED)
    chunks = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=FIXED
    )
    content: dict[int, str] = {}
    totals = None
    for chunk in chunks:
        totals = chunk.usage or totals
        for choice in chunk.choices:
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert content == {c.index: c.message.content or "" for c in whole.choices}
    assert whole.usage.completion_tokens == 2 * 10
    assert totals.model_dump() == whole.usage.model_dump()


def test_chat_list_of_text_parts_equals_plain_string(client):
    plain = greedy_chat(client, "Hello parts")
    parts = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "parts"}]}],
        temperature=0,
        max_tokens=8,
        extra_body=FIXED,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.model_dump() == plain.usage.model_dump()


# -- chat streaming's reasoning split -------------------------------------------------------------
# server/chat.py splits <think>...</think> off with tokenizer.split_reasoning when not streaming and with
# tokenizer.ReasoningStream when streaming; a client must get the same message either way. The tiny model
# seldom writes these shapes itself, so the splitter the stream uses is fed them directly here.


def split_streamed(pieces: list[str], opened: bool = False) -> tuple[str, str]:
    """(reasoning, content) as a streaming chat client reassembles them from ``pieces``."""
    from qwenbatch.tokenizer import ReasoningStream

    parser, reasoning, content = ReasoningStream(opened), "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    ("pieces", "opened"),
    [
        pytest.param(["<think>", "plan", "</think>", "\n\n", "answer"], False, id="think-block"),
        pytest.param(["plan", "</t", "hink>", "\n\nanswer"], True, id="opened-by-template"),
        pytest.param(["plain ", "answer"], False, id="no-think-block"),
        pytest.param(["  ", "x"], False, id="leading-spaces"),
        pytest.param([" "], False, id="whitespace-only"),  # BUG: the stream drops it
        pytest.param(["\n\n", "hi"], False, id="leading-newlines"),  # BUG: the stream strips them
        pytest.param(["plan</think>", "\n\nanswer"], False, id="close-tag-only"),  # BUG: only the whole text splits
    ],
)
def test_streamed_reasoning_split_equals_the_non_streaming_one(pieces, opened):
    from qwenbatch.tokenizer import split_reasoning

    reasoning, content = split_reasoning("".join(pieces), opened)
    assert split_streamed(pieces, opened) == (reasoning or "", content)


# -- openai SDK: completions ------------------------------------------------------------------------


def test_completion_single_prompt(client, tokenizer):
    response = greedy_completion(client, PROMPTS[0], max_tokens=8)
    [choice] = response.choices
    assert response.object == "text_completion"
    assert choice.index == 0 and choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]))
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8


def test_completion_list_of_prompts_in_prompt_order(client, tokenizer):
    alone = [text_alone(client, p) for p in PROMPTS]
    response = greedy_completion(client, PROMPTS)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == alone
    assert len(set(alone)) > 1  # the prompts really give different answers, so order is visible
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert response.usage.completion_tokens == 8 * len(PROMPTS)


def test_completion_token_id_prompts_equal_text_prompts(client, tokenizer):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    alone = [text_alone(client, p) for p in PROMPTS]
    [one] = greedy_completion(client, ids[1]).choices
    assert one.index == 0 and one.text == alone[1]
    batch = greedy_completion(client, ids)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == alone
    assert batch.usage.prompt_tokens == sum(map(len, ids))


def test_completion_choice_index_is_prompt_index_times_n_plus_sample(client):
    alone = [text_alone(client, p) for p in PROMPTS[:3]]
    # Greedy with n=2: both samples of a prompt are its greedy answer, so each index names its prompt.
    response = greedy_completion(client, PROMPTS[:3], n=2)
    assert sorted(c.index for c in response.choices) == list(range(6))
    for choice in response.choices:
        assert choice.text == alone[choice.index // 2]
    assert response.usage.completion_tokens == 3 * 2 * 8


def test_completion_n_samples_with_seed(client):
    def sample():
        return client.completions.create(
            model="tiny", prompt=PROMPTS[0], n=3, temperature=1, seed=11, max_tokens=16, extra_body=FIXED
        )

    first, again = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1  # the samples differ from each other
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    assert first.usage.completion_tokens == 3 * 16


def test_completion_stream_reassembles_to_the_non_streaming_answer(client):
    whole = greedy_completion(client, PROMPTS[:2], max_tokens=10, n=2)
    stream = greedy_completion(
        client, PROMPTS[:2], max_tokens=10, n=2, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    totals = None
    for chunk in stream:
        totals = chunk.usage or totals
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == dict.fromkeys(range(4), "length")
    assert totals is not None and totals.model_dump() == whole.usage.model_dump()


def test_async_completion_list_of_token_id_lists(url, tokenizer, client):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    alone = [text_alone(client, p) for p in PROMPTS]

    async def main():
        async with async_client(url) as aclient:
            return await aclient.completions.create(
                model="tiny", prompt=ids, temperature=0, max_tokens=8, extra_body=FIXED
            )

    response = asyncio.run(main())
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == alone


# -- openai SDK: stop strings, seeds, logprobs, echo -------------------------------------------------


def ascii_stop(text: str) -> str:
    """Two ASCII letters/digits from ``text``, past its start (so the cut text is not empty)."""
    for at in range(1, len(text) - 1):
        piece = text[at : at + 2]
        if piece.isascii() and piece.isalnum():
            return piece
    raise AssertionError(f"no ASCII pair to stop on in {text!r}")


def test_completion_stop_string_cuts_before_it(client):
    full = text_alone(client, PROMPTS[1], max_tokens=24)
    stop = ascii_stop(full)
    [choice] = greedy_completion(client, PROMPTS[1], max_tokens=24, stop=[stop]).choices
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop


def test_chat_stop_string_cuts_before_it(client):
    full = greedy_chat(client, "Stop here", max_tokens=24).choices[0].message.content
    stop = ascii_stop(full)
    [choice] = greedy_chat(client, "Stop here", max_tokens=24, stop=stop).choices
    assert choice.message.content == full[: full.index(stop)]
    assert choice.finish_reason == "stop"


def test_stop_string_while_streaming_sends_nothing_past_it(client):
    full = text_alone(client, PROMPTS[1], max_tokens=24)
    stop = ascii_stop(full)
    chunks = list(greedy_completion(client, PROMPTS[1], max_tokens=24, stop=[stop], stream=True))
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == full[: full.index(stop)]
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["stop"]

    chat_full = greedy_chat(client, "Tell me a story", max_tokens=24).choices[0].message.content
    chat_stop = ascii_stop(chat_full)
    content, _, finish, _ = join_chat_stream(
        greedy_chat(client, "Tell me a story", max_tokens=24, stop=chat_stop, stream=True)
    )
    assert content == chat_full[: chat_full.index(chat_stop)]
    assert finish == ["stop"]


def test_chat_stream_keeps_a_whitespace_only_answer(client):
    """An answer that is only whitespace (here: a space, then a stop string) streams as it is returned."""
    full = greedy_chat(client, "Stop here", max_tokens=24).choices[0].message.content
    assert full[:1].isspace() and not full.isspace()  # premise: this prompt's greedy answer opens with a space
    stop = full.lstrip()[0]
    cut = full[: full.index(stop)]
    [whole] = greedy_chat(client, "Stop here", max_tokens=24, stop=stop).choices
    assert whole.message.content == cut
    content, _, finish, _ = join_chat_stream(greedy_chat(client, "Stop here", max_tokens=24, stop=stop, stream=True))
    assert finish == ["stop"]
    assert content == cut  # BUG: the stream sends "" (ReasoningStream drops whitespace it held back)


def test_include_stop_str_in_output(client):
    full = text_alone(client, PROMPTS[1], max_tokens=24)
    stop = ascii_stop(full)
    [choice] = client.completions.create(
        model="tiny",
        prompt=PROMPTS[1],
        temperature=0,
        max_tokens=24,
        stop=[stop],
        extra_body={**FIXED, "include_stop_str_in_output": True},
    ).choices
    assert choice.text == full[: full.index(stop) + len(stop)]
    assert choice.finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        [choice] = client.completions.create(
            model="tiny", prompt=PROMPTS[2], temperature=1, seed=seed, max_tokens=16, extra_body=FIXED
        ).choices
        return choice.text

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first  # 16 tokens at temperature 1: a collision is vanishingly unlikely


def test_chat_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model="tiny", messages=user("Roll the dice"), temperature=1, seed=seed, max_tokens=16, extra_body=FIXED
        )
        return response.choices[0].message.content + "|" + reasoning_of(response.choices[0].message)

    first = sample(7)
    assert sample(7) == first
    assert sample(123) != first


def test_chat_logprobs(client):
    response = greedy_chat(client, "Logprobs please", max_tokens=6, logprobs=True, top_logprobs=3)
    [choice] = response.choices
    entries = choice.logprobs.content
    assert len(entries) == response.usage.completion_tokens == 6
    for entry in entries:
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3
        assert top == sorted(top, reverse=True)
        assert all(lp <= 0.0 for lp in top)
        assert entry.logprob <= top[0] + 1e-6
        assert entry.logprob == pytest.approx(top[0], abs=1e-5)  # greedy takes the most likely token
        assert entry.token == entry.top_logprobs[0].token
        assert entry.bytes == list(entry.token.encode())


def test_chat_logprobs_sampled_tokens(client):
    response = client.chat.completions.create(
        model="tiny",
        messages=user("Sampled logprobs"),
        temperature=1,
        seed=3,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body=FIXED,
    )
    entries = response.choices[0].logprobs.content
    assert len(entries) == 8
    for entry in entries:
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert entry.logprob <= top[0] + 1e-6


def test_chat_stream_logprobs_match_non_streaming(client):
    kwargs = dict(max_tokens=6, logprobs=True, top_logprobs=2)
    whole = greedy_chat(client, "Stream logprobs", **kwargs).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in greedy_chat(client, "Stream logprobs", stream=True, **kwargs)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


def test_completion_legacy_logprobs(client):
    response = greedy_completion(client, PROMPTS[0], max_tokens=7, logprobs=2)
    [choice] = response.choices
    lp = choice.logprobs
    n = response.usage.completion_tokens
    assert n == 7
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2  # keyed by token text: two ids with the same text share a key
        assert logprob <= max(top.values()) + 1e-6
        assert token in top  # greedy: the chosen token is the most likely one
    assert lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_logprobs_zero_gives_chosen_token_only(client):
    [choice] = greedy_completion(client, PROMPTS[0], max_tokens=5, logprobs=0).choices
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == 5
    assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)


def test_completion_echo_prepends_the_prompt(client, tokenizer):
    plain = text_alone(client, PROMPTS[3])
    [echoed] = greedy_completion(client, PROMPTS[3], echo=True).choices
    assert echoed.text == PROMPTS[3] + plain
    ids = tokenizer.encode(PROMPTS[3])
    [echoed_ids] = greedy_completion(client, ids, echo=True).choices
    assert echoed_ids.text == tokenizer.decode(ids, skip_special_tokens=False) + plain


def test_completion_echo_with_logprobs_scores_the_prompt_then_the_output(client):
    [choice] = greedy_completion(client, PROMPTS[0], max_tokens=4, echo=True, logprobs=1).choices
    assert choice.text.startswith(PROMPTS[0])
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None  # the prompt's first token has nothing before it
    assert all(lp is not None for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[-4] == len(PROMPTS[0])  # the output after the prompt


def test_completion_echo_streaming(client):
    plain = text_alone(client, PROMPTS[0])
    streamed = "".join(
        c.text for chunk in greedy_completion(client, PROMPTS[0], echo=True, stream=True) for c in chunk.choices
    )
    assert streamed == PROMPTS[0] + plain


# -- HTTP answers equal the offline LLM's -----------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_qwen3) -> LLM:
    return LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24)


def test_completions_equal_llm_generate(client, llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == 12 for out in outputs)
    offline = [out.outputs[0].text for out in outputs]
    listed = greedy_completion(client, PROMPTS, max_tokens=12)
    assert [c.text for c in listed.choices] == offline
    assert [text_alone(client, p, max_tokens=12) for p in PROMPTS] == offline


def test_chat_equals_llm_chat(client, llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for text in ("Hi!", "What is Python?"):
        [offline] = llm.chat(user(text), params, use_tqdm=False)
        served = greedy_chat(client, text, max_tokens=12).choices[0].message
        assert (served.content or "") == offline.outputs[0].text
        assert reasoning_of(served) == (offline.outputs[0].reasoning_content or "")


# -- concurrency: requests share engine steps -------------------------------------------------------


def test_concurrent_requests_share_engine_steps(url):
    n, max_tokens = 16, 24
    steps, generated = "qwenbatch:iteration_tokens_total_count", "qwenbatch:generation_tokens_total"
    before = scrape(url)

    async def main():
        async with async_client(url) as aclient:
            calls = [
                aclient.completions.create(
                    model="tiny", prompt=f"Request {i} says", temperature=0, max_tokens=max_tokens, extra_body=FIXED
                )
                for i in range(n)
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(main())
    assert all(r.usage.completion_tokens == max_tokens for r in responses)
    after = scrape_until(url, generated, before.get(generated, 0.0) + n * max_tokens)
    assert after[generated] - before.get(generated, 0.0) == n * max_tokens
    num_steps = after[steps] - before.get(steps, 0.0)
    assert max_tokens <= num_steps < n * max_tokens / 4  # serial serving would need n * max_tokens steps


# -- LangChain's ChatOpenAI -------------------------------------------------------------------------


def chat_model(url: str, **kwargs):
    from langchain_openai import ChatOpenAI

    options = dict(base_url=url + "/v1", api_key="x", model="tiny", temperature=0, max_tokens=8, max_retries=0)
    options.update(kwargs)
    return ChatOpenAI(**options)


def test_langchain_invoke_and_ainvoke(url, client):
    model = chat_model(url, extra_body=FIXED)
    reply = model.invoke("Hello LangChain")
    direct = greedy_chat(client, "Hello LangChain", max_tokens=8)
    assert reply.content == direct.choices[0].message.content
    assert reply.response_metadata["token_usage"]["completion_tokens"] == 8
    assert reply.usage_metadata["input_tokens"] == direct.usage.prompt_tokens
    assert reply.response_metadata["finish_reason"] == "length"
    assert asyncio.run(model.ainvoke("Hello LangChain")).content == reply.content


def test_langchain_batch_in_order(url):
    model = chat_model(url, extra_body=FIXED)
    inputs = ["First question", "Second question", "Third question"]
    single = [model.invoke(text).content for text in inputs]
    assert len(set(single)) > 1  # different answers, so order is visible
    assert [m.content for m in model.batch(inputs)] == single


def test_langchain_streaming(url):
    plain = chat_model(url, extra_body=FIXED, streaming=False).invoke("Stream to me").content
    streaming = chat_model(url, extra_body=FIXED, streaming=True)
    assert "".join(chunk.content for chunk in streaming.stream("Stream to me")) == plain
    assert streaming.invoke("Stream to me").content == plain  # invoke aggregates the stream


def test_langchain_enable_thinking_false_adds_the_empty_think_block(url, tokenizer):
    messages = user("Think or not")
    plain = prompt_tokens_of(tokenizer, messages)
    no_thinking = prompt_tokens_of(tokenizer, messages, enable_thinking=False)
    assert tokenizer.apply_chat_template(messages, enable_thinking=False).endswith(NO_THINKING)
    assert no_thinking > plain

    default = chat_model(url).invoke("Think or not")
    nested = chat_model(url, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).invoke("Think or not")
    top_level = chat_model(url, extra_body={"enable_thinking": False}).invoke("Think or not")
    assert default.response_metadata["token_usage"]["prompt_tokens"] == plain
    assert nested.response_metadata["token_usage"]["prompt_tokens"] == no_thinking
    assert top_level.usage_metadata["input_tokens"] == no_thinking


def test_openai_sdk_enable_thinking_switch(client, tokenizer):
    messages = user("Think or not")
    plain = prompt_tokens_of(tokenizer, messages)
    no_thinking = prompt_tokens_of(tokenizer, messages, enable_thinking=False)
    assert no_thinking > plain

    def prompt_tokens(extra: dict) -> int:
        response = client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=2, extra_body={**FIXED, **extra}
        )
        return response.usage.prompt_tokens

    assert prompt_tokens({}) == plain
    assert prompt_tokens({"chat_template_kwargs": {"enable_thinking": False}}) == no_thinking
    assert prompt_tokens({"enable_thinking": False}) == no_thinking
    assert prompt_tokens({"enable_thinking": True}) == plain
    # The top-level switch wins over chat_template_kwargs.
    assert prompt_tokens({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}) == plain


# -- model names ------------------------------------------------------------------------------------


def test_models_lists_every_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert all(m.object == "model" and m.owned_by == "qwenbatch" for m in models.data)


def test_alias_serves_the_same_model(client):
    direct = greedy_chat(client, "Alias check").choices[0].message.content
    alias = greedy_chat(client, "Alias check", model="tiny-alias").choices[0].message.content
    assert alias == direct
    [by_alias] = client.completions.create(
        model="tiny-alias", prompt=PROMPTS[0], temperature=0, max_tokens=8, extra_body=FIXED
    ).choices
    assert by_alias.text == text_alone(client, PROMPTS[0])


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        greedy_chat(client, "Who?", model="no-such-model")
    assert error.value.status_code == 404
    assert error.value.body["code"] == "model_not_found"
    assert error.value.body["param"] == "model"


def test_parse_gives_the_pydantic_object_of_a_json_schema_response(client):
    """The SDK's ``parse`` sends the model's JSON schema as a strict json_schema response_format and reads the
    answer back into it."""

    class Answer(BaseModel):
        answer: Literal["yes", "no"]
        count: int = Field(ge=0, le=99)
        ok: bool

    completion = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "Is it raining? Answer in JSON."}],
        response_format=Answer,
        max_tokens=200,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},  # a random model pads otherwise
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(completion.choices[0].message.parsed, Answer)
