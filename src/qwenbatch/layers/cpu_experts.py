"""A mixture of experts on the CPU, each expert's SwiGLU run on the rows routed to it with its weights prepared
once at load: oneDNN's packed layout (``PackedExperts``), or int8 (``Int8Experts``, ``--quantization int8``).

A decode step of a mixture-of-experts model reads the weights of every expert some token chose, a few rows each:
it is bound by those bytes, as a dense model's batch-1 step is by all of them. Packed, decode steps ran ~10-15%
faster than the grouped matmul's on the AMX kind (prefill chunks 5-10% slower: decode steps are most of a
generation job); int8 holds the weights in about half the bytes (BENCHMARKS.md, "Qwen3-MoE").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qwenbatch.layers.int8_linear import GROUP_SIZE, Int8Linear
from qwenbatch.layers.moe import GroupedExperts


class _ExpertByExpert(nn.Module):
    """GroupedExperts' forward as a loop over the experts some token chose; ``expert(e, rows)`` is one's SwiGLU."""

    num_experts: int

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ over each token's chosen experts of weight × expert(x), each token's terms in the order of their ids."""
        top_k = experts.shape[1]
        chosen = experts.reshape(-1)
        order = chosen.argsort(stable=True)
        ends = torch.bincount(chosen, minlength=self.num_experts).cumsum(0).tolist()
        token = order // top_k
        rows = x[token]
        out = torch.empty_like(rows)
        start = 0
        for e, end in enumerate(ends):
            if end > start:
                out[start:end] = self.expert(e, rows[start:end])
            start = end
        out *= weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token, out)


class PackedExperts(_ExpertByExpert):
    """Each expert's gate_up and down in oneDNN's packed layout (as PackedLinear holds a dense linear's), the
    SiLU(gate) * up between them by the experts' own ``act_fn``."""

    def __init__(self, experts: GroupedExperts) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.weight_bytes = experts.gate_up_proj.nbytes + experts.down_proj.nbytes  # as oneDNN packs them: the same
        self.act_fn = experts.act_fn
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.gate_up = [reorder(experts.gate_up_proj[e].detach(), None) for e in range(self.num_experts)]
        self.down = [reorder(experts.down_proj[e].detach(), None) for e in range(self.num_experts)]

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise
        h = self.act_fn(linear(rows, self.gate_up[e], None, "none", [], ""))
        return linear(h, self.down[e], None, "none", [], "")


class Int8Experts(_ExpertByExpert):
    """Each expert's gate_up (with its SiLU(gate) * up) and down an Int8Linear, quantized per group of 32 from
    ``read_expert(e)``'s (gate_up, down) weights: as the checkpoint holds them (the loader leaves the stacks unread
    then), or by default the stacks as loaded."""

    def __init__(
        self,
        experts: GroupedExperts,
        five_bit: bool,
        read_expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        hidden, inter2 = experts.gate_up_proj.shape[2], experts.gate_up_proj.shape[1]
        if read_expert is None:
            read_expert = lambda e: (experts.gate_up_proj[e].detach(), experts.down_proj[e].detach())  # noqa: E731
        self.gate_up = nn.ModuleList()
        self.down = nn.ModuleList()
        for e in range(self.num_experts):
            gate_up, down = read_expert(e)
            self.gate_up.append(
                Int8Linear(_shape(hidden, inter2), five_bit, lambda a, b, w=gate_up: w[a:b], silu_and_mul=True)
            )
            self.down.append(Int8Linear(_shape(inter2 // 2, hidden), five_bit, lambda a, b, w=down: w[a:b]))

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return self.down[e](self.gate_up[e](rows))


def int8_experts_supported(experts: GroupedExperts) -> bool:
    """Whether the int8 kernel takes the experts' shapes: both products' inputs a multiple of 32 (every Qwen MoE's
    are); others stay as loaded."""
    inter2, hidden = experts.gate_up_proj.shape[1:]
    return hidden % GROUP_SIZE == 0 and (inter2 // 2) % GROUP_SIZE == 0


def _shape(in_features: int, out_features: int) -> nn.Linear:
    """A linear of that shape holding no weights (Int8Linear reads its rows through ``read_rows``)."""
    return nn.Linear(in_features, out_features, bias=False, device="meta")


def replace_experts(model: nn.Module, make: Callable[[str, GroupedExperts], nn.Module]) -> int:
    """Replace every GroupedExperts of ``model`` by ``make(its name, it)``, freeing the stacked weights as each
    goes; returns how many."""
    names = [name for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(name, getattr(parent, child)))
    return len(names)
