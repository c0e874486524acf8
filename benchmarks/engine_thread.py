"""cpu-mixed on an engine created and run on a thread of its own, as `qwenbatch serve` and `run-batch` run theirs:
glibc gives such a thread its own malloc arena, which maps and unmaps large buffers where the main thread's heap
may not (BENCHMARKS.md, the caching CPU allocator). Prints output tok/s; compare commits side by side with
PYTHONPATH=<a worktree>/src. Never run by CI.

    .venv/bin/python benchmarks/engine_thread.py --quantization none
"""

from __future__ import annotations

import argparse
import threading
import time

from qwenbatch import LLM, SamplingParams
from qwenbatch.bench.workloads import WORKLOADS


def output_tok_s(quantization: str) -> float:
    llm = LLM(quantization=quantization)
    work = WORKLOADS["cpu-mixed"](llm.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in work]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in work], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", choices=["none", "int8"], default="none")
    args = parser.parse_args()
    result: list[float] = []
    worker = threading.Thread(target=lambda: result.append(output_tok_s(args.quantization)))
    worker.start()
    worker.join()
    print(f"engine thread, cpu-mixed: {result[0]:.1f} output tok/s")


if __name__ == "__main__":
    main()
