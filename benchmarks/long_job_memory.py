"""Memory over a long offline job: 100,000 short requests through `LLM.generate_iter` on a tiny random Qwen3
(dummy weights, token-id prompts), the default KV pool and prefix caching on, as a user's million-prompt job
would run; the process's RSS at each quarter, and the engine's bookkeeping beside it. Flat after the first
quarter means nothing grows with the number of requests. Never run by CI.

    .venv/bin/python benchmarks/long_job_memory.py --output benchmarks/results/long-job-memory.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import psutil

from qwenbatch import LLM, SamplingParams

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "eos_token_id": [2047],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default=None, help="default: the engine's default")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(TINY_QWEN3))
        kwargs = {"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}
        llm = LLM(
            folder,
            load_format="dummy",
            dtype="float32",
            enable_prefix_caching=not args.no_prefix_caching,
            **kwargs,
        )
    engine, process = llm.engine, psutil.Process()
    rng = random.Random(0)
    prompts = ([rng.randrange(2000) for _ in range(rng.randint(16, 48))] for _ in range(args.requests))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    quarter = args.requests // 4
    rows = [{"requests": 0, "rss_mib": process.memory_info().rss / 2**20, "s": 0.0}]
    started = time.perf_counter()
    for done, _ in enumerate(llm.generate_iter(prompts, params, use_tqdm=False), start=1):
        if done % quarter == 0:
            rows.append(
                {
                    "requests": done,
                    "rss_mib": process.memory_info().rss / 2**20,
                    "s": time.perf_counter() - started,
                    "cached_blocks": len(engine.block_manager.cached),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "command": " ".join(sys.argv),
        "machine": platform.processor() or platform.machine(),
        "num_blocks": engine.block_manager.num_blocks,
        "block_size": engine.block_manager.block_size,
        "prefix_caching": not args.no_prefix_caching,
        "rows": rows,
        "rss_growth_after_first_quarter_mib": rows[-1]["rss_mib"] - rows[1]["rss_mib"],
    }
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
