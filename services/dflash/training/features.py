"""Target features for training: computed online by the frozen target, or cached to disk once (offline).

Features are the outputs of the target's decoder layers `layer_ids`, concatenated per token
([B, S, n*H]); the output of decoder layer i is `hidden_states[i + 1]` (index 0 is the embedding).
With distillation the final hidden state (after the target's last norm) comes too, so the trainer
can apply the target's lm_head only at the positions it needs instead of over the whole sequence.

Offline cache layout (directory): `meta.json` (layer ids, sample ids, shard size) and shards
`shard-00000.safetensors` holding `{sample index}.features` / `{sample index}.last_hidden`. Shards are
written whole and atomically, so an interrupted caching run resumes at the first missing shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import DFlashError
from .data import Batch, Sample, collate

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SHARD_SIZE = 64


@dataclass(frozen=True)
class TargetFeatures:
    """features: [B, S, n*H]; last_hidden: [B, S, H] or None (only needed for distillation)."""

    features: torch.Tensor
    last_hidden: torch.Tensor | None


class FeatureSource(Protocol):
    """Where the trainer gets target features for a batch."""

    def __call__(self, batch: Batch) -> TargetFeatures:
        """Features for `batch` (on the training device); padded positions hold anything."""
        ...


def select_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """Concatenate the outputs of decoder layers `layer_ids` (hidden_states[i + 1])."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class OnlineFeatures:
    """Runs the frozen target on every batch, under no_grad.

    Without distillation the target stops after the deepest selected layer (the layers above it would
    be wasted work); hooks read the layer outputs, which equal hidden_states[i + 1] for every layer
    but the last (whose hidden_states entry is taken after the final norm), so the last layer, or a
    model without a `layers` list, takes the full output_hidden_states path.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: tuple[int, ...], with_last_hidden: bool) -> None:
        self.decoder = model.get_decoder()
        self.layer_ids = tuple(layer_ids)
        self.with_last_hidden = with_last_hidden
        self.device = model.device
        layers = getattr(self.decoder, "layers", None)
        self.early_exit = (
            not with_last_hidden and isinstance(layers, torch.nn.ModuleList) and max(layer_ids) < len(layers) - 1
        )

    @torch.no_grad()
    def __call__(self, batch: Batch) -> TargetFeatures:
        inputs = dict(input_ids=batch.input_ids.to(self.device), attention_mask=batch.attention_mask.to(self.device),
                      use_cache=False)
        if self.early_exit:
            return TargetFeatures(self._run_until_last_selected(inputs), None)
        out = self.decoder(**inputs, output_hidden_states=True)
        last = out.last_hidden_state if self.with_last_hidden else None
        return TargetFeatures(select_features(out.hidden_states, self.layer_ids), last)

    def _run_until_last_selected(self, inputs: dict) -> torch.Tensor:
        captured: dict[int, torch.Tensor] = {}
        deepest = max(self.layer_ids)

        def hook(index: int) -> Callable[[torch.nn.Module, tuple, torch.Tensor | tuple], None]:
            def read(module: torch.nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
                captured[index] = output[0] if isinstance(output, tuple) else output
                if index == deepest:
                    raise _StopForward

            return read

        handles = [self.decoder.layers[i].register_forward_hook(hook(i)) for i in set(self.layer_ids)]
        try:
            self.decoder(**inputs)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1)


class _StopForward(Exception):
    """Raised from the deepest selected layer's hook: the rest of the target's forward is not needed."""


class CachedFeatures:
    """Reads features written by `cache_features`; rows are padded to the batch length with zeros."""

    def __init__(self, directory: str | Path, device: torch.device) -> None:
        self.directory = Path(directory)
        self.meta = json.loads((self.directory / "meta.json").read_text())
        self.shard_size = self.meta["shard_size"]
        self.device = device

    def __call__(self, batch: Batch) -> TargetFeatures:
        length = batch.input_ids.shape[1]
        feats, lasts = [], []
        for index in batch.indices:
            with safe_open(str(self._shard(index // self.shard_size)), framework="pt") as f:
                feats.append(_pad(f.get_tensor(f"{index}.features"), length))
                if f"{index}.last_hidden" in f.keys():
                    lasts.append(_pad(f.get_tensor(f"{index}.last_hidden"), length))
        last = torch.stack(lasts).to(self.device) if lasts else None
        return TargetFeatures(torch.stack(feats).to(self.device), last)

    def _shard(self, number: int) -> Path:
        return self.directory / f"shard-{number:05d}.safetensors"


def cache_features(
    model: PreTrainedModel,
    samples: list[Sample],
    directory: str | Path,
    layer_ids: tuple[int, ...],
    *,
    with_last_hidden: bool,
    batch_size: int,
    pad_id: int,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Compute and store features for every sample (resumable: complete shards are kept)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {
        "layer_ids": list(layer_ids),
        "with_last_hidden": with_last_hidden,
        "shard_size": SHARD_SIZE,
        "sample_ids": [s.id for s in samples],
        "num_tokens": [len(s.input_ids) for s in samples],
    }
    meta_path = directory / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
        raise DFlashError(
            f"feature cache '{directory}' was written for other data, layers or settings; delete it to rebuild"
        )
    meta_path.write_text(json.dumps(meta))
    source = OnlineFeatures(model, layer_ids, with_last_hidden)
    num_shards = -(-len(samples) // SHARD_SIZE)
    for shard in tqdm(range(num_shards), desc="caching target features", unit="shard"):
        path = directory / f"shard-{shard:05d}.safetensors"
        if path.is_file():
            continue
        tensors = {}
        indices = list(range(shard * SHARD_SIZE, min(len(samples), (shard + 1) * SHARD_SIZE)))
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            out = source(collate([samples[i] for i in chunk], chunk, pad_id))
            for row, index in enumerate(chunk):
                n = len(samples[index].input_ids)
                tensors[f"{index}.features"] = out.features[row, :n].to("cpu", dtype).contiguous()
                if out.last_hidden is not None:
                    tensors[f"{index}.last_hidden"] = out.last_hidden[row, :n].to("cpu", dtype).contiguous()
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    return directory


def _pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    if tensor.shape[0] == length:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((length - tensor.shape[0], *tensor.shape[1:]))])
