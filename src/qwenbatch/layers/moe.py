"""The mixture-of-experts parts of Qwen2-MoE and Qwen3-MoE: a top-k router, and the experts' SwiGLUs run as two
grouped matmuls over the tokens sorted by expert.

The grouped matmuls (``torch._grouped_mm``) take each expert's rows as one group whose bounds live in a tensor, so
a step needs no per-expert Python loop and no host sync on the routing, and is the same code on the CPU (a C++
loop of matmuls) and on CUDA: one kernel in bf16 on compute capability 9.x and 10.x, which a CUDA graph can capture;
other dtypes and GPUs take torch's fallback, which reads the group ends on the host (``grouped_mm_capturable``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwenbatch.layers.activation import SiluAndMul


def grouped_mm_capturable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's grouped matmul runs as one CUDA kernel (which a CUDA graph can capture) on ``device``."""
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


class TopKRouter(nn.Module):
    """Scores every expert for each token and keeps the ``top_k`` best: softmax in float32 over the router's logits,
    the chosen weights renormalised to sum to 1 where ``renormalise`` (Qwen3-MoE) and then cast to the hidden
    states' dtype, as transformers does. Its weight is a plain parameter, not an ``nn.Linear``, so that no
    load-time pass quantizes or repacks it: the choice of experts must not move with the linears' rounding."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalise: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.renormalise = renormalise

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, top_k] in ``x``'s dtype, expert ids [tokens, top_k]) for ``x`` [tokens, hidden]."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU MLPs stored stacked, as transformers 5 holds them: ``gate_up_proj`` [experts, 2 x
    intermediate, hidden] (each expert's gate rows, then its up rows) and ``down_proj`` [experts, hidden,
    intermediate]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ over each token's chosen experts of weight × expert(x): ``x`` [tokens, hidden], ``weights`` and
        ``experts`` [tokens, top_k] from the router. Each token's terms are added in the order of their expert ids,
        as transformers adds them."""
        top_k = experts.shape[1]
        chosen = experts.reshape(-1)
        order = chosen.argsort(stable=True)  # (token, choice) pairs grouped by expert
        per_expert = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        per_expert.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.int32))
        group_ends = per_expert.cumsum(0, dtype=torch.int32)
        token = order // top_k
        h = torch._grouped_mm(x[token], self.gate_up_proj.transpose(1, 2), offs=group_ends)
        out = torch._grouped_mm(self.act_fn(h), self.down_proj.transpose(1, 2), offs=group_ends)
        out = out * weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token, out)


def run_experts_eagerly(model: nn.Module) -> None:
    """Keep ``torch.compile`` out of each GroupedExperts in ``model``, called before compiling it: inductor has no
    lowering of the grouped matmul but a fake one that allows bf16 alone, so a compiled model runs its experts
    eagerly between its graphs. (Not a decorator on ``forward``: that imports torch._dynamo, ~2.4 s of every
    start, when the module is imported.)"""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.forward = torch.compiler.disable(module.forward)
