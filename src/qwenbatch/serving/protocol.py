"""Request and response schemas of the OpenAI-compatible API (pydantic).

Requests ignore fields they do not know (clients send things such as ``use_beam_search``);
known fields with invalid values are rejected, naming the field. Extra fields that vLLM users
send (top_k, min_p, repetition_penalty, ...) are accepted with vLLM's meanings.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from qwenbatch.engine.input_processor import CONTINUE_OR_NEW_MESSAGE

NonNegativeInt = Annotated[int, Field(ge=0)]
MAX_N = 128  # samples per prompt; a bound so one request cannot queue unbounded work
MAX_LOGPROBS = 20  # top logprobs a token, as vLLM's default max_logprobs and OpenAI's top_logprobs
PositiveInt = Annotated[int, Field(ge=1)]
# vLLM's request priority: lower is served earlier; a batch job runs at a higher value than interactive requests.
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _holds_non_unicode(value: Any) -> bool:
    """True when ``value`` holds, anywhere inside, a string no UTF-8 can encode (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_holds_non_unicode(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_non_unicode(v) for v in value)
    return False


# The routes a batch line may name (OpenAI's Batch API: /v1/chat/completions and /v1/completions; ours adds rerank).
CHAT_URL, COMPLETIONS_URL, RERANK_URL = "/v1/chat/completions", "/v1/completions", "/v1/rerank"
EMBEDDINGS_URL = "/v1/embeddings"


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="wrap")
    @classmethod
    def _unicode_text_only(cls, data: Any, handler):
        # JSON may carry "\ud800"; no tokenizer or encoder can take it, so it is refused here, naming its field,
        # for every request type at once (it was a 500 on paths that did not check).
        if isinstance(data, dict):
            for key, value in data.items():
                if _holds_non_unicode(value):
                    raise ValidationError.from_exception_data(
                        cls.__name__,
                        [{"type": "string_unicode", "loc": (key,), "input": "<text with a lone surrogate>"}],
                    )
        return handler(data)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str


class FunctionCallIn(_Request):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends the JSON text


class ToolCallIn(_Request):
    """A tool call an earlier assistant message made (sent back with the tool's answer)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant message's
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching ``json_schema.schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs``: a JSON schema, any JSON object, a regex, a choice or a Lark grammar."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingFields(_Request):
    """Fields chat and completions share; ``to_sampling_params`` lives in server/sampling.py."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegativeInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Keep only the last N prompt tokens, so one overlong row in a large job need not fail.
    truncate_prompt_tokens: PositiveInt | None = None
    priority: Priority = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    logit_bias: dict[int, float] | None = None  # OpenAI's; JSON's keys are the ids' digits
    allowed_token_ids: list[NonNegativeInt] | None = None
    # vLLM's: each prompt token's logprob and the top ones at its position (not with stream).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class FunctionDefinition(_Request):
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Request):
    """A function the model may call (OpenAI's ``tools``)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: FunctionName


class _TemplateFields(_Request):
    """How a conversation goes through the chat template (chat completions and /tokenize share them)."""

    chat_template_kwargs: dict[str, Any] | None = None
    # Qwen clients send this at the top level (through the SDK's extra_body).
    enable_thinking: bool | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message left open for the model to go on with (a prefilled answer); needs
    # add_generation_prompt false.
    continue_final_message: bool = False
    tools: list[ToolDefinition] | None = None  # the functions the template offers the model

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_new_message(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt"):
            raise ValueError(CONTINUE_OR_NEW_MESSAGE)
        return value

    def template_options(self) -> dict[str, Any]:
        """How the request has its conversation rendered, as ``InputProcessor.chat_prompt`` takes it."""
        return {
            "enable_thinking": self.thinking(),
            "add_generation_prompt": self.add_generation_prompt,
            "tools": self.tool_dicts(),
            "continue_final_message": self.continue_final_message,
        }

    def tool_dicts(self) -> list[dict] | None:
        """``tools`` as the chat template takes them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def thinking(self) -> bool | None:
        """Qwen3's enable_thinking switch: the top-level field wins over chat_template_kwargs."""
        if self.enable_thinking is not None:
            return self.enable_thinking
        value = (self.chat_template_kwargs or {}).get("enable_thinking")
        return None if value is None else bool(value)


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """``messages`` as the chat template takes them: role and text, and a tool message's call id and an assistant
    message's tool calls, their arguments as objects (as vLLM hands them to the template: Qwen's writes them
    with ``tojson``)."""
    dicts = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _as_object(c)}}
                for c in m.tool_calls
            ]
        dicts.append(d)
    return dicts


