"""The requests ``qwenbatch tune`` analyses and sweeps: a named workload, or a user's run-batch input file."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from qwenbatch.batch.jsonl import CHAT_URL, COMPLETIONS_URL, parse_lines
from qwenbatch.bench.workloads import BenchRequest


@dataclass
class TuneWorkload:
    """Every prompt's length (for the analysis) and a fixed-seed sample of the requests (for the sweep)."""

    name: str
    prompt_lengths: list[int]
    sample: list[BenchRequest]


def sample_workload(name: str, requests: list[BenchRequest], num_samples: int, seed: int = 0) -> TuneWorkload:
    """A synthetic workload: all of it analysed, ``num_samples`` of it swept."""
    lengths = [len(r.prompt_token_ids) for r in requests]
    sample = requests if len(requests) <= num_samples else random.Random(seed).sample(requests, num_samples)
    return TuneWorkload(name, lengths, sample)


def file_workload(path: Path, tokenizer, max_tokens: int, num_samples: int, seed: int = 0) -> TuneWorkload:
    """The chat and completions lines of a run-batch input file, tokenized as the engine would
    (chat template included). Streamed: only lengths and a reservoir sample are kept."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if tokenizer is None:
        raise ValueError("tuning on an input file needs the model's tokenizer (dummy weights: pass --tokenizer)")
    rng = random.Random(seed)
    lengths: list[int] = []
    sample: list[BenchRequest] = []
    with open(path, encoding="utf-8-sig") as f:
        for line in parse_lines(f, endpoints=(CHAT_URL, COMPLETIONS_URL)):
            if not line.valid:
                continue
            for request in _requests_of(line.url, line.body, tokenizer, max_tokens):
                lengths.append(len(request.prompt_token_ids))
                if len(sample) < num_samples:  # reservoir sampling (Algorithm R)
                    sample.append(request)
                elif (j := rng.randrange(len(lengths))) < num_samples:
                    sample[j] = request
    if not lengths:
        raise ValueError(f"{path}: no valid chat or completions request line")
    return TuneWorkload(str(path), lengths, sample)


def _requests_of(url: str, body: dict, tokenizer, default_max_tokens: int) -> list[BenchRequest]:
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    ignore_eos = bool(body.get("ignore_eos", False))
    if url == CHAT_URL:
        messages = [{**m, "content": _text(m.get("content"))} for m in body.get("messages", [])]
        kwargs = body.get("chat_template_kwargs") or {}
        prompt = tokenizer.apply_chat_template(messages, enable_thinking=kwargs.get("enable_thinking"))
        return [BenchRequest(tokenizer.encode(prompt), max_tokens, ignore_eos)]
    prompts = body.get("prompt")
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [
        BenchRequest(p if isinstance(p, list) else tokenizer.encode(p), max_tokens, ignore_eos)
        for p in prompts or []
        if p
    ]


def _text(content) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""
