"""bf16 Linear layers on a CPU with AMX, their weights reordered once into oneDNN's blocked layout.

`F.linear` on a bf16 CPU tensor reaches oneDNN's AMX matmul with the weight in its plain [out, in]
layout, and oneDNN reorders it into AMX tiles on every call: for the demo drafter's [16, 256] x
[256, 768] that is about half of the call's 50 µs. `PackedLinear` keeps the weight in the reordered
layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's weight prepacking uses) and calls
the same kernel on it (`torch.ops.mkldnn._linear_pointwise`).

Exactness is checked, not assumed: a layer is swapped only when its packed call returns the same bits
as `F.linear` on probe inputs. Inference only: the packed weight is a copy made at swap time (the plain
one is dropped), has no gradient, and is not saved; the drafter, whose numerics decide only how fast
the output comes (never what it is), is what the engine packs (loading.py).
"""

from __future__ import annotations

import torch
from torch import nn

_PROBE_ROWS = (1, 5, 16)


def can_pack(device: torch.device) -> bool:
    """Whether bf16 matmuls here run on AMX tiles (Sapphire Rapids and later Xeons)."""
    return device.type == "cpu" and torch.cpu._is_amx_tile_supported() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W held in oneDNN's blocked layout; input [..., in_features]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 16)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # Exporters (transformers_format, save_drafter) see an nn.Linear's keys and plain tensors.
        destination[prefix + "weight"] = self.packed_weight.to_dense()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        # A blocked oneDNN tensor has no storage to copy: copy its plain form and reorder that.
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = nn.Parameter(self.packed_weight.to_dense(), requires_grad=False)
        if self.bias is not None:
            plain.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return PackedLinear(plain)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}, packed"


def pack_linear(linear: nn.Module) -> nn.Module:
    """`linear` as a PackedLinear where it is a bf16 nn.Linear on an AMX CPU and packing gives the same
    bits; otherwise `linear` itself."""
    if not (isinstance(linear, nn.Linear) and linear.weight.dtype == torch.bfloat16 and can_pack(linear.weight.device)):
        return linear
    packed = PackedLinear(linear)
    return packed if _same_bits(linear, packed) else linear


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear inside `model` by `pack_linear`'s answer; returns how many were packed."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            packed = pack_linear(child)
            if packed is not child:
                setattr(parent, name, packed)
                swapped += 1
    return swapped


@torch.no_grad()
def _same_bits(linear: nn.Linear, packed: PackedLinear) -> bool:
    gen = torch.Generator().manual_seed(0)
    for rows in _PROBE_ROWS:
        x = torch.randn(rows, linear.in_features, generator=gen).to(linear.weight.dtype)
        if not torch.equal(linear(x), packed(x)):
            return False
    return True
