"""Incremental detokenization, stop strings, the <think> split and the chat template."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwenbatch import LLM, SamplingParams
from qwenbatch.tokenizer import IncrementalDetokenizer, ReasoningStream, Tokenizer, split_reasoning

CHINESE = "用一句话介绍Python编程语言。Python是一种高级编程语言。"


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


@pytest.fixture(scope="module")
def llm(tiny_qwen3) -> LLM:
    return LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=16 * 2**20)


def stream(tokenizer: Tokenizer, ids: list[int], **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``ids`` one at a time, up to a stop string; returns the detokenizer and the text after each."""
    detok = IncrementalDetokenizer(tokenizer, **{"stop": [], **kwargs})
    texts = []
    for token in ids:
        hit = detok.add(token)
        texts.append(detok.text)
        if hit is not None:
            break
    return detok, texts


# -- incremental detokenization -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        CHINESE,
        "Emoji 🙂 and symbols # @ / % survive tokenization.",
        "<think>思考一下</think>答案：Python是一种编程语言。",
    ],
)
def test_streamed_text_equals_decode_and_never_shows_a_replacement_char(tokenizer, text):
    ids = tokenizer.encode(text)
    detok, texts = stream(tokenizer, ids)
    assert detok.text == tokenizer.decode(ids) == text
    for step in texts:
        assert "\ufffd" not in step
        assert text.startswith(step)  # streamed text only grows; nothing emitted is taken back


def test_chinese_characters_really_span_several_tokens(tokenizer):
    # The test above means something only if some character is split over tokens.
    ids = tokenizer.encode(CHINESE)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def test_special_tokens_are_skipped_like_decode(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n你好<|im_end|>")
    detok, _ = stream(tokenizer, ids)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n你好"
    kept, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert kept.text == tokenizer.decode(ids, skip_special_tokens=False)


# -- stop strings ---------------------------------------------------------------------------------

FOX = "The quick brown fox jumps over the lazy dog."


def test_stop_string_spanning_tokens_is_found_and_cut(tokenizer):
    ids = tokenizer.encode(FOX)
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "quick" not in pieces  # " qu" + "ick": the stop string spans two tokens
    detok, texts = stream(tokenizer, ids, stop=["quick"])
    assert detok.text == "The "
    assert len(texts) == pieces.index("ick") + 1  # found on the token that completes it


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    detok, _ = stream(tokenizer, tokenizer.encode(FOX), stop=["quick"], include_stop_str_in_output=True)
    assert detok.text == "The quick"


def test_first_of_several_stop_strings_ends_the_text(tokenizer):
    detok, _ = stream(tokenizer, tokenizer.encode(FOX), stop=["lazy", "fox"])
    assert detok.text == "The quick brown "
    detok, _ = stream(tokenizer, tokenizer.encode(FOX), stop=["absent"])
    assert detok.text == FOX


def test_chinese_stop_string(tokenizer):
    detok, _ = stream(tokenizer, tokenizer.encode(CHINESE), stop=["编程"])
    assert detok.text == "用一句话介绍Python"


def _two_token_stop(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    """Two ASCII letters or digits of the output that come from two consecutive tokens."""
    _, texts = stream(tokenizer, token_ids)
    for before, mid, after in zip(texts, texts[1:], texts[2:], strict=False):
        a, b = mid[len(before) :], after[len(mid) :]
        if a and b and (a[-1] + b[0]).isascii() and (a[-1] + b[0]).isalnum():
            return a[-1] + b[0]
    raise AssertionError(f"no ASCII pair across tokens in {texts[-1]!r}")


def test_engine_stops_on_a_stop_string(llm):
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The quick brown fox", "Python is", "Batch inference pushes", "def add(a, b):"]
    for prompt in prompts:  # the random model's output needs an ASCII pair to stop on
        full = llm.generate([prompt], base, use_tqdm=False)[0].outputs[0]
        try:
            stop = _two_token_stop(llm.tokenizer, full.token_ids)
            break
        except AssertionError:
            continue
    else:
        pytest.fail("none of the prompts gave an output with an ASCII pair")
    cut = full.text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    c = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop"
    assert c.stop_reason == stop
    assert c.text == full.text[:cut]
    assert len(c.token_ids) < len(full.token_ids)
    assert c.token_ids == full.token_ids[: len(c.token_ids)]
    kept = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert llm.generate([prompt], kept, use_tqdm=False)[0].outputs[0].text == full.text[: cut + len(stop)]


# -- reasoning split ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "opened", "reasoning", "answer"),
    [
        ("<think>a</think>b", False, "a", "b"),
        ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", False, "Let me think.", "The answer is 4."),
        ("the template opened it\n</think>\n\nanswer", True, "the template opened it", "answer"),
        ("no thought was opened</think>answer", False, None, "no thought was opened</think>answer"),
        ("<think>\nstill thinking", False, "still thinking", ""),
        ("plain text, no thought", False, None, "plain text, no thought"),
        ("\n\nleading newlines stay", False, None, "\n\nleading newlines stay"),
        ("", False, None, ""),
    ],
)
def test_split_reasoning(text, opened, reasoning, answer):
    assert split_reasoning(text, opened) == (reasoning, answer)


# -- chat template --------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "你好"}]


def test_chat_template_without_thinking_has_the_empty_think_block(tokenizer):
    off = tokenizer.apply_chat_template(MESSAGES, enable_thinking=False)
    assert off == "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for default in (
        tokenizer.apply_chat_template(MESSAGES),
        tokenizer.apply_chat_template(MESSAGES, enable_thinking=True),
    ):
        assert default == "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n"


