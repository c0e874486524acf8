"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt's token ids as this server's requests would hold
them (so a job's prompts can be counted against ``max_model_len`` before it is sent), and the text of token ids.
Neither queues work on the engine: they answer while a full queue turns generation away."""

from __future__ import annotations

from qwenbatch.engine.input_processor import InputProcessor
from qwenbatch.serving.base import OpenAIServing
from qwenbatch.serving.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    message_dicts,
)


class OpenAIServingTokenization(OpenAIServing):
    """``POST /tokenize`` and ``POST /detokenize``."""

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """The ids of ``body.prompt``, or of ``body.messages`` through the chat template as chat completions render
        them; 400 naming the field when the text cannot be tokenized."""
        self.check_model(body.model)
        chat = body.messages is not None

        def tokenize(inputs: InputProcessor) -> TokenizeResponse:
            if chat:
                messages = message_dicts(body.messages)
                text = inputs.chat_prompt(messages, **body.template_options())
            else:
                text = body.prompt
            special = body.add_special_tokens if body.add_special_tokens is not None else not chat
            ids = inputs.encode(text, special)
            strings = inputs.tokenizer.token_strings(ids) if body.return_token_strs else None
            return TokenizeResponse(count=len(ids), max_model_len=inputs.max_model_len, tokens=ids, token_strs=strings)

        return await self.process(tokenize, param="messages" if chat else "prompt")

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of ``body.tokens``; 400 naming ``tokens`` for an id outside the vocabulary."""
        self.check_model(body.model)
        return await self.process(lambda inputs: DetokenizeResponse(prompt=inputs.decode(body.tokens)), "tokens")
