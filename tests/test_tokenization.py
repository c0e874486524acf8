"""vLLM's POST /tokenize and POST /detokenize: a prompt's ids as the server's requests hold them, so a job's prompts
can be counted against max_model_len before it is sent, and the text of ids."""

from __future__ import annotations

import httpx
import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime number."}]


@pytest.fixture(scope="module")
def url(tiny_server) -> str:
    return tiny_server.url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny", **body}, timeout=60)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def prompt_tokens(url: str, path: str, body: dict) -> int:
    """What a one-token generation of ``body`` reports as its prompt's length."""
    return ok(post(url, path, {"max_tokens": 1, **body}))["usage"]["prompt_tokens"]


def test_a_prompt_takes_the_ids_a_completion_holds(url, tiny_server):
    text = "Hello, world! Déjà vu: 12345."
    got = ok(post(url, "/tokenize", {"prompt": text, "return_token_strs": True}))
    tokenizer = tiny_server.app.state.serving.engine.inputs.tokenizer.hf
    assert got["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert got["count"] == len(got["tokens"]) == prompt_tokens(url, "/v1/completions", {"prompt": text})
    assert got["max_model_len"] == 1024
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(got["tokens"])
    assert "token_strs" not in ok(post(url, "/tokenize", {"prompt": text}))


@pytest.mark.parametrize("thinking", [None, False])
def test_messages_take_the_ids_a_chat_completion_holds(url, thinking):
    switch = {} if thinking is None else {"chat_template_kwargs": {"enable_thinking": thinking}}
    got = ok(post(url, "/tokenize", {"messages": MESSAGES, **switch}))
    assert (
        got["count"]
        == len(got["tokens"])
        == prompt_tokens(url, "/v1/chat/completions", {"messages": MESSAGES, **switch})
    )
    text = ok(post(url, "/detokenize", {"tokens": got["tokens"]}))["prompt"]
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n" + (
        "<think>\n\n</think>\n\n" if thinking is False else ""))  # fmt: skip
    bare = ok(post(url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False, **switch}))
    assert bare["count"] < got["count"]


def test_detokenize_gives_back_the_text_of_the_ids(url):
    text = "Ünïcödé and emoji 🚀, spaces  and\nnew lines"
    ids = ok(post(url, "/tokenize", {"prompt": text}))["tokens"]
    assert ok(post(url, "/detokenize", {"tokens": ids})) == {"prompt": text}
    assert ok(post(url, "/detokenize", {"tokens": []})) == {"prompt": ""}


BAD_BODIES = [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, None),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens.1"),
    ("/detokenize", {"tokens": "hi"}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_a_bad_body_is_400_naming_the_field(url, path, body, param):
    response = post(url, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_an_id_past_the_vocabulary_is_400_and_an_unknown_model_404(url, tiny_server):
    vocab = tiny_server.app.state.serving.engine.inputs.vocab_size
    error = post(url, "/detokenize", {"tokens": [1, vocab]}).json()["error"]
    assert error["param"] == "tokens" and str(vocab) in error["message"], error
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        response = post(url, path, {**body, "model": "gpt-17"})
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_continue_final_message_leaves_a_prefilled_answer_open(url, tiny_server):
    prefilled = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": prefilled, "add_generation_prompt": False, "continue_final_message": True}
    tokens = ok(post(url, "/tokenize", body))["tokens"]
    inputs = tiny_server.app.state.serving.engine.inputs
    text = inputs.decode(tokens)
    assert text.endswith("The answer is")  # no end of turn after it: the model goes on with this message
    closed = inputs.decode(ok(post(url, "/tokenize", {**body, "continue_final_message": False}))["tokens"])
    assert closed.startswith(text) and closed != text
    assert prompt_tokens(url, "/v1/chat/completions", body) == len(tokens)
    for path in ("/tokenize", "/v1/chat/completions"):
        refused = post(url, path, {"messages": prefilled, "continue_final_message": True})  # with the default header
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_llm_chat_continues_the_final_message(tiny_qwen3):
    from qwenbatch import LLM, SamplingParams

    llm = LLM(str(tiny_qwen3), dtype="float32")
    prefilled = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [out] = llm.chat(prefilled, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    prompt = llm.engine.inputs.chat_prompt(prefilled, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("The answer is")
    assert (
        out.prompt == prompt
        and out.outputs[0].token_ids == llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    )
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(prefilled, params, continue_final_message=True, use_tqdm=False)
