"""Engine behaviour on tiny checkpoints: batching never changes greedy output, and blocks come back."""

from __future__ import annotations

import random

import numpy as np
import pytest

from qwenbatch import LLM, SamplingParams, TokensPrompt
from server_harness import record_priorities

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def mixed_prompts(count: int, seed: int = 0, vocab: int = 400) -> list[list[int]]:
    """``count`` prompts of 1 to 300 tokens; the first k of any call are the same prompts."""
    prompts = []
    for i in range(count):
        rng = random.Random(seed * 1000 + i)
        length = [1, 2, 5, 17, 40, 95, 160, 300][i] if i < 8 else rng.randint(1, 200)
        prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    return prompts


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def folder(request, tiny_qwen2, tiny_qwen3):
    return str(tiny_qwen2 if request.param == "qwen2" else tiny_qwen3)


@pytest.fixture(scope="module")
def alone(folder):
    """Each prompt's greedy tokens when it runs by itself."""
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20)
    return [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in mixed_prompts(32)]


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished()


def test_batch_of_8_very_different_lengths_equals_alone(folder, alone):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20)
    assert tokens(llm.generate(mixed_prompts(8), GREEDY, use_tqdm=False)) == alone[:8]
    assert_all_blocks_free(llm)


def test_batch_of_32_with_chunked_prefill_equals_alone(folder, alone):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20, max_num_batched_tokens=64)
    assert tokens(llm.generate(mixed_prompts(32), GREEDY, use_tqdm=False)) == alone
    assert_all_blocks_free(llm)


def test_preemption_under_a_tiny_cache_does_not_change_output(folder, alone):
    from qwenbatch.engine.model_runner import kv_cache_bytes_per_token

    probe = LLM(model=folder, dtype="float32", kv_cache_memory=2**20)
    per_token = kv_cache_bytes_per_token(probe.engine.model_config, probe.engine.dtype)
    # Room for about 600 tokens: the longest prompt fits alone, the batch does not.
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=600 * per_token, max_model_len=400)
    assert tokens(llm.generate(mixed_prompts(32), GREEDY, use_tqdm=False)) == alone
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_aborted_requests_free_their_blocks(folder):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20)
    engine = llm.engine
    for i, prompt in enumerate(mixed_prompts(6)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for i in range(6):
        engine.abort(f"r{i}")
    assert_all_blocks_free(llm)


def test_prompts_are_pulled_lazily(folder):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20, max_num_seqs=4)
    pulled = 0
    peak = 0

    def prompts():
        nonlocal pulled, peak
        for p in mixed_prompts(40):
            pulled += 1
            peak = max(peak, llm.engine.num_unfinished_requests)
            yield p[:50]

    done = list(llm.generate_iter(prompts(), SamplingParams(temperature=0, max_tokens=4), use_tqdm=False))
    assert sorted(i for i, _ in done) == list(range(40))
    assert peak <= 2 * 4
    assert_all_blocks_free(llm)


def test_request_longer_than_max_model_len_is_rejected(folder):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) exceeds max_model_len \(64\)"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="the prompt has 64 tokens; max_model_len is 64"):
        llm.generate([[5] * 64], SamplingParams(max_tokens=None), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_vllm_prompt_dicts_give_what_their_token_ids_give(folder):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = [p[:40] for p in mixed_prompts(3)]
    plain = tokens(llm.generate(ids, params, use_tqdm=False))
    assert tokens(llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)) == plain
    assert tokens(llm.generate(TokensPrompt(prompt_token_ids=ids[1]), params, use_tqdm=False)) == plain[1:2]


