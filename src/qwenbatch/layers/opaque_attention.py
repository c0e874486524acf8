"""Attention as one opaque operator, so ``torch.compile`` traces a whole step as one graph (``--compile``).

A step's ``AttentionMetadata`` holds Python lists and per-chunk loops that a compiled graph should not
specialise on. The compiled model is therefore handed ``OPAQUE``, whose ``attend`` calls the custom op
``qwenbatch::attend``; the op runs the step's real metadata, which the runner installs around the call with
``step_attention``. The graph sees tensors in and a tensor out, and that the op writes the KV cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from qwenbatch.layers.attention import AttentionMetadata

_current: AttentionMetadata | None = None


@torch.library.custom_op("qwenbatch::attend", mutates_args=("kv_cache",))
def attend_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """``AttentionMetadata.attend`` of the step installed by ``step_attention``."""
    if _current is None:
        raise RuntimeError("qwenbatch::attend called outside step_attention")
    return _current.attend(q, k, v, kv_cache, scale)


@attend_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class OpaqueAttention(AttentionMetadata):
    """What the compiled model is given as its metadata: attention through ``qwenbatch::attend``."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return attend_op(q, k, v, kv_cache, scale)


OPAQUE = OpaqueAttention()


@contextmanager
def step_attention(meta: AttentionMetadata) -> Iterator[OpaqueAttention]:
    """Install ``meta`` as the step's attention for ``qwenbatch::attend``; yields ``OPAQUE``."""
    global _current
    _current = meta
    try:
        yield OPAQUE
    finally:
        _current = None
