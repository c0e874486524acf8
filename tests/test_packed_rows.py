"""oneDNN-packed linears run the row counts timed at load as single-threaded in pieces (layers/packed_rows.py), with
the whole product's values, and a bf16 engine records the choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qwenbatch import LLM, SamplingParams
from qwenbatch.layers import packed_rows
from qwenbatch.layers.linear import PIECE_ROWS, PackedLinear, onednn_available, row_bucket
from qwenbatch.layers.packed_rows import RowPiecesChoice, ShapeTiming, choose_row_pieces

BF16_PACKED = onednn_available(torch.bfloat16, torch.device("cpu"))


def packed(k: int, n: int, dtype: torch.dtype, bias: bool = True) -> PackedLinear:
    torch.manual_seed(k + n)
    return PackedLinear(nn.Linear(k, n, bias=bias).to(dtype))


def test_pieces_give_the_whole_product():
    """float32 rows are bitwise independent of the batch in oneDNN, so pieces equal the whole exactly; in bf16 the
    sums may be blocked otherwise, within a rounding."""
    linear = packed(96, 80, torch.float32)
    x = torch.randn(1000, 96)
    assert torch.equal(linear.pieces_forward(x), linear.whole_forward(x))
    if BF16_PACKED:
        linear = packed(96, 80, torch.bfloat16)
        xb = x.bfloat16()
        torch.testing.assert_close(linear.pieces_forward(xb), linear.whole_forward(xb))


@pytest.mark.parametrize(
    ("rows", "calls"),
    [(700, 2), (900, 1), (600, 1), (1100, 1), (1300, 4)],  # buckets 768 (split), 1024, 512, 1024, 1280 (split)
)
def test_only_the_chosen_buckets_run_in_pieces_of_at_most_piece_rows(monkeypatch, rows, calls):
    linear = packed(32, 24, torch.float32)
    linear.pieces_at = frozenset({768, 1280})
    seen: list[int] = []
    whole = linear.whole_forward
    monkeypatch.setattr(linear, "whole_forward", lambda x: seen.append(x.shape[:-1].numel()) or whole(x))
    x = torch.randn(rows, 32)
    out = linear(x)
    assert len(seen) == calls and sum(seen) == rows
    assert max(seen) <= PIECE_ROWS if calls > 1 else seen == [rows]
    assert torch.equal(out, whole(x))
    seen.clear()
    linear(x.view(1, rows, 32))  # 3-D x: left whole
    assert seen == [rows]


def test_row_buckets_are_the_nearest_multiples_of_256():
    assert [row_bucket(r) for r in (1, 127, 129, 640, 641, 895, 897, 1407, 1409)] == [
        0, 0, 256, 512, 768, 768, 1024, 1280, 1536,
    ]  # fmt: skip


def test_a_shape_is_split_only_where_its_pieces_were_clearly_faster():
    choice = RowPiecesChoice(
        (
            ShapeTiming(896, 896, 768, whole_ms=1.0, pieces_ms=0.6),
            ShapeTiming(896, 896, 1024, whole_ms=1.0, pieces_ms=0.85),  # within the margin: left whole
            ShapeTiming(4864, 896, 1024, whole_ms=7.0, pieces_ms=4.2),
        )
    )
    assert choice.split_rows(896, 896) == {768}
    assert choice.split_rows(4864, 896) == {1024}
    assert choice.split_rows(896, 9728) == frozenset()
    assert choice.describe().startswith(f"rows in pieces of {PIECE_ROWS}: 896x896 at 768 rows")
    assert "4864x896 at 1024 rows" in choice.describe() and "896x896 at 768, 1024" not in choice.describe()
    assert RowPiecesChoice().describe() == "no rows in pieces"


@pytest.mark.skipif(not BF16_PACKED, reason="oneDNN packs bf16 only where the CPU multiplies bf16 natively")
def test_each_bf16_shape_is_timed_once_at_every_row_count():
    linears = [packed(64, 48, torch.bfloat16), packed(64, 48, torch.bfloat16), packed(48, 64, torch.bfloat16)]
    linears.append(packed(64, 48, torch.float32))  # not bf16: not timed
    choice = choose_row_pieces(linears, rows=(256, 512), repeats=1)
    assert sorted((t.in_features, t.out_features, t.rows) for t in choice.timings) == [
        (48, 64, 256), (48, 64, 512), (64, 48, 256), (64, 48, 512),
    ]  # fmt: skip
    assert all(t.whole_ms > 0 and t.pieces_ms > 0 for t in choice.timings)


def test_a_bf16_engine_times_its_linears_and_records_the_choice(tiny_qwen3):
    llm = LLM(model=str(tiny_qwen3), dtype="bfloat16", kv_cache_memory=8 * 2**20)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not BF16_PACKED:  # bf16 stays with PyTorch's linears on this CPU: nothing to time
        assert not linears and "pieces" not in llm.engine.runner.linear_kernels
        return
    assert model.lm_head.pieces_at == frozenset()  # never a chunk's rows
    prefill = packed_rows.prefill_linears(model)
    assert prefill and model.lm_head not in prefill
    described = llm.engine.runner.linear_kernels
    assert "rows in pieces of" in described or "no rows in pieces" in described
    for linear in prefill:
        split = f"{linear.in_features}x{linear.out_features} at" in described
        assert bool(linear.pieces_at) == split
    out = llm.generate([[5, 9, 14, 3] * 200], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_apply_gives_each_linear_its_shape_s_buckets():
    linears = [packed(896, 896, torch.float32, bias=False), packed(64, 48, torch.float32, bias=False)]
    packed_rows.apply(linears, RowPiecesChoice((ShapeTiming(896, 896, 768, whole_ms=1.0, pieces_ms=0.5),)))
    assert [linear.pieces_at for linear in linears] == [frozenset({768}), frozenset()]
