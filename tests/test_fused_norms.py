"""RMSNorms swapped for one F.rms_norm call only where that gives the same bits (fused_norms.py)."""

from __future__ import annotations

import copy

import torch
from dflash.fused_norms import FusedRMSNorm, fuse_rms_norms
from dflash.loading import prepare_for_inference
from tiny import tiny_drafter, tiny_target
from torch import nn


def test_a_float32_target_and_drafter_get_every_norm_fused_with_unchanged_outputs():
    target = tiny_target("qwen3", layers=3)
    ids = torch.randint(0, 60, (2, 21))
    with torch.no_grad():
        before = target(ids).logits
    norms = [m for m in target.modules() if type(m).__name__.endswith("RMSNorm")]
    assert fuse_rms_norms(target) == len(norms) == 3 * 4 + 1  # input, post-attention, q and k per layer; final
    with torch.no_grad():
        assert torch.equal(target(ids).logits, before)
    drafter = tiny_drafter(target, num_layers=2)
    assert fuse_rms_norms(drafter) == sum(type(m).__name__.endswith("RMSNorm") for m in drafter.modules())
    assert fuse_rms_norms(drafter) == 0  # already swapped: nothing is swapped twice


def test_llama_norms_are_fused_too_and_prepare_for_inference_keeps_outputs():
    target = tiny_target("llama", layers=2)
    ids = torch.randint(0, 60, (1, 17))
    with torch.no_grad():
        before = target(ids).logits
        prepare_for_inference(target)
        assert torch.equal(target(ids).logits, before)
    norms = [m for m in target.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(isinstance(m, FusedRMSNorm) for m in norms)


def test_a_fused_model_keeps_its_state_dict_and_its_deepcopy_uses_its_own_weights():
    target = tiny_target("qwen3", layers=2)
    keys = list(target.state_dict())
    fuse_rms_norms(target)
    assert list(target.state_dict()) == keys
    ids = torch.randint(0, 60, (1, 9))
    copied = copy.deepcopy(target)
    with torch.no_grad():
        before = target(ids).logits
        copied.model.norm.weight.mul_(2.0)
        assert not torch.equal(copied(ids).logits, before)  # the copy computes with its own weight
        assert torch.equal(target(ids).logits, before)  # and the original is untouched


def test_norms_whose_fused_form_differs_keep_their_own_forward():
    class GemmaLikeRMSNorm(nn.Module):  # scales by 1 + weight: same attributes, other arithmetic
        def __init__(self, width: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(width))
            self.variance_epsilon = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return x * (1.0 + self.weight)

    model = nn.Sequential(GemmaLikeRMSNorm(32))
    assert fuse_rms_norms(model) == 0
    assert not isinstance(model[0], FusedRMSNorm)
    # transformers rounds bf16 twice (the normalised value, then the product with the weight), one
    # fused call once: a bf16 model keeps its norms as they are.
    bf16 = tiny_target("qwen3", layers=1).to(torch.bfloat16)
    assert fuse_rms_norms(bf16) == 0
