"""The offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(conversations, params)``."""

from __future__ import annotations

import functools
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from tqdm import tqdm

from qwenbatch.config import EngineConfig
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.engine.request import EngineRequest
from qwenbatch.inputs import PromptType
from qwenbatch.outputs import RequestOutput, RerankResult
from qwenbatch.sampling_params import SamplingParams
from qwenbatch.tokenizer import THINK_END, THINK_START, split_reasoning

logger = logging.getLogger(__name__)


class LLM:
    """A model loaded for offline batch generation.

    Keyword arguments are EngineConfig fields (``model``, ``dtype``, ``max_num_seqs``, ...).
    """

    def __init__(self, model: str = "default", **kwargs) -> None:
        started = time.perf_counter()
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.config = self.engine.config  # with the batch limits the device resolved
        logger.info("model %s ready in %.1f s", model, time.perf_counter() - started)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no SamplingParams (vLLM's method): the model's
        generation config (``--generation-config``), else OpenAI's defaults, and 16 tokens unless it sets
        ``max_new_tokens``."""
        return self.engine.sampling_defaults.params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids":
        ...}`` dicts); outputs come back in prompt order."""
        if _one_prompt(prompts):
            prompts = [prompts]
        params = sampling_params or self.get_default_sampling_params()
        results: dict[int, RequestOutput] = {}
        for index, output in self.generate_iter(prompts, params, use_tqdm=use_tqdm, total=len(prompts)):
            results[index] = output
        return [results[i] for i in range(len(prompts))]

    def generate_iter(
        self,
        prompts: Iterable[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        use_tqdm: bool = True,
        total: int | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt index, output)`` as requests finish.

        Prompts are pulled from the iterable only as the engine has room (about two batches
        ahead), so a million-prompt iterator never sits tokenized in memory at once.
        """
        per_prompt = not isinstance(sampling_params, SamplingParams)

        def makers() -> Iterator[Callable[[str], EngineRequest]]:
            for index, prompt in enumerate(prompts):
                params = sampling_params[index] if per_prompt else sampling_params
                yield functools.partial(self.engine.inputs.make_request, prompt=prompt, params=params)

        yield from self._drive(makers(), use_tqdm, total)

    def embed(
        self, prompts: Iterable[PromptType], truncate_prompt_tokens: int | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Each prompt's embedding (an embedding model's, task embed: the last token's final hidden state,
        L2-normalized) as ``RequestOutput.embedding``, in input order; ``truncate_prompt_tokens`` keeps the last
        ones of a longer prompt."""
        inputs = self.engine.inputs
        if _one_prompt(prompts):
            prompts = [prompts]

        def makers() -> Iterator[Callable[[str], EngineRequest]]:
            for prompt in prompts:
                yield functools.partial(
                    inputs.make_embed_request, prompt=prompt, truncate_prompt_tokens=truncate_prompt_tokens
                )

        outputs = dict(self._drive(makers(), use_tqdm, None))
        return [outputs[i] for i in range(len(outputs))]

    def score(
        self, pairs: Iterable[tuple[str, str]], instruction: str | None = None, use_tqdm: bool = True
    ) -> list[float]:
        """Qwen3-Reranker P(yes) of each (query, document) pair, in input order (NaN for a failed pair)."""
        return [r.score for r in self._score(pairs, instruction, use_tqdm)]

    def rerank(
        self,
        query: str,
        documents: Sequence[str],
        instruction: str | None = None,
        top_n: int | None = None,
        use_tqdm: bool = True,
    ) -> list[RerankResult]:
        """``documents`` by relevance to ``query``, best first (the first ``top_n``)."""
        if not query:
            raise ValueError("query must not be empty")
        results = self._score(((query, d) for d in documents), instruction, use_tqdm, total=len(documents))
        for result in results:
            result.document = documents[result.index]
        ranked = sorted(results, key=lambda r: -r.score)
        return ranked[:top_n] if top_n is not None else ranked

    def _score(
        self, pairs: Iterable[tuple[str, str]], instruction: str | None, use_tqdm: bool, total: int | None = None
    ) -> list[RerankResult]:
        """One result per pair in input order; documents are left empty (rerank fills them in)."""
        formatter = self.engine.inputs.rerank_formatter
        truncated: list[int] = []

        def makers() -> Iterator[Callable[[str], EngineRequest]]:
            for query, document in pairs:
                prompt = formatter.build(query, document, instruction)
                truncated.append(prompt.truncated_tokens)
                yield functools.partial(self.engine.inputs.make_score_request, token_ids=prompt.token_ids)

        scores: dict[int, float] = {}
        for index, output in self._drive(makers(), use_tqdm, total):
            scores[index] = output.score if output.score is not None else math.nan
        return [RerankResult(i, scores[i], "", truncated[i]) for i in range(len(scores))]

    def _drive(
        self, makers: Iterator[Callable[[str], EngineRequest]], use_tqdm: bool, total: int | None
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Feed the engine requests made on demand, step it, and yield ``(index, output)`` as they finish."""
        engine = self.engine
        lookahead = 2 * self.config.max_num_seqs
        source = enumerate(makers)
        index_of: dict[str, int] = {}
        bar = tqdm(total=total, desc="requests", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        tokens_in = tokens_out = 0
        started = time.perf_counter()
        exhausted = False
        try:
            while True:
                while not exhausted and engine.num_unfinished_requests < lookahead:
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                        break
                    index, make = item
                    request_id = f"gen-{next(self._ids)}"
                    engine.add(make(request_id))
                    index_of[request_id] = index
                if not engine.has_unfinished():
                    break
                for output in engine.step():
                    tokens_in += output.num_prompt_tokens
                    tokens_out += output.num_output_tokens
                    elapsed = max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix_str(f"in {tokens_in / elapsed:.0f} tok/s, out {tokens_out / elapsed:.0f} tok/s")
                    bar.update(1)
                    yield index_of.pop(output.request_id), output
        finally:
            for request_id in index_of:
                engine.abort(request_id)
            bar.close()

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        enable_thinking: bool | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation (offering ``tools``, OpenAI's function definitions; the last
        message left open for the model to go on with where ``continue_final_message``, with
        ``add_generation_prompt`` false: as vLLM's ``LLM.chat``) and generate; thinking goes to
        ``reasoning_content``."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [
            self.engine.inputs.chat_prompt(c, enable_thinking, add_generation_prompt, tools, continue_final_message)
            for c in conversations
        ]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        if not self.tokenizer.has_token(THINK_END):
            return outputs  # not a thinking model (Qwen2.5): the text is all answer
        for prompt, output in zip(prompts, outputs, strict=True):
            opened = prompt.rstrip().endswith(THINK_START)  # the template began the thought
            for completion in output.outputs:
                completion.reasoning_content, completion.text = split_reasoning(completion.text, opened)
        return outputs


def _one_prompt(prompts: object) -> bool:
    """Whether ``prompts`` is one prompt (a text, a dict, a list of token ids) rather than a list of them."""
    one_token_list = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
    return isinstance(prompts, str | Mapping) or one_token_list
