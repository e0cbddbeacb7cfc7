"""RMSNorm modules of a loaded model run as one `F.rms_norm` call where that gives the very same bits.

transformers' Llama-family RMSNorm (Llama, Qwen2, Qwen3, Mistral and the drafter's layers, which reuse
Qwen3's) is eight operators: upcast, pow, mean, add, rsqrt, mul, downcast, mul by the weight. On a CPU
each costs its dispatch, and a step of the demo target runs 25 of them: 17% of a decode step. One
`F.rms_norm` per module does the same arithmetic in one call.

Exactness is checked, not assumed: each module is swapped only when its fused form returns identical
bits to its own forward on probe inputs of its width and device. Only float32 norms are candidates: in
bf16 transformers rounds twice (the normalised value, then its product with the weight), and probes of
a few rows cannot show that a once-rounding kernel always agrees (at width 256 they showed it does
not). Any other kind (Gemma's `1 + weight`, a kernel whose reduction order differs) keeps its forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PROBE_ROWS = (1, 3, 16)


class FusedRMSNorm(nn.Module):
    """An RMSNorm as one `F.rms_norm` call. It holds the replaced module's own weight Parameter, so
    state_dict keys, tied or shared weights and `copy.deepcopy` behave as they did."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden, (self.weight.shape[0],), self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


def fuse_rms_norms(model: nn.Module) -> int:
    """Replace every RMSNorm of `model` whose fused form is bit-identical by a `FusedRMSNorm` over the
    same weight (inference only). Returns how many were replaced."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if _is_llama_rms_norm(child)]
    swapped = 0
    for parent, name, child in swaps:
        fused = FusedRMSNorm(child.weight, child.variance_epsilon)
        if _same_bits(child, fused):
            setattr(parent, name, fused)
            swapped += 1
    return swapped


def _is_llama_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, FusedRMSNorm)
            and isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.dtype == torch.float32
            and isinstance(getattr(module, "variance_epsilon", None), float)
            and "forward" not in vars(module) and len(list(module.parameters())) == 1)


@torch.no_grad()
def _same_bits(module: nn.Module, fused: nn.Module) -> bool:
    weight = module.weight
    gen = torch.Generator().manual_seed(0)
    for rows in _PROBE_ROWS:
        for scale in (1.0, 30.0):
            x = (torch.randn(rows, weight.shape[0], generator=gen) * scale).to(weight.device, weight.dtype)
            if not torch.equal(module(x), fused(x)):
                return False
    return True
