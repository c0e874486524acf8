"""Qwen3-Reranker scoring: the model card's numbers, batching invariance, LLM.rerank, the server, run-batch, the CLI.

Everything runs on ``tiny_reranker`` (a random tiny Qwen3 whose tokenizer has single "yes" and "no" tokens, in
a folder whose name says reranker, so task "auto" means rerank), in float32. The reference is the model card's
``transformers`` recipe (DESIGN.md §5): the prefix, the body and the suffix tokenized separately, the body
truncated to ``max_length`` minus prefix and suffix, left padding, and P("yes") from a log-softmax over the last
position's logits of "no" and "yes". The random model's scores carry no meaning, so tests compare numbers with
the reference or with each other, never with an expected ranking.

Note on the tiny tokenizer: its prefix is 108 tokens and its suffix 18, so a max length of 128 leaves two
body tokens (every body is cut to the same two, so every pair scores alike) and 256 leaves 130 (short pairs fit,
long ones are cut); the default instruction alone is about 80 body tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import orjson
import pytest
import torch

from qwenbatch import LLM, SamplingParams
from qwenbatch.cli import main
from qwenbatch.config import EngineConfig
from qwenbatch.rerank import DEFAULT_INSTRUCTION, PREFIX, SUFFIX, score_token_ids
from qwenbatch.server.app import ServerSettings
from qwenbatch.serving.protocol import MAX_RERANK_DOCUMENTS
from server_harness import RunningServer

# The model card passes max_length to tokenizer.pad with padding=True, which transformers warns it ignores.
pytestmark = pytest.mark.filterwarnings("ignore:`max_length` is ignored:UserWarning")

KV = 2**24  # 16 MiB: about 10,900 tokens of the tiny model's KV
REFERENCE_TOL = 1e-4  # ours vs transformers: different kernels, padding and RoPE offsets
SAME_TOL = 1e-6  # ours vs ours under another schedule
SERVER_TOL = 1e-5
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ERROR_KEYS = {"message", "type", "param", "code"}
TEXT = (  # the tiny tokenizer's training text: documents of its words tokenize into a few tokens each
    "The quick brown fox jumps over the lazy dog. Python is a programming language. It is widely used for data "
    "science and the web. Batch inference pushes thousands of prompts through one model as fast as possible. "
    "def add(a, b): return a + b 用一句话介绍Python编程语言。 Python是一种高级编程语言。 Emoji 🙂 and symbols # @ / %"
)
WORDS = TEXT.split()
QUERIES = ["what is python", "用一句话介绍Python", "fox"]
DOC_WORDS = [0, 1, 2, 5, 12, 30, 60, 120, 200, 260]  # a few tokens to a few hundred
SHORT = "Rank"  # the schedule tests' instruction: the 126 template tokens are enough work per pair


# -- helpers ----------------------------------------------------------------------------------------


def document(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def documents(count: int, seed: int = 0, longest: int = 200) -> list[str]:
    """``count`` documents: the lengths of DOC_WORDS, then random up to ``longest`` words; the same for one seed."""
    lengths = [
        DOC_WORDS[i] if i < len(DOC_WORDS) else random.Random(seed + i).randint(0, longest) for i in range(count)
    ]
    return [document(n, seed * 1000 + i) for i, n in enumerate(lengths)]


def mixed_pairs(count: int) -> list[tuple[str, str]]:
    """Pairs of three queries (so prefixes are shared) and documents of very different lengths; pair 0 repeats.

    Ten documents of 0 to 260 words, the rest short, to keep the CPU time of the schedule tests small."""
    docs = documents(count - 2, seed=7, longest=12)
    pairs = [(QUERIES[i % len(QUERIES)], d) for i, d in enumerate(docs)]
    return [*pairs[:5], pairs[0], *pairs[5:], pairs[0]]


def body(query: str, doc: str, instruction: str | None = None) -> str:
    return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"


def model_card_scores(
    folder: Path, pairs: list[tuple[str, str]], instruction: str | None = None, max_length: int = 8192
) -> tuple[list[float], list[int]]:
    """The Qwen3-Reranker model card's computation, verbatim; returns P(yes) and the body tokens truncation dropped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    token_false_id = tokenizer.convert_tokens_to_ids("no")
    token_true_id = tokenizer.convert_tokens_to_ids("yes")
    prefix_tokens = tokenizer.encode(PREFIX, add_special_tokens=False)
    suffix_tokens = tokenizer.encode(SUFFIX, add_special_tokens=False)
    texts = [body(q, d, instruction) for q, d in pairs]
    inputs = tokenizer(
        texts,
        padding=False,
        truncation="longest_first",
        return_attention_mask=False,
        max_length=max_length - len(prefix_tokens) - len(suffix_tokens),
    )
    whole = tokenizer(texts, padding=False, return_attention_mask=False)["input_ids"]
    dropped = [len(w) - len(t) for w, t in zip(whole, inputs["input_ids"], strict=True)]
    for i, ele in enumerate(inputs["input_ids"]):
        inputs["input_ids"][i] = prefix_tokens + ele + suffix_tokens
    inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=max_length)
    with torch.no_grad():
        batch_scores = model(**inputs).logits[:, -1, :]
        true_vector = batch_scores[:, token_true_id]
        false_vector = batch_scores[:, token_false_id]
        batch_scores = torch.stack([false_vector, true_vector], dim=1)
        batch_scores = torch.nn.functional.log_softmax(batch_scores, dim=1)
        scores = batch_scores[:, 1].exp().tolist()
    return scores, dropped


