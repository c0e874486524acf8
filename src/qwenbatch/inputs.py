"""The prompt forms ``LLM.generate`` takes, with vLLM's names: text, token ids, or a dict of either."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the model's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt already tokenized: token ids as the model takes them."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt  # and 1-D numpy arrays or tensors of ids


def parse_prompt(prompt: PromptType) -> str | list[int]:
    """The prompt as text or token ids; ValueError, naming what is wrong, for any other shape."""
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list | tuple):
            return list(prompt["prompt_token_ids"])
        if keys in ({"prompt"}, {"prompt_token_ids"}):
            (key,) = keys
            raise ValueError(f"a prompt dict's {key!r} has the wrong type: {type(prompt[key]).__name__}")
        raise ValueError(
            "a prompt dict holds either 'prompt' (a string) or 'prompt_token_ids' (a list of ints), "
            f"got keys {sorted(map(str, keys))}"
        )
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple):
        return list(prompt)
    if hasattr(prompt, "tolist") and isinstance(ids := prompt.tolist(), list):  # a numpy array or a tensor of ids
        return ids
    raise ValueError(f"a prompt is a string, a list of token ids or a dict of either, got {type(prompt).__name__}")
