"""Tool calls in Qwen's format (vLLM's "hermes" parser): the model writes each call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` after any text, as its chat template tells it to
when a request gives ``tools``. The calls come back as OpenAI's ``tool_calls`` with finish reason "tool_calls";
``tool_choice`` "required" or a named function makes the output such calls (a structured output's grammar, whose
JSON may hold any whitespace unless ``structured_outputs.disable_any_whitespace`` is set)."""

from __future__ import annotations

import json
import re
import uuid

from qwenbatch.sampling_params import StructuredOutputs
from qwenbatch.serving.errors import APIError
from qwenbatch.serving.protocol import ChatCompletionRequest, FunctionCall, NamedToolChoice, ToolCall
from qwenbatch.tokenizer import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A call closed, or the last one left open by the end of the output (its JSON may still be whole).
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The text before the first call (None if only whitespace) and the calls; ``(text, [])`` where the text holds
    no call, or a closed call that is not a JSON object with a name (then it was meant as text). A last call left
    open and unreadable (the output was cut) is dropped."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _CALL.finditer(text, start):
        closed = match.group(1) is not None
        try:
            call = json.loads(match.group(1) if closed else match.group(2))
        except json.JSONDecodeError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            if closed or not calls:
                return text, []
            break
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(name=call["name"], arguments=json.dumps(arguments, ensure_ascii=False)),
            )
        )
    content = text[:start]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """One streamed choice's text with its tool calls held back: text flows until a call opens (or may be opening:
    a partial ``<tool_call>`` at the end waits for the next piece); ``finish`` parses what was held."""

    def __init__(self) -> None:
        self._held = ""
        self._calling = False

    def feed(self, text: str) -> str:
        """What of ``text`` can be sent now as content."""
        if self._calling:
            self._held += text
            return ""
        text = self._held + text
        start = text.find(OPEN)
        if start >= 0:
            self._calling, self._held = True, text[start:]
            return text[:start]
        keep = partial_suffix(text, OPEN)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest of the content and the calls, at the end of the output."""
        held, self._held = self._held, ""
        if not self._calling:
            return held, []
        content, calls = parse_tool_calls(held)
        return (content or "", calls) if calls else (held, [])


def parses_tool_calls(body: ChatCompletionRequest) -> bool:
    """Whether the request's output is read for tool calls: tools given and tool_choice not "none"."""
    return bool(body.tools) and body.tool_choice != "none"


def forced_calls(body: ChatCompletionRequest, has_call_tokens: bool) -> StructuredOutputs | None:
    """For tool_choice "required" (one call or more, of any tool) or a named function (one call of it), the grammar
    the output must match; None otherwise. ``has_call_tokens``: the tokenizer has ``<tool_call>`` as one token
    (Qwen's), which the grammar must then name as a token. 400 naming tool_choice where it names no given tool."""
    choice = body.tool_choice
    if choice in (None, "none", "auto"):
        return None
    if not body.tools:
        raise APIError(400, "tool_choice required or a named function needs tools", param="tool_choice")
    functions = [t.function for t in body.tools]
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f.name == choice.function.name]
        if not functions:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")  # fmt: skip
    schema: dict = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters or {"type": "object"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
    }
    if body.structured_outputs is not None and body.structured_outputs.disable_any_whitespace:
        schema["x-guidance"] = {"whitespace_flexible": False}  # the request's own structured_outputs option
    # In llguidance's Lark a bare <tool_call> names the token; quoted, it is text.
    open_, close = (OPEN, CLOSE) if has_call_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    calls = "call" if isinstance(choice, NamedToolChoice) else 'call ("\\n" call)*'
    grammar = f'start: {calls}\ncall: {open_} "\\n" body "\\n" {close}\nbody: %json {json.dumps(schema)}'
    return StructuredOutputs(grammar=grammar)
