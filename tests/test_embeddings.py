"""Text embeddings (task embed): a Qwen3-Embedding checkpoint as Qwen ships it (the backbone's tensors without the
``model.`` prefix, no LM head, config.json naming Qwen3ForCausalLM, a tokenizer that appends <|endoftext|>) gives
each text the L2-normalized final hidden state of its last token, as the model card's transformers code does."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from conftest import make_tokenizer, tiny_shape
from qwenbatch import LLM

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Python is a programming language.", "用一句话介绍Python"]


def make_embedding_model(folder: Path, tie_word_embeddings: bool = True) -> Path:
    """A tiny random Qwen3 backbone saved as Qwen3-Embedding's files are."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoModel, Qwen3Config

    folder.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    cfg = Qwen3Config(**tiny_shape(vocab), head_dim=32, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(5)
    AutoModel.from_config(cfg, dtype=torch.float32).save_pretrained(str(folder))  # keys: embed_tokens, layers.*, norm
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_embedding_model(tmp_path_factory.mktemp("models") / "tiny-Qwen3-Embedding")


def reference(folder: Path, texts: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    """The model card's method: the tokenizer's ids, the last token's hidden state, L2-normalized (float32)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = [tokenizer(t)["input_ids"] for t in texts]
    with torch.no_grad():
        states = [model(input_ids=torch.tensor([i])).last_hidden_state[0, -1] for i in ids]
    return ids, torch.nn.functional.normalize(torch.stack(states), dim=-1)


@pytest.mark.parametrize("cpu_kernels", ["on", "off"])
def test_embeddings_equal_the_model_cards_transformers_code(folder, cpu_kernels):
    llm = LLM(str(folder), dtype="float32", cpu_kernels=cpu_kernels)  # "auto": the name says embedding
    outputs = llm.embed(TEXTS, use_tqdm=False)
    ids, expected = reference(folder, TEXTS)
    eos = llm.tokenizer.hf.convert_tokens_to_ids("<|endoftext|>")
    assert [o.prompt_token_ids for o in outputs] == ids and all(i[-1] == eos for i in ids)
    got = torch.stack([o.embedding for o in outputs])
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)


def test_token_ids_and_truncation(folder):
    llm = LLM(str(folder), dtype="float32")
    ids, expected = reference(folder, TEXTS[:1])
    [as_ids, truncated] = llm.embed([ids[0], TEXTS[0]], truncate_prompt_tokens=5, use_tqdm=False)
    _, last_five = reference_of_ids(folder, ids[0][-5:])
    assert as_ids.prompt_token_ids == ids[0][-5:] == truncated.prompt_token_ids
    assert torch.allclose(truncated.embedding, last_five, atol=1e-5)
    [whole] = llm.embed([ids[0]], use_tqdm=False)
    assert torch.allclose(whole.embedding, expected[0], atol=1e-5)
    for one in (TEXTS[0], ids[0]):  # one prompt, not a list of them (its characters or its ids)
        [alone] = llm.embed(one, use_tqdm=False)
        assert torch.allclose(alone.embedding, expected[0], atol=1e-5)
    assert truncated.prompt is None  # the text no longer matches the ids


def reference_of_ids(folder: Path, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        state = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    return ids, torch.nn.functional.normalize(state, dim=-1)


def test_an_untied_checkpoint_without_a_head_embeds_but_does_not_generate(tmp_path):
    folder = make_embedding_model(tmp_path / "Qwen3-Embedding-untied", tie_word_embeddings=False)
    [out] = LLM(str(folder), dtype="float32").embed(TEXTS[:1], use_tqdm=False)
    assert torch.allclose(out.embedding, reference(folder, TEXTS[:1])[1][0], atol=1e-5)
    with pytest.raises(ValueError, match=r"missing tensors: lm_head\.weight"):
        LLM(str(folder), dtype="float32", task="generate")


def test_each_engine_refuses_the_other_task(folder, tiny_qwen3):
    with pytest.raises(ValueError, match="embeds texts"):
        LLM(str(folder), dtype="float32").generate(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="does not embed"):
        LLM(str(tiny_qwen3), dtype="float32").embed(["hi"], use_tqdm=False)


# -- the server and run-batch ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    from qwenbatch.config import EngineConfig
    from qwenbatch.server.app import ServerSettings
    from server_harness import RunningServer

    settings = ServerSettings(served_model_names=["embed"], data_dir=tmp_path_factory.mktemp("batch-data"))
    with RunningServer(settings, EngineConfig(model=str(folder), dtype="float32")) as s:
        yield s


def test_the_batch_api_embeds_a_file(server, folder):
    from openai import OpenAI

    from server_harness import wait_for

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    lines = [
        {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "embed", "input": t}}
        for i, t in enumerate(TEXTS)
    ]
    upload = client.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    done = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status in ("completed", "failed") and b, "the batch"
    )
    assert done.status == "completed" and done.request_counts.completed == len(TEXTS)
    results = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    vectors = {r["custom_id"]: r["response"]["body"]["data"][0]["embedding"] for r in results}
    _, expected = reference(folder, TEXTS)
    got = torch.tensor([vectors[f"doc-{i}"] for i in range(len(TEXTS))])
    assert torch.allclose(got, expected, atol=1e-5)


def test_the_embeddings_endpoint_in_floats_base64_and_fewer_dimensions(server, folder):
    from openai import OpenAI

    _, expected = reference(folder, TEXTS)
    response = httpx.post(server.url + "/v1/embeddings", json={"model": "embed", "input": TEXTS}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    assert torch.allclose(torch.tensor([d["embedding"] for d in body["data"]]), expected, atol=1e-5)
    ids = reference(folder, TEXTS)[0]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    sdk = client.embeddings.create(model="embed", input=TEXTS[0])  # the SDK asks for base64 and decodes it
    assert torch.allclose(torch.tensor(sdk.data[0].embedding), expected[0], atol=1e-5)
    short = client.embeddings.create(model="embed", input=[ids[1]], dimensions=16, encoding_format="float")
    cut = torch.nn.functional.normalize(expected[1, :16], dim=-1)
    assert torch.allclose(torch.tensor(short.data[0].embedding), cut, atol=1e-5)

    for fields, param in (({"input": TEXTS[0], "dimensions": 65}, "dimensions"), ({"input": []}, "input")):
        refused = httpx.post(server.url + "/v1/embeddings", json={"model": "embed", **fields}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert httpx.get(server.url + "/config", timeout=60).json()["task"] == "embed"  # what "auto" stood for
    chat = httpx.post(server.url + "/v1/completions", json={"model": "embed", "prompt": "hi"}, timeout=60)
    assert chat.status_code == 400 and "embeds texts" in chat.json()["error"]["message"]


def test_a_generating_server_refuses_embeddings(tiny_server):
    refused = httpx.post(tiny_server.url + "/v1/embeddings", json={"model": "tiny", "input": "hi"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_run_batch_embeds_plain_lines_and_openai_lines(folder, tmp_path):
    from qwenbatch.cli import main

    plain = tmp_path / "texts.txt"
    plain.write_text("\n".join(TEXTS) + "\n")
    lines = tmp_path / "lines.jsonl"
    lines.write_text(
        "\n".join(
            json.dumps({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": t}})
            for i, t in enumerate(TEXTS)
        )
        + "\n"
    )
    short = tmp_path / "short.jsonl"  # the body alone: an input routes to the embeddings endpoint
    short.write_text("\n".join(json.dumps({"custom_id": f"doc-{i}", "input": t}) for i, t in enumerate(TEXTS)) + "\n")
    _, expected = reference(folder, TEXTS)
    for source, extra in ((plain, ["--input-format", "prompts", "--endpoint", "embeddings"]), (lines, []), (short, [])):
        out = tmp_path / f"{source.stem}-out.jsonl"
        flags = ["--model", str(folder), "--dtype", "float32", *extra]
        assert main(["run-batch", "-i", str(source), "-o", str(out), *flags]) == 0
        results = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["custom_id"])
        vectors = [r["response"]["body"]["data"][0]["embedding"] for r in results]
        assert torch.allclose(torch.tensor(vectors), expected, atol=1e-5), source.name