def test_malformed_prompts_get_a_value_error_and_leave_the_engine_clean(folder):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20)
    bad = [{"prompt_token_ids": ["a"]}, {"prompt_token_ids": [True]}, [5, 1.5], {"text": "hi"}, {"prompt": 5}, 3.5]
    ids = np.array([5, 6])
    want = tokens(llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False))
    for numpy_prompt in (ids, list(ids)):  # an array, and a list of numpy integers
        assert tokens(llm.generate([numpy_prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)) == want
    for prompt in bad:
        with pytest.raises(ValueError, match="prompt"):
            llm.generate([[5, 6], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_max_model_len_larger_than_the_cache_fails_when_set(folder):
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        LLM(model=folder, dtype="float32", kv_cache_memory=2**16, max_model_len=1000)


def test_max_tokens_none_runs_to_the_context_limit(folder):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20, max_model_len=40)
    out = llm.generate([[7] * 30], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10
    assert out[0].outputs[0].finish_reason == "length"


def test_prefix_caching_on_and_off_give_the_same_greedy_output(folder, alone):
    shared = mixed_prompts(8)[7][:100]  # a 100-token shared prefix
    prompts = [shared + p[:20] for p in mixed_prompts(12)]
    on = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20)
    off = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20, enable_prefix_caching=False)
    with_cache = tokens(on.generate(prompts, GREEDY, use_tqdm=False))
    again = tokens(on.generate(prompts, GREEDY, use_tqdm=False))  # now served from the cache
    assert with_cache == again == tokens(off.generate(prompts, GREEDY, use_tqdm=False))
    bm = on.engine.block_manager
    assert bm.prefix_cache_hits >= 11 * 96 + 12 * 96  # shared within the first call, all of it the second time
    assert off.engine.block_manager.prefix_cache_hits == 0
    assert_all_blocks_free(on)


def test_kv_cache_bytes_per_token_is_exact_and_the_pool_matches_the_budget(folder):
    import torch

    from qwenbatch.engine.memory import BLOCK_BOOKKEEPING_BYTES_PER_TOKEN
    from qwenbatch.engine.model_runner import kv_cache_bytes_per_token

    llm = LLM(model=folder, dtype="float32", kv_cache_memory=3 * 2**20, block_size=16)
    cfg = llm.engine.model_config
    per_token = kv_cache_bytes_per_token(cfg, torch.float32)
    assert per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    pool_bytes = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches)
    num_blocks = llm.engine.block_manager.num_blocks
    assert pool_bytes == num_blocks * 16 * per_token
    assert num_blocks == 3 * 2**20 // (16 * (per_token + BLOCK_BOOKKEEPING_BYTES_PER_TOKEN))


def test_kv_cache_memory_as_a_fraction_of_available_memory(folder, monkeypatch):
    import psutil

    from qwenbatch.engine import llm_engine

    class FakeMemory:
        available = 64 * 2**20

    monkeypatch.setattr(psutil, "virtual_memory", lambda: FakeMemory)
    assert llm_engine.kv_cache_budget(0.25) == 16 * 2**20
    assert llm_engine.kv_cache_budget(None) == 16 * 2**20  # default: 4 GiB capped at a quarter
    assert llm_engine.kv_cache_budget(5000) == 5000
    with pytest.raises(ValueError, match="fraction in"):
        LLM(model=folder, kv_cache_memory=1.5)


# -- streaming deltas and stats -------------------------------------------------------------------


def run_streaming(engine, request_id: str, prompt, params: SamplingParams):
    """Step until ``request_id`` finishes; returns its deltas."""
    engine.add_request(request_id, prompt, params, stream=True)
    deltas = []
    while engine.has_unfinished():
        deltas.extend(o for o in engine.step() if o.request_id == request_id)
    return deltas


