"""A CPU engine's large step buffers are reused from the malloc heap, not mapped afresh each step
(engine/host_allocator.py)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's malloc's")

# In a fresh process, so that the settings an engine makes do not leak into this one's other tests.
PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import psutil, torch
    from qwenbatch import LLM, SamplingParams

    def faults_of_a_buffer_after_a_freed_one(first, second):
        buffer = torch.empty(first, dtype=torch.uint8)
        buffer.fill_(1)
        del buffer
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = torch.empty(second, dtype=torch.uint8)
        buffer.fill_(1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    llm = LLM(model=sys.argv[1], dtype="float32")
    # a prefill chunk's activations are tens of MB, and chunks differ in size
    step_buffer = faults_of_a_buffer_after_a_freed_one(64 << 20, 48 << 20)
    rss = psutil.Process().memory_info().rss
    huge = torch.ones(3 << 29, dtype=torch.uint8)  # 1.5 GiB, once
    del huge
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # its end leaves the engine idle
    print(json.dumps({"faults": step_buffer, "kept_after_huge": psutil.Process().memory_info().rss - rss}))
    """
)


@glibc_only
def test_freed_step_buffers_are_reused_without_page_faults_and_given_back_when_idle(tiny_qwen3):
    """Without the engine's settings every buffer above 32 MiB is a fresh mmap whose pages all fault in again
    (12% of cpu-mixed's prefill was the kernel zeroing such pages). A one-off huge buffer is given back
    once the engine has no work, so a server does not keep its peak."""
    run = subprocess.run([sys.executable, "-c", PROBE, str(tiny_qwen3)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    pages = (48 << 20) // 4096
    assert probe["faults"] < pages // 100, probe
    assert probe["kept_after_huge"] < 256 << 20, probe