def _as_object(call: ToolCallIn) -> dict[str, Any] | str:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments  # not JSON: the template writes the text as it came
    return arguments


class ChatCompletionRequest(_SamplingFields, _TemplateFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    return_reasoning: bool | None = None
    # None: "auto" where tools are given. "none" keeps them in the prompt and the output as text (vLLM's).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: NonNegativeInt | None = 16  # 0 only with echo: the prompt alone comes back (OpenAI's)
    echo: bool = False  # the prompt before the output; with logprobs, the prompt tokens' logprobs first
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class TokenizeRequest(_TemplateFields):
    """vLLM's ``POST /tokenize``: a ``prompt`` as completions read it, or ``messages`` as chat completions render
    them, one of the two. ``add_special_tokens`` defaults as vLLM's: True for a prompt, False for messages."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    """vLLM's ``POST /detokenize``: the text of token ids, special tokens included."""

    model: str | None = None
    tokens: list[NonNegativeInt]


class DetokenizeResponse(_Response):
    prompt: str


MAX_RERANK_DOCUMENTS = 4096  # pairs in one rerank/score request


class RerankDocument(_Request):
    text: str


class RerankRequest(_Request):
    """vLLM's and Jina's /rerank: one query against many documents."""

    model: str | None = None
    priority: Priority = 0
    query: NonEmptyStr
    documents: Annotated[list[str | RerankDocument], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    top_n: PositiveInt | None = None
    instruction: str | None = None
    return_documents: bool = True


MAX_EMBEDDING_INPUTS = 2048  # texts in one embeddings request (OpenAI's limit)


class EmbeddingRequest(_Request):
    """OpenAI's /v1/embeddings: a text, texts, token ids or lists of them, each embedded alone."""

    model: str | None = None
    priority: Priority = 0
    input: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[list[NonNegativeInt], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[NonNegativeInt], Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS),
        ]
    )
    encoding_format: Literal["float", "base64"] = "float"  # base64: float32 little-endian bytes (the SDK's default)
    dimensions: PositiveInt | None = None  # the first this many values, normalized again (Matryoshka; Qwen3-Embedding)
    user: str | None = None
    truncate_prompt_tokens: PositiveInt | None = None  # vLLM's: keep the last this many tokens of a longer input


class ScoreRequest(_Request):
    """vLLM's /score: text_1 against text_2, one to one or one to many."""

    model: str | None = None
    priority: Priority = 0
    text_1: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    # Documents may be empty strings (they score low), as in /rerank; queries may not.
    text_2: NonEmptyStr | Annotated[list[str], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    instruction: str | None = None


# OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class CreateBatchRequest(_Request):
    """``POST /v1/batches``."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None


MAX_CONFIG_NUM_SEQS = 65_536
MAX_CONFIG_BATCHED_TOKENS = 1_048_576


class ConfigUpdate(_Request):
    """``POST /config``: the limits that can change while the server runs."""

    model_config = ConfigDict(extra="forbid")
    # Bounded, so a value no engine could use is refused before it is applied.
    max_num_seqs: Annotated[int, Field(ge=1, le=MAX_CONFIG_NUM_SEQS)] | None = None
    max_num_batched_tokens: Annotated[int, Field(ge=1, le=MAX_CONFIG_BATCHED_TOKENS)] | None = None


# -- responses --------------------------------------------------------------------------------------


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob]


class FunctionCall(_Response):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(_Response):
    """A tool call in a stream: sent whole, in the chunk that finishes its choice."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: str | int | None = None


class PromptLogprob(_Response):
    """vLLM's ``prompt_logprobs`` entry: a token's logprob at a prompt position, its rank there (1: the likeliest)
    and its text."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt token, None for the first, then the prompt's token and the top ones by id (as digits: JSON keys).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Response):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
