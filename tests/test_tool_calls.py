"""Tool calls as vLLM's hermes parser reads Qwen's: ``tools`` go into the chat template, ``<tool_call>`` blocks come
back as OpenAI's ``tool_calls`` (finish reason "tool_calls"), and tool_choice "required" or a named function makes
the output such calls. The tiny random model calls nothing of its own will, so the end-to-end tests force the calls
and check what a client reads back."""

from __future__ import annotations

import json

import httpx
import pytest

from qwenbatch import LLM, SamplingParams
from qwenbatch.serving.protocol import ChatMessage, message_dicts
from qwenbatch.serving.tool_calls import ToolCallStream, parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                       "additionalProperties": False},
    },
}  # fmt: skip
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model pads JSON forever otherwise


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_calls_are_read_after_the_text_and_text_that_is_no_call_stays_text():
    text = "Let me look.\n" + call_text("get_weather", {"city": "Oslo"}) + "\n" + call_text("add", {"a": True})
    content, calls = parse_tool_calls(text)
    assert content == "Let me look.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("add", {"a": True}),
    ]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls(call_text("f", {}))[0] is None  # nothing but calls: no content
    for text in ("no calls at all", "<tool_call>\nnot json\n</tool_call>", '<tool_call>\n["f"]\n</tool_call>'):
        assert parse_tool_calls(text) == (text, [])
    cut = call_text("f", {"x": 1}) + '\n<tool_call>\n{"name": "g", "argu'
    assert [c.function.name for c in parse_tool_calls(cut)[1]] == ["f"]  # the call the output's end cut is dropped


def test_a_stream_holds_back_a_call_even_when_its_tag_arrives_in_pieces():
    stream = ToolCallStream()
    pieces = ["Sure <to", "ol_ca", 'll>\n{"name": "f", ', '"arguments": {"k": 2}}\n</tool_call>']
    assert [stream.feed(p) for p in pieces] == ["Sure ", "", "", ""]
    rest, calls = stream.finish()
    assert rest == "" and calls[0].function.name == "f" and json.loads(calls[0].function.arguments) == {"k": 2}
    other = ToolCallStream()
    assert [other.feed(p) for p in ["a <t", "able>"]] == ["a ", "<table>"] and other.finish() == ("", [])


def test_an_earlier_call_reaches_the_template_with_its_arguments_as_an_object():
    messages = [
        ChatMessage(role="assistant", content=None, tool_calls=[
            {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
        ChatMessage(role="tool", content='{"sky": "clear"}', tool_call_id="c1"),
    ]  # fmt: skip
    assert message_dicts(messages) == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "c1"},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def url(tiny_server) -> str:
    return tiny_server.url


def chat(url: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 120, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_tools_are_offered_in_the_prompt_and_an_answered_call_goes_back_into_it(url):
    def prompt(**fields) -> str:
        response = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                        **fields})  # fmt: skip
        return httpx.post(url + "/detokenize", json={"tokens": response.json()["tokens"]}).json()["prompt"]

    assert "get_weather" in prompt(tools=[WEATHER]) and "get_weather" not in prompt()
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    response = chat(url, messages=history, tools=[WEATHER], max_tokens=4)
    assert response.status_code == 200, response.text
    rendered = prompt(messages=history, tools=[WEATHER])
    assert '"arguments": {"city": "Oslo"}' in rendered and "sunny" in rendered


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_gives_one_call_of_that_function(url, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    fields = {"tools": [WEATHER, ADD], "tool_choice": choice, "temperature": 1.0, "seed": 4, **COMPACT}
    if stream:
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 120,
                "stream": True, **fields}) as response:  # fmt: skip
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        assert not any(d["delta"].get("content") for d in deltas)  # the call is never sent as text
        last = deltas[-1]
        calls, finish = last["delta"]["tool_calls"], last["finish_reason"]
    else:
        response = chat(url, **fields)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        assert message.get("content") is None
        calls, finish = message["tool_calls"], response.json()["choices"][0]["finish_reason"]
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert calls[0]["function"]["name"] == "get_weather"
    assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7 and set(arguments) == {"city", "days"}


def test_required_gives_calls_of_the_tools_given(url):
    response = chat(url, tools=[WEATHER, ADD], tool_choice="required", temperature=1.0, seed=9, max_tokens=200,
                    **COMPACT)  # fmt: skip
    choice = response.json()["choices"][0]
    assert choice["message"]["tool_calls"], choice
    assert {c["function"]["name"] for c in choice["message"]["tool_calls"]} <= {"get_weather", "add"}


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "structured"),
    ],
    ids=["unknown-function", "no-tools", "with-response-format"],
)
def test_a_tool_choice_that_cannot_be_met_is_400(url, fields, words):
    response = chat(url, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and words in error["message"], error


def test_llm_chat_offers_tools_to_the_template(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**24)
    conversation = [{"role": "user", "content": "Weather?"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    [offered] = llm.chat(conversation, params, tools=[WEATHER], use_tqdm=False)
    [plain] = llm.chat(conversation, params, use_tqdm=False)
    assert "get_weather" in offered.prompt and "get_weather" not in plain.prompt
