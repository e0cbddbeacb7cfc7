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

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_PROBE_ROWS = (1, 3, 16)


def fuse_rms_norms(model: nn.Module) -> int:
    """Swap every RMSNorm of `model` whose fused form is bit-identical (inference only; the swap is
    per instance and keeps the weights). Returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if _is_llama_rms_norm(module) and _same_bits(module, _fused_forward(module)):
            module.forward = _fused_forward(module)
            swapped += 1
    return swapped


def _is_llama_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and weight.dtype == torch.float32
            and isinstance(getattr(module, "variance_epsilon", None), float)
            and "forward" not in vars(module) and len(list(module.parameters())) == 1)


def _fused_forward(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    weight, eps, shape = module.weight, module.variance_epsilon, (module.weight.shape[0],)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden, shape, weight, eps)

    return forward


@torch.no_grad()
def _same_bits(module: nn.Module, fused: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    weight = module.weight
    gen = torch.Generator().manual_seed(0)
    for rows in _PROBE_ROWS:
        for scale in (1.0, 30.0):
            x = (torch.randn(rows, weight.shape[0], generator=gen) * scale).to(weight.device, weight.dtype)
            if not torch.equal(module(x), fused(x)):
                return False
    return True