def assert_close(got: list[float], want: list[float], tol: float) -> None:
    assert len(got) == len(want)
    worst = max((abs(g - w), i) for i, (g, w) in enumerate(zip(got, want, strict=True)))
    assert worst[0] <= tol, f"pair {worst[1]}: {got[worst[1]]!r} vs {want[worst[1]]!r} (tolerance {tol})"


def reranker(folder: Path, **kwargs) -> LLM:
    return LLM(model=str(folder), dtype="float32", kv_cache_memory=kwargs.pop("kv_cache_memory", KV), **kwargs)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished()


def assert_api_error(response: httpx.Response, param: str | None, *words: str) -> None:
    """A 400 in OpenAI's error shape naming ``param``, its message containing ``words``."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"].lower(), error


# -- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_reranker) -> LLM:
    """The reranker as the server and the CLI build it (float32, 16 MiB of KV, max_model_len 1024)."""
    return reranker(tiny_reranker)


@pytest.fixture(scope="module")
def pairs40() -> list[tuple[str, str]]:
    return mixed_pairs(40)


@pytest.fixture(scope="module")
def alone(tiny_reranker, pairs40) -> list[float]:
    """Each of ``pairs40`` scored by itself, no prefix cache: one forward pass over the whole prompt."""
    solo = reranker(tiny_reranker, enable_prefix_caching=False)
    return [solo.score([pair], SHORT, use_tqdm=False)[0] for pair in pairs40]


@pytest.fixture(scope="module")
def server(tiny_reranker):
    settings = ServerSettings(served_model_names=["reranker"])
    config = EngineConfig(model=str(tiny_reranker), dtype="float32", kv_cache_memory=KV)
    with RunningServer(settings, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# -- 1. the model card's numbers --------------------------------------------------------------------


def test_the_tokenizer_splits_the_template_like_the_model_card(llm, tiny_reranker):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_reranker))
    formatter = llm.engine.inputs.rerank_formatter
    assert formatter.prefix_ids == tokenizer.encode(PREFIX, add_special_tokens=False)
    assert formatter.suffix_ids == tokenizer.encode(SUFFIX, add_special_tokens=False)
    assert (len(formatter.prefix_ids), len(formatter.suffix_ids)) == (108, 18)  # the module docstring's numbers


@pytest.mark.parametrize("instruction", [None, "Rank"], ids=["default-instruction", "short-instruction"])
def test_scores_equal_the_model_card(llm, tiny_reranker, instruction):
    pairs = [(QUERIES[i % 3], d) for i, d in enumerate(documents(len(DOC_WORDS), seed=3))]
    want, dropped = model_card_scores(tiny_reranker, pairs, instruction, max_length=llm.engine.max_model_len)
    assert not any(dropped)
    lengths = [len(llm.engine.inputs.rerank_formatter.build(q, d, instruction).token_ids) for q, d in pairs]
    assert min(lengths) < 230 and max(lengths) > 500  # 126 template tokens + a few to a few hundred, none cut
    assert_close(llm.score(pairs, instruction, use_tqdm=False), want, REFERENCE_TOL)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("max_len", [128, 256])
def test_truncation_equals_the_model_card(tiny_reranker, max_len):
    """Only the body is cut, to max_length - prefix - suffix; truncated_tokens is what the card drops."""
    small = reranker(tiny_reranker, max_model_len=max_len)
    docs = documents(len(DOC_WORDS), seed=5)
    query = QUERIES[0]
    want, dropped = model_card_scores(tiny_reranker, [(query, d) for d in docs], max_length=max_len)
    results = sorted(small.rerank(query, docs, use_tqdm=False), key=lambda r: r.index)
    assert [r.truncated_tokens for r in results] == dropped
    assert_close([r.score for r in results], want, REFERENCE_TOL)
    assert all(dropped) if max_len == 128 else 0 in dropped and max(dropped) > 100
    formatter = small.engine.inputs.rerank_formatter
    assert max(len(formatter.build(query, d).token_ids) for d in docs) == max_len  # a pair fills max_model_len
    assert_all_blocks_free(small)


# -- 2. the schedule never changes a score ----------------------------------------------------------
# Cached and recomputed K/V, chunks and batch neighbours change which kernels and reduction orders compute
# a pair's attention, so bitwise equality is not promised: scores agree within SAME_TOL.


def test_a_batch_of_40_mixed_pairs_equals_each_alone(tiny_reranker, pairs40, alone):
    llm = reranker(tiny_reranker)
    assert_close(llm.score(pairs40, SHORT, use_tqdm=False), alone, SAME_TOL)
    assert_all_blocks_free(llm)


def test_a_cached_prefix_gives_the_same_scores(tiny_reranker, pairs40, alone):
    llm = reranker(tiny_reranker)
    picked = [i for i, (q, _) in enumerate(pairs40) if q == QUERIES[0]]
    pairs = [pairs40[i] for i in picked]
    bm = llm.engine.block_manager
    first = llm.score(pairs, SHORT, use_tqdm=False)
    hits = bm.prefix_cache_hits
    second = llm.score(pairs, SHORT, use_tqdm=False)
    assert bm.prefix_cache_hits > hits
    # The second pass found at least the shared template prefix of every pair in the cache.
    assert bm.prefix_cache_hits - hits >= len(pairs) * (108 // bm.block_size) * bm.block_size
    want = [alone[i] for i in picked]
    assert_close(first, want, SAME_TOL)
    assert_close(second, want, SAME_TOL)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_scoring_hands_its_own_blocks_out_again_before_fresh_ones(tiny_reranker, pairs40, alone, caching):
    """Each block first handed out costs the kernel a page fault and zeroing, so a scoring job reuses its pairs'
    document blocks and touches about a step's worth of the pool, not every pair's; the shared prefixes still hit."""
    llm = reranker(tiny_reranker, max_num_batched_tokens=256, enable_prefix_caching=caching)
    bm = llm.engine.block_manager
    handed_out: set[int] = set()
    most_in_use = 0
    allocate = bm.allocate

    def recording(seq, num_tokens):
        nonlocal most_in_use
        allocate(seq, num_tokens)
        handed_out.update(seq.block_table)
        most_in_use = max(most_in_use, bm.num_blocks - bm.num_free_blocks)

    bm.allocate = recording
    assert_close(llm.score(pairs40, SHORT, use_tqdm=False), alone, SAME_TOL)
    formatter = llm.engine.inputs.rerank_formatter
    needed = sum(-(-len(formatter.build(q, d, SHORT).token_ids) // bm.block_size) for q, d in pairs40)
    assert bm.num_blocks > needed > 4 * most_in_use  # room in the pool for every pair's blocks at once
    # Beyond the blocks of the busiest moment, only the queries' cached prefixes may have used more.
    assert len(handed_out) <= most_in_use + len(QUERIES), (len(handed_out), most_in_use)
    assert (bm.prefix_cache_hits > 0) == caching
    assert_all_blocks_free(llm)


def test_prefix_caching_off_gives_the_same_scores(tiny_reranker, pairs40, alone):
    llm = reranker(tiny_reranker, enable_prefix_caching=False)
    assert_close(llm.score(pairs40, SHORT, use_tqdm=False), alone, SAME_TOL)
    assert llm.engine.block_manager.prefix_cache_hits == 0
    assert_all_blocks_free(llm)


def test_chunked_prefill_gives_the_same_scores(tiny_reranker, pairs40, alone):
    llm = reranker(tiny_reranker, max_num_batched_tokens=64)
    assert_close(llm.score(pairs40, SHORT, use_tqdm=False), alone, SAME_TOL)
    assert_all_blocks_free(llm)


def test_a_small_kv_pool_gives_the_same_scores(tiny_reranker, llm, pairs40, alone):
    """64 blocks (1,024 tokens): pairs wait for room, and sequences get evicted blocks back."""
    from qwenbatch.engine.memory import BLOCK_BOOKKEEPING_BYTES_PER_TOKEN
    from qwenbatch.engine.model_runner import kv_cache_bytes_per_token

    per_token = kv_cache_bytes_per_token(llm.engine.model_config, torch.float32) + BLOCK_BOOKKEEPING_BYTES_PER_TOKEN
    per_block = per_token * llm.config.block_size
    small = reranker(tiny_reranker, kv_cache_memory=64 * per_block)
    assert small.engine.block_manager.num_blocks == 64
    assert_close(small.score(pairs40, SHORT, use_tqdm=False), alone, SAME_TOL)
    assert_all_blocks_free(small)


@pytest.mark.parametrize("budget", [2048, 64], ids=["whole-prefill", "chunked"])
def test_scoring_mixed_with_generation(tiny_reranker, llm, pairs40, alone, budget):
    """Score requests join steps where generation requests prefill and decode; neither changes the other."""
    prompts = ["The quick brown fox", "Python is a programming language.", "用一句话介绍Python编程语言。"]
    gen_alone = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    mixed = reranker(tiny_reranker, max_num_batched_tokens=budget)
    engine = mixed.engine
    formatter = engine.inputs.rerank_formatter
    outputs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"gen-{i}", prompt, GREEDY)
    for _ in range(3):  # the generations are prefilled and decoding when the pairs arrive
        outputs.update({o.request_id: o for o in engine.step()})
    for i, (query, doc) in enumerate(pairs40):
        engine.add(engine.inputs.make_score_request(f"score-{i}", formatter.build(query, doc, SHORT).token_ids))
        if i % 10 == 9:
            outputs.update({o.request_id: o for o in engine.step()})
    engine.add_request("gen-late", prompts[0], GREEDY)  # and one that starts among the pairs
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    assert_close([outputs[f"score-{i}"].score for i in range(len(pairs40))], alone, SAME_TOL)
    assert all(not outputs[f"score-{i}"].outputs for i in range(len(pairs40)))
    assert [outputs[f"gen-{i}"].outputs[0].token_ids for i in range(len(prompts))] == gen_alone
    assert outputs["gen-late"].outputs[0].token_ids == gen_alone[0]
    assert_all_blocks_free(mixed)


# -- 3. LLM.rerank and LLM.score --------------------------------------------------------------------


def test_rerank_sorts_best_first_and_points_at_the_documents(llm):
    docs = documents(8, seed=11)  # 0 to 120 words
    ranked = llm.rerank(QUERIES[0], docs, use_tqdm=False)
    scores = llm.score([(QUERIES[0], d) for d in docs], use_tqdm=False)
    assert sorted(r.index for r in ranked) == list(range(len(docs)))
    assert [r.score for r in ranked] == sorted((r.score for r in ranked), reverse=True)
    for r in ranked:
        assert r.document == docs[r.index]
        assert abs(r.score - scores[r.index]) <= SAME_TOL
        assert r.truncated_tokens == 0
    assert all(0 < s < 1 for s in scores)
    assert len(set(scores)) > 1  # the documents do score differently
    top = llm.rerank(QUERIES[0], docs, top_n=3, use_tqdm=False)
    assert [r.index for r in top] == [r.index for r in ranked[:3]]
    assert len(llm.rerank(QUERIES[0], docs, top_n=100, use_tqdm=False)) == len(docs)


def test_score_returns_input_order(llm, pairs40, alone):
    order = list(range(12))
    random.Random(0).shuffle(order)
    shuffled = llm.score([pairs40[i] for i in order], SHORT, use_tqdm=False)
    assert_close(shuffled, [alone[i] for i in order], SAME_TOL)
    assert all(0 < s < 1 for s in shuffled)


def test_score_takes_a_generator_and_an_instruction(llm):
    pairs = [(QUERIES[1], d) for d in documents(4, seed=2)]
    plain = llm.score(iter(pairs), use_tqdm=False)
    instructed = llm.score(iter(pairs), instruction="Find Chinese text", use_tqdm=False)
    assert len(plain) == len(instructed) == 4
    assert plain != instructed  # the instruction is part of the prompt
    assert llm.rerank(QUERIES[1], [], use_tqdm=False) == []


# -- 4. errors --------------------------------------------------------------------------------------


def test_a_model_without_yes_and_no_tokens_cannot_rerank(tiny_qwen3):
    with pytest.raises(ValueError, match='"yes" and "no"'):
        LLM(model=str(tiny_qwen3), dtype="float32", kv_cache_memory=KV, task="rerank")


def test_a_generation_engine_does_not_score(tiny_reranker):
    llm = reranker(tiny_reranker, task="generate")
    with pytest.raises(ValueError, match="rerank"):
        llm.rerank(QUERIES[0], ["a document"], use_tqdm=False)
    with pytest.raises(ValueError, match="rerank"):
        llm.score([(QUERIES[0], "a document")], use_tqdm=False)
    with pytest.raises(ValueError, match="rerank"):
        llm.engine.inputs.make_score_request("x", [1, 2, 3])
    assert llm.generate("The quick", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_an_empty_query_is_rejected(llm):
    with pytest.raises(ValueError, match="query"):
        llm.rerank("", ["a document"], use_tqdm=False)
    assert_all_blocks_free(llm)


def test_auto_task_reads_the_model_name_not_its_parent_folders():
    """Task "auto" says rerank "for a model whose name says reranker": a parent folder is not the model's name.

    Today config.py's resolved_task tests the whole path, so a plain Qwen3 under a folder called reranker-… is
    built as a reranker (and one whose tokenizer lacks "yes"/"no" fails to load)."""
    assert EngineConfig(model="/models/Qwen3-Reranker-0.6B").resolved_task == "rerank"
    assert EngineConfig(model="Qwen/Qwen3-Reranker-4B").resolved_task == "rerank"
    assert EngineConfig(model="/data/reranker-experiments/Qwen3-0.6B").resolved_task == "generate"


# -- 5. the server ----------------------------------------------------------------------------------


def rerank_body(query: str, docs: list, **fields) -> dict:
    return {"model": "reranker", "query": query, "documents": docs, **fields}


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_server_rerank_equals_llm_rerank(client, llm, path):
    docs = documents(8, seed=21)
    sent = [d if i % 2 else {"text": d} for i, d in enumerate(docs)]  # strings and Jina's objects
    response = client.post(path, json=rerank_body(QUERIES[2], sent, instruction="Rank"))
    assert response.status_code == 200, response.text
    got = response.json()
    assert set(got) == {"id", "model", "usage", "results"}
    assert got["model"] == "reranker"
    formatter = llm.engine.inputs.rerank_formatter
    assert got["usage"]["total_tokens"] == sum(len(formatter.build(QUERIES[2], d, "Rank").token_ids) for d in docs)
    want = llm.rerank(QUERIES[2], docs, instruction="Rank", use_tqdm=False)
    results = got["results"]
    assert [r["index"] for r in results] == [r.index for r in want]
    assert_close([r["relevance_score"] for r in results], [r.score for r in want], SERVER_TOL)
    for r in results:
        assert set(r) == {"index", "document", "relevance_score"}
        assert r["document"] == {"text": docs[r["index"]]}
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)


def test_server_rerank_top_n_and_return_documents(client, llm):
    docs = documents(6, seed=22)
    full = client.post("/v1/rerank", json=rerank_body(QUERIES[0], docs)).json()["results"]
    top = client.post("/v1/rerank", json=rerank_body(QUERIES[0], docs, top_n=2)).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]]
    bare = client.post("/v1/rerank", json=rerank_body(QUERIES[0], docs, top_n=10, return_documents=False))
    assert bare.status_code == 200
    bare = bare.json()["results"]
    assert len(bare) == len(docs)
    assert all("document" not in r for r in bare)
    assert_close([r["relevance_score"] for r in bare], [r["relevance_score"] for r in full], SERVER_TOL)
    no_model = {"query": QUERIES[0], "documents": docs[:2], "use_beam_search": False}  # unknown fields ignored
    assert client.post("/rerank", json=no_model).status_code == 200


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_server_score_one_to_one_and_one_to_many(client, llm, path):
    docs = documents(5, seed=23)
    queries = [QUERIES[i % 3] for i in range(len(docs))]
    want = llm.score(list(zip(queries, docs, strict=True)), use_tqdm=False)
    one = client.post(path, json={"model": "reranker", "text_1": queries, "text_2": docs})
    assert one.status_code == 200, one.text
    got = one.json()
    assert [d["index"] for d in got["data"]] == list(range(len(docs)))
    assert_close([d["score"] for d in got["data"]], want, SERVER_TOL)
    formatter = llm.engine.inputs.rerank_formatter
    total = sum(len(formatter.build(q, d).token_ids) for q, d in zip(queries, docs, strict=True))
    assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] == total

    many = client.post(path, json={"text_1": QUERIES[0], "text_2": docs})
    assert many.status_code == 200, many.text
    want = llm.score([(QUERIES[0], d) for d in docs], use_tqdm=False)
    assert [d["index"] for d in many.json()["data"]] == list(range(len(docs)))
    assert_close([d["score"] for d in many.json()["data"]], want, SERVER_TOL)
    single = client.post(path, json={"text_1": QUERIES[0], "text_2": docs[1]})  # docs[0] is empty
    assert single.status_code == 200, single.text
    assert_close([d["score"] for d in single.json()["data"]], want[1:2], SERVER_TOL)


ERROR_CASES = {
    "empty-documents": ("/v1/rerank", rerank_body(QUERIES[0], []), "documents", ()),
    "empty-query": ("/v1/rerank", rerank_body("", ["a document"]), "query", ()),
    "too-many-documents": ("/rerank", rerank_body(QUERIES[0], ["d"] * (MAX_RERANK_DOCUMENTS + 1)), "documents", ()),
    "zero-top-n": ("/v1/rerank", rerank_body(QUERIES[0], ["d"], top_n=0), "top_n", ()),
    "bad-document": ("/v1/rerank", rerank_body(QUERIES[0], [{"content": "d"}]), "documents.0.text", ("required",)),
    # length-mismatch: server/rerank.py passes "text_1" as APIError's third positional argument, which is ``type``.
    # empty-text-*: the union's branch "constrained-str" is not stripped from the param by app._param_path.
    "length-mismatch": ("/score", {"text_1": ["a", "b"], "text_2": ["x", "y", "z"]}, "text_1", ("2", "3")),
    "empty-text-1": ("/v1/score", {"text_1": "", "text_2": ["x"]}, "text_1", ()),
    "empty-text-2": ("/v1/score", {"text_1": "q", "text_2": []}, "text_2", ()),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_server_errors_are_400_naming_the_field(client, case):
    path, payload, param, words = ERROR_CASES[case]
    assert_api_error(client.post(path, json=payload), param, *words)
    after = client.post("/v1/rerank", json=rerank_body(QUERIES[0], ["still serving"]))
    assert after.status_code == 200, after.text


def test_a_generation_server_answers_rerank_with_400(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        rerank = c.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert_api_error(rerank, "model", "rerank")
        score = c.post("/score", json={"text_1": "q", "text_2": ["d"]})
        assert_api_error(score, "model", "rerank")
        assert c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200


def test_generation_endpoints_still_work_on_the_reranker_server(client, server):
    completion = client.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 3, "ignore_eos": True})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 3
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 3
    engine = server.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# -- 6. run-batch -----------------------------------------------------------------------------------


def test_run_batch_rerank_lines_equal_the_server(client, tiny_reranker, tmp_path):
    jobs = {f"job-{i}": (QUERIES[i % 3], documents(4 + i, seed=30 + i)) for i in range(5)}
    lines = [
        {"custom_id": cid, "method": "POST", "url": "/v1/rerank", "body": {"query": q, "documents": docs}}
        for cid, (q, docs) in jobs.items()
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(orjson.dumps(line).decode() + "\n" for line in lines), encoding="utf-8")
    argv = ["-i", str(inp), "-o", str(out), "--model", str(tiny_reranker), "--dtype", "float32"]
    assert main(["run-batch", *argv, "--kv-cache-memory", "16MiB"]) == 0
    results = {r["custom_id"]: r for r in map(orjson.loads, out.read_bytes().splitlines())}
    assert set(results) == set(jobs)
    for cid, (query, docs) in jobs.items():
        result = results[cid]
        assert result["error"] is None
        assert result["response"]["status_code"] == 200
        got = result["response"]["body"]["results"]
        want = client.post("/v1/rerank", json={"query": query, "documents": docs}).json()["results"]
        assert [r["index"] for r in got] == [r["index"] for r in want]
        assert [r["document"] for r in got] == [r["document"] for r in want]
        assert_close([r["relevance_score"] for r in got], [r["relevance_score"] for r in want], SERVER_TOL)


# -- 7. the CLI -------------------------------------------------------------------------------------


def cli_rerank(capsys, tiny_reranker, path: Path, *extra: str) -> tuple[int, str, str]:
    argv = ["rerank", "--query", QUERIES[0], "--documents", str(path), "--model", str(tiny_reranker)]
    code = main([*argv, "--dtype", "float32", "--kv-cache-memory", "16MiB", *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def docs_file(tmp_path) -> tuple[Path, list[str]]:
    docs = [d.replace("\n", " ") for d in documents(6, seed=40) if d.strip()]
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return path, docs


def test_cli_prints_the_top_n_best_first(capsys, tiny_reranker, llm, docs_file):
    path, docs = docs_file
    code, out, err = cli_rerank(capsys, tiny_reranker, path, "--top-n", "2")
    assert code == 0, err
    want = llm.rerank(QUERIES[0], docs, top_n=2, use_tqdm=False)
    lines = out.splitlines()
    assert len(lines) == 2
    for line, r in zip(lines, want, strict=True):
        score, index, doc = line.split("\t")
        assert (int(index), doc) == (r.index, r.document)
        assert abs(float(score) - r.score) <= 1e-6 + SAME_TOL  # printed with six decimals
    assert float(lines[0].split("\t")[0]) >= float(lines[1].split("\t")[0])


def test_cli_json(capsys, tiny_reranker, llm, docs_file):
    path, docs = docs_file
    code, out, err = cli_rerank(capsys, tiny_reranker, path, "--json")
    assert code == 0, err
    rows = [orjson.loads(line) for line in out.splitlines()]
    want = llm.rerank(QUERIES[0], docs, use_tqdm=False)
    assert [(r["index"], r["document"]) for r in rows] == [(r.index, r.document) for r in want]
    assert_close([r["score"] for r in rows], [r.score for r in want], SAME_TOL)
    assert all(set(r) == {"index", "score", "document"} for r in rows)


def test_cli_empty_documents_file_is_a_one_line_error(capsys, tiny_reranker, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n", encoding="utf-8")
    code, out, err = cli_rerank(capsys, tiny_reranker, path)
    assert code == 2
    assert out == ""
    errors = [line for line in err.splitlines() if line.startswith("qwenbatch: error:")]
    assert len(errors) == 1 and "no documents" in errors[0], err


def test_an_untied_reranker_in_int8_scores_with_its_heads_yes_and_no_rows(tmp_path):
    # int8 leaves the weights it quantizes unread at load; the reranker takes its two LM-head rows before that.
    from safetensors.torch import load_file

    from conftest import make_checkpoint

    folder = make_checkpoint(tmp_path / "tiny-qwen2-reranker", "qwen2", seed=2, extra_tokens=("yes", "no"))
    llm = LLM(model=str(folder), task="rerank", dtype="bfloat16", quantization="int8", kv_cache_memory=8 * 2**20)
    head = load_file(str(folder / "model.safetensors"))["lm_head.weight"]
    want = head[list(score_token_ids(llm.engine.tokenizer))].to(torch.bfloat16).float()
    assert torch.equal(llm.engine.runner.score_weight, want)
