"""The target's input embedding and LM head, read alone from its checkpoint.

A drafter replica needs only these two matrices of the target (the DFlash drafter embeds its block
with the first and turns its hidden states into tokens with the second), so it reads just their
tensors from the safetensors files instead of loading every decoder layer. Tensor names come from the
model itself: the architecture is built from its config on the meta device (no memory) and asked
for `get_input_embeddings()` / `get_output_embeddings()`. Tied heads share one tensor, as in the
full model. Checkpoints that are not safetensors, architectures that cannot be built on the meta
device, and heads that are not a plain nn.Embedding and nn.Linear (e.g. a scaled embedding) are
loaded the old way, the full model, and the log says why.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .drafter.checkpoint import resolve_dir
from .errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass
class TargetHeads:
    """config: the target's transformers config; embed_tokens: [V, H]; lm_head: H -> V (tied: same weight)."""

    config: object
    embed_tokens: nn.Module
    lm_head: nn.Module


def load_target_heads(path_or_id: str | Path, device: torch.device, dtype: torch.dtype | str) -> TargetHeads:
    """The target's embedding and LM head on `device` in `dtype` ("auto": the checkpoint's own dtype)."""
    from transformers import AutoConfig

    directory = resolve_dir(path_or_id, "target")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"target directory '{directory}' has no config.json")
    config = AutoConfig.from_pretrained(str(directory))
    skeleton, reason = _meta_model(config)
    reason = reason or _why_not_heads_only(directory, skeleton)
    if reason:
        log.warning("target %s: loading the full model for its embedding and LM head: %s", directory, reason)
        return _from_full_model(directory, device, dtype)
    return TargetHeads(config, *_read_heads(directory, skeleton, device, dtype))


def _meta_model(config: PretrainedConfig) -> tuple[PreTrainedModel | None, str]:
    """(the architecture on the meta device, "") or (None, why it cannot be built there)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config), ""
    except Exception as exc:  # an architecture whose __init__ needs real tensors, or no causal-LM class
        return None, f"it cannot be built on the meta device ({type(exc).__name__}: {exc})"


def _why_not_heads_only(directory: Path, skeleton: PreTrainedModel) -> str:
    if not (directory / SINGLE).is_file() and not (directory / INDEX).is_file():
        return f"it has neither {SINGLE} nor {INDEX} (not a safetensors checkpoint)"
    # Subclasses may change the forward (Gemma scales its embedding); only the full model has that right.
    embed, head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    if type(embed) is not nn.Embedding:
        return f"its input embedding is a {type(embed).__name__}, not a plain nn.Embedding"
    if type(head) is not nn.Linear:
        return f"its output embedding is a {type(head).__name__}, not a plain nn.Linear"
    return ""


def _read_heads(
    directory: Path, skeleton: PreTrainedModel, device: torch.device, dtype: torch.dtype | str
) -> tuple[nn.Embedding, nn.Linear]:
    """(nn.Embedding, nn.Linear) filled from the checkpoint's tensors of the skeleton's two heads."""
    embed, head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    names = {id(module): name for name, module in skeleton.named_modules()}
    tensors = _TensorFiles(directory, skeleton.base_model_prefix)

    def parameter(name: str, what: str, like: torch.Tensor) -> nn.Parameter:
        tensor = tensors.read(name, what, tuple(like.shape))
        return nn.Parameter(tensor.to(device=device, dtype=tensor.dtype if dtype == "auto" else dtype),
                            requires_grad=False)

    embed_tokens = nn.Embedding(*embed.weight.shape, padding_idx=embed.padding_idx, device="meta")
    embed_tokens.weight = parameter(f"{names[id(embed)]}.weight", "input embedding", embed.weight)
    lm_head = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device="meta")
    if head.weight is embed.weight:  # tied: the checkpoint holds the matrix once
        lm_head.weight = embed_tokens.weight
    else:
        lm_head.weight = parameter(f"{names[id(head)]}.weight", "output embedding (LM head)", head.weight)
    if head.bias is not None:
        lm_head.bias = parameter(f"{names[id(head)]}.bias", "LM head bias", head.bias)
    return embed_tokens.eval(), lm_head.eval()


def _from_full_model(directory: Path, device: torch.device, dtype: torch.dtype | str) -> TargetHeads:
    from .loading import load_target

    model, _ = load_target(directory, device, dtype)
    return TargetHeads(model.config, model.get_input_embeddings(), model.get_output_embeddings())


class _TensorFiles:
    """Where each tensor of a (possibly sharded) safetensors checkpoint lives."""

    def __init__(self, directory: Path, prefix: str) -> None:
        self.prefix = prefix
        index = directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from None
            self.files = {name: directory / file for name, file in weight_map.items()}
            self.listing = index
        else:
            self.files, self.listing = None, directory / SINGLE

    def read(self, name: str, what: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name` (or `name` without the base-model prefix), checked against `shape`."""
        from safetensors import SafetensorError, safe_open

        for key in _candidates(name, self.prefix):
            file = self.listing if self.files is None else self.files.get(key)
            if file is None:
                continue
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    if key not in f.keys():
                        if self.files is None:
                            continue
                        raise CheckpointError(f"{file}: has no tensor {key!r} (the target's {what}), "
                                              f"though {self.listing.name} says it is there")
                    tensor = f.get_tensor(key)
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{file} is not a readable safetensors file ({exc}); download it again") from None
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"{file}: tensor {key!r} (the target's {what}) has shape "
                                      f"{tuple(tensor.shape)}, config.json implies {shape}")
            return tensor
        raise CheckpointError(f"{self.listing}: has no tensor {name!r} (the target's {what})")


def _candidates(name: str, prefix: str) -> list[str]:
    """Checkpoints saved from the base model (AutoModel) name its tensors without the prefix."""
    if prefix and name.startswith(f"{prefix}."):
        return [name, name[len(prefix) + 1:]]
    return [name]
