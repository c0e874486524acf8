"""InputProcessor: prompts in, validated ``EngineRequest``s out (tokenizing, chat and reranker formatting).

Everything here is a pure function of the request and the model's fixed facts (tokenizer, vocabulary,
``max_model_len``), so it runs on any thread: the server tokenizes off its event loop, the engine thread
never waits on it. Every refusal is a ValueError whose message names the numbers.
"""

from __future__ import annotations

import itertools
import operator
import time

import jinja2
import torch

from qwenbatch.engine.request import EngineRequest, SampleState
from qwenbatch.engine.sequence import Sequence
from qwenbatch.engine.structured_output import GrammarCompiler
from qwenbatch.inputs import PromptType, parse_prompt
from qwenbatch.layers.sampler import token_bits
from qwenbatch.rerank import RerankFormatter
from qwenbatch.sampling_params import SamplingDefaults, SamplingParams, StructuredOutputs
from qwenbatch.tokenizer import IncrementalDetokenizer, Tokenizer

NOT_A_RERANKER = "this model does not score pairs: serve a Qwen3-Reranker, or pass --task rerank"
EMBEDDER_ONLY = "this model embeds texts (task embed): use /v1/embeddings or LLM.embed, not generation"
NOT_AN_EMBEDDER = "this model does not embed texts: serve a Qwen3-Embedding model, or pass --task embed"
NO_TOKENIZER = "this model has no tokenizer (dummy weights): pass prompt token ids"
CONTINUE_OR_NEW_MESSAGE = (
    "continue_final_message and add_generation_prompt cannot both be set: the model either goes on with the last "
    "message or starts a new one (set add_generation_prompt to false)"
)
SCORE_PARAMS = SamplingParams(temperature=0, max_tokens=1)  # placeholder: score-only sequences never sample
# A token is at least one byte of text in any tokenizer we serve (most are 3-4), so a prompt of more than
# this many bytes per max_model_len token cannot fit: it is refused before tokenizing a byte of it.
MAX_PROMPT_BYTES_PER_TOKEN = 16


def _check_priority(priority: int) -> None:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, not {type(priority).__name__}")


