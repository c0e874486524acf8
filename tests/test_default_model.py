"""The embedded default model (Qwen2.5-Coder-0.5B-Instruct GGUF) against transformers, float32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gguf_writer import copy_without_vocabulary
from qwenbatch import LLM, SamplingParams
from qwenbatch.loader.default_model import default_gguf_path

pytestmark = pytest.mark.default_model

CHATS = [
    "用一句话介绍Python编程语言。",
    "Write a Python function that returns the n-th Fibonacci number.",
    "请解释什么是快速排序，并给出时间复杂度。",
    "What is the difference between a list and a tuple in Python?",
]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model="default", dtype="float32", kv_cache_memory=2**30)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]


def test_greedy_chat_equals_transformers_reading_the_gguf(llm, prompt_ids, tmp_path_factory):
    # The reference reads the original GGUF's tensors itself, so this also checks our dequantization and
    # tensor mapping, not only the model code.
    folder = tmp_path_factory.mktemp("gguf")
    copy_without_vocabulary(default_gguf_path(), folder / "model.gguf")
    ref = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf", dtype=torch.float32).eval()
    ours = llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for ids, output in zip(prompt_ids, ours, strict=True):
        with torch.inference_mode():
            expected = ref.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=32,
                eos_token_id=151645,
                pad_token_id=151643,
            )[0, len(ids) :].tolist()
        assert output.outputs[0].token_ids == expected
    del ref


def test_chat_answer_is_coherent_text(llm):
    out = llm.chat(
        [{"role": "user", "content": CHATS[0]}], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert "Python" in out.text and "编程语言" in out.text
    assert "\ufffd" not in out.text


def test_batch_of_8_mixed_lengths_equals_alone(llm, prompt_ids):
    prompts = prompt_ids + [ids[: len(ids) // 2] for ids in prompt_ids]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, batched, strict=True):
        alone = llm.generate([prompt], params, use_tqdm=False)[0]
        assert output.outputs[0].token_ids == alone.outputs[0].token_ids


def test_chunked_prefill_preemption_and_prefix_caching_do_not_change_greedy_output(llm, prompt_ids):
    from qwenbatch.engine.model_runner import kv_cache_bytes_per_token

    system = [{"role": "system", "content": "You are a careful senior engineer. Answer briefly and precisely."}]
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([*system, {"role": "user", "content": c}])) for c in CHATS]
    prompts += prompt_ids
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    per_token = kv_cache_bytes_per_token(llm.engine.model_config, llm.engine.dtype)
    tight = LLM(
        model="default", dtype="float32", max_num_batched_tokens=64, kv_cache_memory=160 * per_token, max_model_len=128
    )
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == reference
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.prefix_cache_hits > 0
    bm = tight.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
