"""The offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(conversations, params)``."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence

from tqdm import tqdm

from qwenbatch.config import EngineConfig
from qwenbatch.engine.llm_engine import LLMEngine
from qwenbatch.outputs import RequestOutput
from qwenbatch.sampling_params import SamplingParams
from qwenbatch.tokenizer import THINK_END, THINK_START, split_reasoning

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class LLM:
    """A model loaded for offline batch generation.

    Keyword arguments are EngineConfig fields (``model``, ``dtype``, ``max_num_seqs``, ...).
    """

    def __init__(self, model: str = "default", **kwargs) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        started = time.perf_counter()
        self.engine = LLMEngine(self.config)
        logger.info("model %s ready in %.1f s", model, time.perf_counter() - started)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        results: dict[int, RequestOutput] = {}
        for index, output in self.generate_iter(prompts, params, use_tqdm=use_tqdm, total=len(prompts)):
            results[index] = output
        return [results[i] for i in range(len(prompts))]

    def generate_iter(
        self,
        prompts: Iterable[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams],
        use_tqdm: bool = True,
        total: int | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt index, output)`` as requests finish.

        Prompts are pulled from the iterable only as the engine has room (about two batches
        ahead), so a million-prompt iterator never sits tokenized in memory at once.
        """
        engine = self.engine
        per_prompt = not isinstance(sampling_params, SamplingParams)
        lookahead = 2 * self.config.max_num_seqs
        source = iter(enumerate(prompts))
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
                    index, prompt = item
                    request_id = f"gen-{next(self._ids)}"
                    params = sampling_params[index] if per_prompt else sampling_params
                    engine.add_request(request_id, prompt, params)
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
    ) -> list[RequestOutput]:
        """Apply the chat template to each conversation and generate; thinking goes to ``reasoning_content``."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights): chat needs one")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c, enable_thinking=enable_thinking) for c in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        if not self.tokenizer.has_token(THINK_END):
            return outputs  # not a thinking model (Qwen2.5): the text is all answer
        for prompt, output in zip(prompts, outputs, strict=True):
            opened = prompt.rstrip().endswith(THINK_START)  # the template began the thought
            for completion in output.outputs:
                completion.reasoning_content, completion.text = split_reasoning(completion.text, opened)
        return outputs
