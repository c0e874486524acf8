"""A CPU engine's large step buffers are reused, not mapped and faulted in afresh each step
(layers/host_allocator.py, csrc/host_allocator.cpp)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# In a fresh process: the allocator an engine installs serves the whole process from then on.
PROBE = textwrap.dedent(
    """
    import json, resource, sys, threading
    import torch
    from qwenbatch import LLM, SamplingParams
    from qwenbatch.layers.host_allocator import step_buffer_stats

    def faults_of_a_buffer_after_a_freed_one(first, second, found):
        buffer = torch.empty(first, dtype=torch.uint8)
        buffer.fill_(1)
        del buffer
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = torch.empty(second, dtype=torch.uint8)
        buffer.fill_(1)
        found.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    llm = LLM(model=sys.argv[1], dtype=sys.argv[2], cpu_kernels=sys.argv[3])
    in_use_after_load = step_buffer_stats().in_use
    found = []
    # A prefill chunk's activations are tens of MB and differ in size from chunk to chunk; a server's engine
    # runs on a thread of its own.
    faults_of_a_buffer_after_a_freed_one(64 << 20, 56 << 20, found)
    worker = threading.Thread(target=faults_of_a_buffer_after_a_freed_one, args=(40 << 20, 36 << 20, found))
    worker.start()
    worker.join()
    cached_while_busy = step_buffer_stats().cached
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # its end leaves the engine idle
    print(json.dumps({"faults": found, "cached_while_busy": cached_while_busy, "in_use_after_load": in_use_after_load,
                      "cached_when_idle": step_buffer_stats().cached}))
    """
)


@pytest.mark.parametrize("dtype, cpu_kernels", [("bfloat16", "on"), ("float32", "auto")])
def test_freed_step_buffers_are_reused_without_page_faults_and_unmapped_when_idle(tiny_qwen3, dtype, cpu_kernels):
    """With malloc, every buffer above 32 MiB was a fresh mapping whose pages all faulted in again: 12% of
    cpu-mixed's prefill in bf16 was the kernel zeroing them, 14% of its whole run in float32. A float32 engine
    keeps PyTorch's layers (cpu_kernels auto) but uses the allocator: it changes no value."""
    probe = _probe(tiny_qwen3, dtype, cpu_kernels)
    assert probe["faults"] == [0, 0], probe
    # Installed after the KV pool was allocated: in the allocator's 2 MiB pages the pool's first touches each took
    # ~20 ms in these VMs, and cpu-mixed ran 20.3-22.4 s against 19.0 (BENCHMARKS.md, issue 15).
    assert probe["in_use_after_load"] == 0, probe
    assert probe["cached_while_busy"] >= 64 << 20, probe
    assert probe["cached_when_idle"] == 0, probe


def test_with_the_cpu_kernels_off_the_allocator_is_malloc(tiny_qwen3):
    probe = _probe(tiny_qwen3, "float32", "off")
    assert min(probe["faults"]) > 1000, probe  # every page of a fresh mapping
    assert probe["cached_while_busy"] == 0, probe


def _probe(checkpoint, dtype: str, cpu_kernels: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(checkpoint), dtype, cpu_kernels], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_buffers_hold_their_values_and_a_freed_one_serves_the_next_of_about_its_size():
    script = textwrap.dedent(
        """
        import json, torch
        from qwenbatch.layers.host_allocator import cache_step_buffers, return_cached_buffers, step_buffer_stats
        cache_step_buffers(limit_bytes=64 << 20)
        a = torch.arange(12 << 20, dtype=torch.int32)  # 48 MiB: 24 huge pages
        first = a.data_ptr()
        n = 12 << 20
        ok = int(a[-1]) == n - 1 and int(a.sum()) == n * (n - 1) // 2 and first % (2 << 20) == 0
        in_use = step_buffer_stats().in_use
        del a
        b = torch.empty(43 << 20, dtype=torch.uint8)  # 44 MiB rounded, within a quarter of the freed one: reused
        reused = b.data_ptr() == first
        del b
        c = torch.empty(80 << 20, dtype=torch.uint8)  # the freed 48 MiB grown to 80, unmapped when freed: 80 > 64 MiB
        del c
        kept = step_buffer_stats().cached
        small = torch.ones(1 << 20)  # 4 MiB, below 32 MiB: malloc's
        small_in_use = step_buffer_stats().in_use
        return_cached_buffers()
        print(json.dumps({"ok": ok, "in_use": in_use, "reused": reused, "kept": kept, "small": float(small.sum()),
                          "small_in_use": small_in_use, "after": step_buffer_stats().cached}))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe == {
        "ok": True,
        "in_use": 48 << 20,
        "reused": True,
        "kept": 0,
        "small": float(1 << 20),
        "small_in_use": 0,
        "after": 0,
    }


def test_a_buffer_larger_than_any_freed_one_grows_the_largest_and_faults_in_only_its_new_part():
    """The LM head's logits grow step by step while a prefill runs beside more and more decoding sequences; each
    was a new mapping whose pages all faulted in (50-110 ms a step in these VMs). The largest freed buffer below
    the size asked for is grown instead: its pages move into the larger buffer and only the rest is new memory."""
    script = textwrap.dedent(
        """
        import json, torch
        from qwenbatch.layers.host_allocator import cache_step_buffers, step_buffer_stats

        def rss_anon():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))

        def filled(n, added):  # a buffer of n bytes, written; how much resident memory that took
            before = rss_anon()
            buffer = torch.empty(n, dtype=torch.uint8)
            buffer.fill_(1)
            added.append((rss_anon() - before) >> 20)
            return buffer

        cache_step_buffers()
        added = []
        small, larger = filled(36 << 20, added), filled(48 << 20, added)
        del small, larger  # cached: 36 and 48 MiB
        # None cached within a quarter above 64 MiB: the 48 grows, then the 36, then a new mapping.
        buffers = [filled(64 << 20, added) for _ in range(3)]
        ok = all(int(b.min()) == int(b.max()) == 1 for b in buffers)
        del buffers
        print(json.dumps({"added": added, "ok": ok, "cached": step_buffer_stats().cached >> 20}))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe["ok"], probe
    want = [36, 48, 64 - 48, 64 - 36, 64]
    assert all(w <= got <= w + 2 for got, w in zip(probe["added"], want, strict=True)), probe
    assert probe["cached"] == 3 * 64, probe
