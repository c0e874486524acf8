"""Sampling defaults from the model's generation_config.json, as vLLM's --generation-config applies them: what a
request or an offline call leaves unset, the model's creator's values fill; what it sets, it keeps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from qwenbatch import LLM, SamplingParams
from qwenbatch.config import EngineConfig
from qwenbatch.models.generation_config import recommended_values, sampling_defaults
from qwenbatch.sampling_params import SamplingDefaults
from qwenbatch.server.app import ServerSettings
from qwenbatch.serving.base import sampling_params
from qwenbatch.serving.protocol import ChatCompletionRequest
from server_harness import RunningServer

# Qwen2.5-Instruct's generation_config.json.
QWEN25 = {
    "bos_token_id": 151643,
    "pad_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "transformers_version": "4.37.0",
}
QWEN25_DEFAULTS = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)


def with_generation_config(checkpoint: Path, folder: Path, values: dict) -> Path:
    """A copy of ``checkpoint`` whose generation_config.json also holds ``values``."""
    shutil.copytree(checkpoint, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return folder


def test_the_values_read_are_those_that_differ_from_transformers_defaults(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({**QWEN25, "top_k": 50, "max_new_tokens": 512}))
    # top_k 50 is transformers' own default, which vLLM drops too (GenerationConfig.to_diff_dict)
    assert recommended_values(path) == {"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05, "max_tokens": 512}


def test_auto_reads_the_model_folder_vllm_ignores_it_and_overrides_win(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN25))
    assert sampling_defaults("auto", tmp_path, {}) == QWEN25_DEFAULTS
    assert sampling_defaults("vllm", tmp_path, {}) == SamplingDefaults()
    assert sampling_defaults("auto", tmp_path, {"temperature": 0.2, "max_new_tokens": 9}) == SamplingDefaults(
        temperature=0.2, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=9, max_tokens_limit=9
    )
    assert sampling_defaults("auto", None, {}) == SamplingDefaults()  # dummy weights: no folder
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert sampling_defaults(str(other), tmp_path, {}) == SamplingDefaults(temperature=0.3)


def test_a_folder_without_a_generation_config_or_with_a_bad_value_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no generation_config\.json"):
        sampling_defaults(str(tmp_path), None, {})
    path = tmp_path / "generation_config.json"
    for text, message in (("[0.7]", "not a JSON object"), ("{", "cannot read it as JSON"), ('{"top_p": 0}', "top_p")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            sampling_defaults(str(tmp_path), None, {})
    with pytest.raises(ValueError, match="temperature"):
        sampling_defaults("vllm", None, {"temperature": -1})
    with pytest.raises(ValueError, match="--generation-config vllm ignores"):  # the way out, where the model's is bad
        sampling_defaults("auto", tmp_path, {})


def test_the_override_must_be_a_json_object_of_sampling_values():
    config = EngineConfig(override_generation_config='{"temperature": 0.5, "max_new_tokens": 8}')
    assert config.generation_overrides == {"temperature": 0.5, "max_new_tokens": 8}
    for bad in ('{"temp": 0.5}', "[0.5]", "temperature=0.5"):
        with pytest.raises(ValueError, match="override_generation_config"):
            EngineConfig(override_generation_config=bad)


def test_a_request_keeps_what_it_sets_and_takes_the_defaults_for_the_rest():
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=100)
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0, top_k=0)
    params = sampling_params(body, None, None, defaults)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (0.0, 0, 0.8, 1.05)
    assert params.max_tokens is None  # the engine takes the default length where the context has room for it
    assert sampling_params(body, 5, None, defaults).max_tokens == 5


def test_the_default_length_limits_requests_only_where_the_operator_chose_it(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN25, "max_new_tokens": 100}))
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])

    def granted(source: str, overrides: dict, asked: int | None) -> int | None:
        return sampling_params(body, asked, None, sampling_defaults(source, tmp_path, overrides)).max_tokens

    # vLLM: the model's own max_new_tokens is a default, which a request's max_tokens overrides ...
    assert [granted("auto", {}, asked) for asked in (None, 50, 500)] == [None, 50, 500]
    # ... while one from a folder the operator names, or from the override, is the most any request gets.
    assert [granted(str(tmp_path), {}, asked) for asked in (None, 50, 500)] == [None, 50, 100]
    assert [granted("auto", {"max_new_tokens": 80}, asked) for asked in (None, 50, 500)] == [None, 50, 80]
    assert [granted("vllm", {"max_tokens": 80}, asked) for asked in (None, 500)] == [None, 80]
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingDefaults(max_tokens_limit=0)


def test_llm_without_sampling_params_samples_as_the_generation_config_says(tiny_qwen3, tmp_path):
    folder = with_generation_config(tiny_qwen3, tmp_path / "model", {"top_k": 1, "max_new_tokens": 5})
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=2**24)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, max_tokens=5)
    prompt = list(range(10, 30))
    [sampled] = llm.generate(prompt, use_tqdm=False)
    [greedy] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert sampled.outputs[0].token_ids == greedy.outputs[0].token_ids  # top_k 1 at temperature 1 is greedy
    plain = LLM(model=str(folder), dtype="float32", kv_cache_memory=2**24, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_the_default_length_gives_way_to_the_context_left(tiny_qwen3, tmp_path):
    folder = with_generation_config(tiny_qwen3, tmp_path / "model", {"max_new_tokens": 5})
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=2**24, max_model_len=24)
    unset = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    lengths = [len(out.outputs[0].token_ids) for out in llm.generate([[7] * 10, [7] * 21], unset, use_tqdm=False)]
    assert lengths == [5, 3]  # the default 5, or the 3 tokens a 21-token prompt leaves of 24: no error
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.engine.inputs.make_request("r", [7] * 21, SamplingParams(max_tokens=5))  # set by the caller: refused


def test_the_server_fills_what_a_request_leaves_unset_from_the_generation_config(tiny_qwen3, tmp_path):
    folder = with_generation_config(tiny_qwen3, tmp_path / "model", {"top_k": 1, "max_new_tokens": 3})
    config = EngineConfig(
        model=str(folder), dtype="float32", kv_cache_memory=2**24, override_generation_config='{"max_tokens": 4}'
    )
    with RunningServer(ServerSettings(served_model_names=["tiny"]), config) as server:
        applied = httpx.get(f"{server.url}/config").json()["default_sampling_params"]
        assert applied == {"temperature": 1.0, "top_p": 1.0, "top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0,
                           "max_tokens": 4, "max_tokens_limit": 4}  # fmt: skip

        def chat(**fields) -> dict:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True, **fields}
            response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        unset = [chat(seed=seed) for seed in (1, 2)]
        greedy = chat(temperature=0, max_tokens=4)
        assert [r["usage"]["completion_tokens"] for r in unset] == [4, 4]
        assert unset[0]["choices"][0]["message"] == unset[1]["choices"][0]["message"] == greedy["choices"][0]["message"]
        assert chat(max_tokens=2)["usage"]["completion_tokens"] == 2
        assert chat(max_tokens=9)["usage"]["completion_tokens"] == 4  # the override's length is the server's limit