def test_streamed_deltas_add_up_to_the_final_output(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=32 * 2**20)
    prompt = "The quick brown fox"
    full = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    # A stop string taken from the middle of the text: streaming must never show text it then cuts.
    stop = full.text[len(full.text) // 2 :][:3]
    cases = [(GREEDY, full.text, full.token_ids)]
    stopped = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    cut = llm.generate([prompt], stopped, use_tqdm=False)[0].outputs[0]
    cases.append((stopped, cut.text, cut.token_ids))
    for i, (params, text, token_ids) in enumerate(cases):
        deltas = run_streaming(llm.engine, f"s{i}", prompt, params)
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        pieces = [d.outputs[0] for d in deltas]
        assert "".join(p.text for p in pieces) == text
        assert [t for p in pieces for t in p.token_ids] == token_ids
        assert sum(len(p.text) for p in pieces[:-1]) <= len(text)
        assert pieces[-1].finish_reason == ("length" if params is GREEDY else "stop")
        assert all(p.finish_reason is None for p in pieces[:-1])
    assert_all_blocks_free(llm)


def test_streaming_with_n_reports_each_sequence_once_finished(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=32 * 2**20)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    deltas = run_streaming(llm.engine, "n3", "hello", params)
    final = llm.generate(["hello"], params, use_tqdm=False)[0]
    for index in range(3):
        mine = [c for d in deltas for c in d.outputs if c.index == index]
        assert [t for c in mine for t in c.token_ids] == final.outputs[index].token_ids
        assert [c.finish_reason for c in mine].count("length") == 1


def test_iteration_stats_count_tokens_and_finished_requests(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=32 * 2**20)
    engine = llm.engine
    prompts = mixed_prompts(3)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    stats = engine.take_iteration_stats()
    assert stats.num_generation_tokens == 15
    assert stats.num_prompt_tokens == sum(len(p) for p in prompts)
    assert stats.num_batched_tokens == sum(len(p) for p in prompts) + 3 * 4
    assert len(stats.time_to_first_token) == 3
    assert len(stats.inter_token_latency) == 12
    assert [f.finish_reason for f in stats.finished] == ["length"] * 3
    assert sorted(f.num_prompt_tokens for f in stats.finished) == sorted(len(p) for p in prompts)
    assert engine.take_iteration_stats().num_generation_tokens == 0  # taken means reset
    engine.add_request("gone", prompts[0], GREEDY)
    engine.abort("gone")
    assert engine.take_iteration_stats().finished_reasons == ["abort"]
    sched = engine.scheduler_stats()
    assert (sched.num_running, sched.num_waiting, sched.kv_cache_usage) == (0, 0, 0.0)


def test_warm_up_runs_to_its_end_leaves_no_stats_and_refuses_a_busy_engine(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=32 * 2**20)
    engine = llm.engine
    engine.warm_up()
    assert not engine.has_unfinished() and engine.num_unfinished_requests == 0
    assert engine.take_iteration_stats().num_batched_tokens == 0  # the warm-up's steps are not the next run's
    assert engine.scheduler_stats().kv_cache_usage == 0.0
    engine.add_request("queued", mixed_prompts(1)[0], GREEDY)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.warm_up()
    assert engine.num_unfinished_requests == 1  # the caller's request is untouched


def test_update_limits_validates_and_applies(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=32 * 2**20)
    engine = llm.engine
    assert engine.update_limits(max_num_seqs=2) == {"max_num_seqs": 2, "max_num_batched_tokens": 2048}
    engine.add_request("a", mixed_prompts(1)[0], GREEDY)
    for i in range(3):
        engine.add_request(f"b{i}", mixed_prompts(3)[i], GREEDY)
    engine.step()
    assert len(engine.scheduler.running) == 2
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine.update_limits(max_num_batched_tokens=0)
    assert engine.config.max_num_batched_tokens == 2048


# -- priority -------------------------------------------------------------------------------------


def test_a_better_priority_request_gets_a_seat_at_once_and_the_preempted_output_is_unchanged(folder, alone):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=32 * 2**20, max_num_seqs=2)
    engine = llm.engine
    prompts = mixed_prompts(3)
    engine.add_request("low0", prompts[0], GREEDY, priority=1)
    engine.add_request("low1", prompts[1], GREEDY, priority=1)
    engine.step()
    engine.step()
    engine.add_request("high", prompts[2], GREEDY, priority=0)
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["high", "low0"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["low1"]
    assert engine.scheduler.num_preemptions == 1 == engine.take_iteration_stats().num_preemptions
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
    assert finished == {"low0": alone[0], "low1": alone[1], "high": alone[2]}
    assert list(finished).index("high") < list(finished).index("low1")
    assert_all_blocks_free(llm)


def test_priority_must_be_an_int(tiny_qwen3):
    engine = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=2**20).engine
    assert engine.inputs.make_request("a", [5, 6], GREEDY, priority=-7).seqs[0].priority == -7
    with pytest.raises(TypeError, match="priority must be an int, not str"):
        engine.inputs.make_request("b", [5, 6], GREEDY, priority="1")


def test_priority_over_http_is_validated_and_reaches_the_engine(tiny_server, monkeypatch):
    import httpx

    seen = record_priorities(monkeypatch, tiny_server.engine.inputs)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "ignore_eos": True}
    completion = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
    for path, body in [("/v1/chat/completions", chat), ("/v1/completions", completion)]:
        for bad in ["x", 1.5, 2**31, -(2**31) - 1]:
            response = httpx.post(tiny_server.url + path, json={**body, "priority": bad}, timeout=60)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "priority"
        for priority in (-3, None):
            fields = {} if priority is None else {"priority": priority}
            response = httpx.post(tiny_server.url + path, json={**body, **fields}, timeout=60)
            assert response.status_code == 200, response.text
    assert seen == [-3, 0, -3, 0]


def test_stats_nobody_takes_stay_bounded_and_the_counts_stay_exact(tiny_qwen3, monkeypatch):
    from qwenbatch.engine import stats as stats_module

    monkeypatch.setattr(stats_module, "MAX_PENDING_SAMPLES", 20)
    llm = LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=32 * 2**20)
    prompts = [[5 + i, 6, 7] for i in range(40)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.take_iteration_stats()
    assert stats.num_generation_tokens == 160 and stats.num_prompt_tokens == 120
    for samples in (stats.time_to_first_token, stats.inter_token_latency, stats.finished, stats.finished_reasons):
        assert len(samples) == 20


def test_kv_cache_memory_takes_the_clis_text_in_the_python_api_too():
    from qwenbatch.config import EngineConfig

    assert EngineConfig(kv_cache_memory="64MiB").kv_cache_memory == 64 * 2**20
    assert EngineConfig(kv_cache_memory="0.25").kv_cache_memory == 0.25
    with pytest.raises(ValueError, match="as a size in bytes"):
        EngineConfig(kv_cache_memory="lots")