class InputProcessor:
    """Turns prompts into requests for one loaded model; thread-safe."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        rerank_formatter: RerankFormatter | None = None,
        sampling_defaults: SamplingDefaults | None = None,
        grammars: GrammarCompiler | None = None,
        embeds: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.embeds = embeds  # an embedding model's engine (task embed): make_embed_request, not generation
        self.grammars = grammars  # None: the model has no tokenizer, so no structured outputs
        # What a request's unset sampling values are: OpenAI's, or the model's generation config's.
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._rerank_formatter = rerank_formatter
        self._seq_ids = itertools.count()  # next() on it is atomic under the GIL

    # -- text ---------------------------------------------------------------------------------------

    def check_text_size(self, num_bytes: int) -> None:
        """ValueError when ``num_bytes`` of text could not fit max_model_len, whatever its tokens."""
        limit = self.max_model_len * MAX_PROMPT_BYTES_PER_TOKEN
        if num_bytes > limit:
            raise ValueError(
                f"the prompt has {num_bytes} bytes of text: more than {limit} cannot fit "
                f"max_model_len ({self.max_model_len} tokens)"
            )

    def chat_prompt(
        self,
        messages: list[dict],
        enable_thinking: bool | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation (offering ``tools``; its last message left open with ``continue_final_message``, which
        excludes ``add_generation_prompt``) through the model's chat template; ValueError if it has none or it
        fails."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights); use completions with token ids")
        if continue_final_message and add_generation_prompt:
            raise ValueError(CONTINUE_OR_NEW_MESSAGE)
        try:
            return self.tokenizer.apply_chat_template(
                messages, enable_thinking, add_generation_prompt, tools, continue_final_message
            )
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise ValueError(f"cannot apply the chat template: {e}") from e

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``text``'s token ids, as a request's prompt would hold them (``add_special_tokens`` adds what the
        tokenizer puts around a text: nothing for Qwen's); ValueError without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        return self.tokenizer.encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included; ValueError for an id outside the model's
        vocabulary, or without a tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights)")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"token ids must be integers in [0, {self.vocab_size})")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def token_ids_outside_vocabulary(self, params: SamplingParams) -> tuple[str, str] | None:
        """The first parameter of ``params`` that names a token outside the vocabulary, and the refusal's words;
        None where every id is in it."""
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            if any(t >= self.vocab_size for t in ids):
                return name, f"{name} must hold token ids in [0, {self.vocab_size})"
        return None

    def check_token_ids_of(self, params: SamplingParams) -> None:
        """ValueError naming the parameter where ``params`` names a token outside the vocabulary."""
        if outside := self.token_ids_outside_vocabulary(params):
            raise ValueError(outside[1])

    def check_structured_outputs(self, spec: StructuredOutputs) -> None:
        """ValueError, in llguidance's words, where ``spec`` is no grammar (a bad schema, regex or Lark grammar)."""
        self._grammar_compiler().check(spec)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            raise ValueError("structured outputs need the model's tokenizer (this model has none)")
        return self.grammars

    # -- generation ---------------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        stream: bool = False,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
    ) -> EngineRequest:
        """Tokenize (keeping the last ``truncate_prompt_tokens``, if given) and validate a request.

        ``stream=True`` makes the engine report the request's new tokens every step it samples.
        ``priority``: lower is served earlier (vLLM's convention); see scheduler.py.
        """
        _check_priority(priority)
        if self.embeds:
            raise ValueError(EMBEDDER_ONLY)
        prompt_text, token_ids = self._tokenize(parse_prompt(prompt), truncate_prompt_tokens)
        self._check_token_ids(token_ids)
        self.check_token_ids_of(params)
        n_prompt = len(token_ids)
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n_prompt} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        room = self.max_model_len - n_prompt
        if params.max_tokens is None:  # unset: the default length, where the context has room for it
            max_tokens = min(room, self.sampling_defaults.max_tokens or room)
        else:
            max_tokens = params.max_tokens
        if max_tokens > room:
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds max_model_len ({self.max_model_len})"
            )
        seqs = [
            Sequence(next(self._seq_ids), request_id, i, list(token_ids), n_prompt, params, max_tokens, priority)
            for i in range(params.n)
        ]
        samples = [self._sample_state(params, i) for i in range(params.n)]
        if params.structured_outputs is not None:
            grammars = self._grammar_compiler().grammars(params.structured_outputs, params.n)
            for state, grammar in zip(samples, grammars, strict=True):
                state.grammar = grammar
        request = EngineRequest(
            request_id, prompt_text, token_ids, seqs, samples, stream, priority, arrival_time=time.monotonic()
        )
        if params.allowed_token_ids is not None:
            request.allowed_token_bits = token_bits(params.allowed_token_ids, self.vocab_size)
        if params.prompt_logprobs is not None:  # computed once, by the first sequence
            request.prompt_logprobs, request.prompt_token_ranks = [None], [None]
            seqs[0].prompt_logprobs_from = 0 if n_prompt > 1 else None
        return request

    def _tokenize(self, prompt: str | list[int], truncate_prompt_tokens: int | None) -> tuple[str | None, list[int]]:
        if not isinstance(prompt, str):
            token_ids = self._as_token_ids(prompt)
            return None, token_ids if truncate_prompt_tokens is None else token_ids[-truncate_prompt_tokens:]
        if self.tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        try:
            num_bytes = len(prompt.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid Unicode text ({e.reason} at {e.start})") from e
        if truncate_prompt_tokens is None:
            self.check_text_size(num_bytes)
            return prompt, self.tokenizer.encode(prompt)
        return None, self.tokenizer.encode(prompt)[-truncate_prompt_tokens:]

    def _as_token_ids(self, values: list) -> list[int]:
        """Ints, numpy integers included, as Python ints; ValueError for bools, floats, strings."""
        try:
            if any(isinstance(t, bool) for t in values):
                raise TypeError
            return [operator.index(t) for t in values]
        except TypeError:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})") from None

    def _check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")

    def _sample_state(self, params: SamplingParams, index: int) -> SampleState:
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed((params.seed + index) % 2**64)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.skip_special_tokens, params.include_stop_str_in_output
            )
        return SampleState(generator, detokenizer, logprobs=[] if params.logprobs is not None else None)

    # -- scoring (reranker) -------------------------------------------------------------------------

    @property
    def rerank_formatter(self) -> RerankFormatter:
        """Builds reranker prompts; ValueError when the model does not score (not --task rerank)."""
        if self._rerank_formatter is None:
            raise ValueError(NOT_A_RERANKER)
        return self._rerank_formatter

    def make_score_request(self, request_id: str, token_ids: list[int], priority: int = 0) -> EngineRequest:
        """A request that prefills ``token_ids`` and reports P(yes) at the last position (reranker)."""
        _check_priority(priority)
        if self._rerank_formatter is None:
            raise ValueError(NOT_A_RERANKER)
        return self._pooling_request(request_id, None, token_ids, priority, "the pair")

    def _pooling_request(
        self, request_id: str, prompt: str | None, token_ids: list[int], priority: int, what: str
    ) -> EngineRequest:
        """A request of one score-only sequence over ``token_ids`` (``what`` names them in a refusal)."""
        self._check_token_ids(token_ids)
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{what} has {len(token_ids)} tokens; max_model_len is {self.max_model_len}")
        n = len(token_ids)
        seq = Sequence(next(self._seq_ids), request_id, 0, list(token_ids), n, SCORE_PARAMS, 1, priority)
        seq.score_only = True
        state = SampleState()
        return EngineRequest(
            request_id, prompt, seq.token_ids[:], [seq], [state], priority=priority, arrival_time=time.monotonic()
        )

    def make_embed_request(
        self, request_id: str, prompt: PromptType, priority: int = 0, truncate_prompt_tokens: int | None = None
    ) -> EngineRequest:
        """A request that prefills ``prompt`` and reports the normalized hidden state of its last token (an
        embedding model's last-token pooling). Text takes the tokenizer's own special tokens (Qwen3-Embedding's
        appends <|endoftext|>, whose state is the embedding); ``truncate_prompt_tokens`` keeps the last ones."""
        _check_priority(priority)
        if not self.embeds:
            raise ValueError(NOT_AN_EMBEDDER)
        prompt = parse_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(NO_TOKENIZER)
            if truncate_prompt_tokens is None:
                self.check_text_size(len(prompt.encode("utf-8", "surrogatepass")))
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = self._as_token_ids(prompt)
        if truncate_prompt_tokens is not None:
            token_ids = token_ids[-truncate_prompt_tokens:]
        text = prompt if isinstance(prompt, str) and truncate_prompt_tokens is None else None  # as _tokenize's
        return self._pooling_request(request_id, text, token_ids, priority, "the input")

    def make_score_requests(
        self, base_id: str, pairs: list[tuple[str, str]], instruction: str | None = None, priority: int = 0
    ) -> tuple[list[EngineRequest], list[int]]:
        """One score request per (query, document) pair, ids ``{base_id}-{i}``, and the body tokens that
        truncation dropped from each; ValueError naming the pair that cannot be scored."""
        formatter = self.rerank_formatter
        requests, truncated = [], []
        for i, (query, document) in enumerate(pairs):
            prompt = formatter.build(query, document, instruction)
            try:
                requests.append(self.make_score_request(f"{base_id}-{i}", prompt.token_ids, priority))
            except ValueError as e:
                raise ValueError(f"pair {i}: {e}") from e
            truncated.append(prompt.truncated_tokens)
        return requests, truncated
