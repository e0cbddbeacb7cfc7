"""Reading and writing drafters in the public DFlash checkpoint format, and checking them against a target.

A drafter directory holds `config.json` (see config.py) and `model.safetensors` with unprefixed tensor
names and no embedding or LM head. Loading accepts a local directory or a Hugging Face hub id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError, IncompatibleDrafterError
from .config import DFlashConfig
from .model import DFlashDraftModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

WEIGHTS = "model.safetensors"
# Buffers some exporters write; they are recomputed from the config, never trained.
_IGNORED_KEYS = ("rotary_emb.inv_freq",)


def resolve_dir(path_or_id: str | Path, what: str) -> Path:
    """A local directory as is; anything else is treated as a hub id and downloaded (config + safetensors)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{what} '{path_or_id}' is a file; pass the directory that holds config.json")
    text = str(path_or_id)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"{what} directory '{path_or_id}' does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # the hub client raises many types; all mean "could not fetch"
        raise CheckpointError(
            f"{what} '{text}' is not a local directory and could not be downloaded from the hub "
            f"({type(exc).__name__}: {exc}). Download it elsewhere and pass the directory."
        ) from None


def read_config_json(directory: Path, what: str = "drafter directory") -> tuple[dict, Path]:
    """A checkpoint directory's config.json as a dict, and its path; CheckpointError naming the file."""
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{what} '{directory}' has no config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw, path


def load_config(directory: Path) -> DFlashConfig:
    raw, path = read_config_json(directory)
    return DFlashConfig.from_dict(raw, source=str(path))


def load_drafter(
    path_or_id: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> DFlashDraftModel:
    """Load a drafter; every missing, unexpected or misshapen tensor is named in the error."""
    directory = resolve_dir(path_or_id, "drafter")
    config = load_config(directory)
    state = read_weights(directory)
    model = DFlashDraftModel(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - set(_IGNORED_KEYS))
    if missing or unexpected:
        raise CheckpointError(
            f"drafter '{directory}': tensor names do not match the DFlash format "
            f"(missing: {missing[:6]}{'...' if len(missing) > 6 else ''}; "
            f"unexpected: {unexpected[:6]}{'...' if len(unexpected) > 6 else ''})"
        )
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"drafter '{directory}': tensor {name} has shape {tuple(state[name].shape)}, "
                f"config.json implies {tuple(tensor.shape)}"
            )
    model.load_state_dict({k: v for k, v in state.items() if k in expected})
    if dtype is None:
        dtype = next(iter(state.values())).dtype
    return model.to(device=device, dtype=dtype).eval()


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"drafter directory '{directory}' has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file} is not a readable safetensors file ({exc}); download it again") from None
    return state


def save_drafter(model: DFlashDraftModel, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and model.safetensors; tensor names are the module's own (unprefixed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = dict(model.config.raw)
    raw["architectures"] = ["DFlashDraftModel"]
    state = {
        k: (v.to(dtype) if dtype is not None else v).detach().contiguous().cpu()
        for k, v in model.state_dict().items()
    }
    raw["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    save_file(state, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return directory


def check_compatible(config: DFlashConfig, target_config: PretrainedConfig, embedding_rows: int) -> None:
    """Raise IncompatibleDrafterError naming the first mismatch between drafter and target."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    fix = "train or download a drafter made for this target"
    if config.hidden_size != text.hidden_size:
        raise IncompatibleDrafterError(
            f"drafter hidden_size {config.hidden_size} != target hidden_size {text.hidden_size}; {fix}"
        )
    if config.num_target_layers != text.num_hidden_layers:
        raise IncompatibleDrafterError(
            f"drafter was trained for a target with {config.num_target_layers} layers (num_target_layers), "
            f"this target has {text.num_hidden_layers}; {fix}"
        )
    bad = [i for i in config.target_layer_ids if i >= text.num_hidden_layers]
    if bad:
        raise IncompatibleDrafterError(
            f"target_layer_ids {bad} do not exist in a {text.num_hidden_layers}-layer target")
    if config.vocab_size != text.vocab_size:
        raise IncompatibleDrafterError(
            f"drafter vocab_size {config.vocab_size} != target vocab_size {text.vocab_size}; {fix}"
        )
    if not 0 <= config.mask_token_id < embedding_rows:
        raise IncompatibleDrafterError(
            f"mask_token_id {config.mask_token_id} is outside the target's embedding ({embedding_rows} rows); "
            "add the mask token to the target's tokenizer and embedding, or fix dflash_config.mask_token_id"
        )