def test_think_tags_are_single_tokens(tokenizer):
    ids = tokenizer.encode("<think>\n\n</think>")
    assert ids[0] == tokenizer.hf.convert_tokens_to_ids("<think>")
    assert ids[-1] == tokenizer.hf.convert_tokens_to_ids("</think>")


def test_llm_chat_sends_the_templated_prompt(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    (out,) = llm.chat(MESSAGES, params, enable_thinking=False, use_tqdm=False)
    assert out.prompt == llm.tokenizer.apply_chat_template(MESSAGES, enable_thinking=False)
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt)
    assert llm.tokenizer.hf.convert_tokens_to_ids("</think>") in out.prompt_token_ids
    assert len(out.outputs[0].token_ids) <= 4


def test_chat_without_a_template_is_a_clear_error(tiny_qwen3, tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_qwen3, folder)
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    cfg = folder / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data.pop("chat_template", None)
    cfg.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer(folder).apply_chat_template(MESSAGES)


@settings(max_examples=200, deadline=None)
@given(
    text=st.sampled_from(
        [
            "<think>a</think>b",
            "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
            "<think>\nstill thinking",
            "plain text, no thought",
            "  <thi",
            "<think>x </think>\n\n\nans  wer",
            "<think></think>ok",
            "<think>\n\n</think>\n\nhi </thi",
            "plan</think>\n\nanswer",
            "\n\nhi",
            " ",
            "",
        ]
    ),
    cuts=st.lists(st.integers(1, 5), max_size=40),
)
def test_streamed_reasoning_split_equals_the_whole_text_split(text, cuts):
    stream = ReasoningStream()
    reasoning = answer = ""
    pos = 0
    for step in [*cuts, len(text)]:
        r, a = stream.feed(text[pos : pos + step])
        reasoning, answer, pos = reasoning + r, answer + a, pos + step
    r, a = stream.finish()
    expected_reasoning, expected_answer = split_reasoning(text)
    assert (reasoning + r, answer + a) == (expected_reasoning or "", expected_answer)


def test_streamed_reasoning_when_the_template_opened_the_thought():
    stream = ReasoningStream(opened=True)
    pieces = [stream.feed(p) for p in ["\nI think", " so.\n</thi", "nk>\n\nYes", "."]] + [stream.finish()]
    assert "".join(r for r, _ in pieces) == "I think so."
    assert "".join(a for _, a in pieces) == "Yes."
    assert split_reasoning("\nI think so.\n</think>\n\nYes.", opened=True) == ("I think so.", "Yes.")
    assert split_reasoning("unfinished", opened=True) == ("unfinished", "")
