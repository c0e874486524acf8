"""What structured outputs cost a batch job: the default model answers N chat prompts in JSON matching a schema
(all at once, greedy), and the run's time is split into the model's steps and the masks' work: the matches' masks
(llguidance), their application to the logits (the sampler) and the sampled tokens taken by the matches. Then the
same prompts without a schema, each capped at the length its JSON answer had, so both runs make the same tokens in
the same steps. Never run by CI.

    .venv/bin/python benchmarks/structured_output_speed.py --num-prompts 64 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

from qwenbatch import LLM, SamplingParams, StructuredOutputs
from qwenbatch.engine import structured_output
from qwenbatch.layers import sampler

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population", "languages", "capital"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Hanoi", "Quito", "Cairo", "Perth", "Dublin", "Kyiv", "Accra"]


def timed(owner, name: str, totals: dict[str, float]) -> None:
    """Wrap ``owner.name`` so that its calls' time adds up in ``totals[name]``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, max_num_seqs=args.num_prompts)
    prompts = [
        [{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} ({i}) as JSON: city, country, population, "
                                     "languages, whether it is the capital."}]
        for i in range(args.num_prompts)
    ]  # fmt: skip
    totals: dict[str, float] = defaultdict(float)
    timed(structured_output.OutputGrammar, "allowed_token_bits", totals)
    timed(structured_output.OutputGrammar, "accept", totals)
    timed(sampler, "_masked_to_allowed", totals)
    spec = StructuredOutputs(json=SCHEMA)
    llm.chat(prompts[:2], SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec), use_tqdm=False)
    rows = []
    for run in range(args.runs):
        totals.clear()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=spec)
        start = time.perf_counter()
        outs = llm.chat(prompts, params, use_tqdm=False)
        constrained = time.perf_counter() - start
        masks = dict(totals)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(o.outputs[0].finish_reason == "stop" and bool(json.loads(o.outputs[0].text)) for o in outs)
        # The same tokens' worth of work without a schema: each answer capped at its JSON answer's length.
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        llm.chat(prompts, free, use_tqdm=False)
        plain = time.perf_counter() - start
        rows.append((constrained, plain, masks, sum(lengths), valid))
        print(
            f"run {run}: schema {constrained:.2f} s, none {plain:.2f} s ({constrained / plain:.3f}x), "
            f"{sum(lengths)} tokens, {valid}/{len(outs)} valid JSON; masks "
            + ", ".join(f"{k} {v:.2f} s" for k, v in masks.items())
        )
    ratio = statistics.median(r[0] / r[1] for r in rows)
    print(f"median schema / none: {ratio:.3f}x over {args.runs} runs")


if __name__ == "__main__":
    main()
