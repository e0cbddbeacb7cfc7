"""Our drafter as transformers' own DFlash assistant, and back.

transformers (5.24 and later) runs DFlash in `generate(..., assistant_model=A, speculation_type="dflash")`
with `A` a `MuseGlimmerAssistantModel` (model_type "muse_glimmer_assistant", loaded by `AutoModel`). Its
network is ours: Qwen3-style layers with q/k RMSNorm and RoPE, keys/values over [fused context | block],
non-causal, the target's embedding in and LM head out. What differs is naming and a few conventions:

| ours (public DFlash format)                     | transformers (muse_glimmer_assistant)              |
|-------------------------------------------------|----------------------------------------------------|
| `fc.weight`, `hidden_norm.weight`               | `encoder.fc.weight`, `encoder.output_norm_enc.weight` |
| `block_size` (top level)                        | `block_size` (top level)                           |
| `dflash_config.mask_token_id`                   | `mask_token_id` (top level)                        |
| `dflash_config.target_layer_ids`                | `target_layer_ids` (top level)                     |
| `num_target_layers`, `vocab_size`               | absent (written as extra keys by the export)       |
| `rope_theta` (+ `rope_scaling`)                 | `rope_parameters`                                  |
| no `layer_types`: every layer full attention    | no `layer_types`: every layer SLIDING, window 2048 |
| sliding layer: query q sees key k iff q-k < W   | sliding layer: iff abs(q-k) <= W'                  |

Layer ids mean the same in both: 0-based decoder layers, the feature of layer i is
`hidden_states[i + 1]` (index 0, the embedding output, is never counted). A sliding window converts
exactly with W' = W - 1 only when W >= block_size: transformers' window is also two-sided, so below that
it hides the block's own later tokens from its earlier ones, which ours never does (checked
numerically over many rounds; with W < block_size the draft logits differ). RoPE converts when its type
is static (`default`, `linear`, `llama3`, `yarn`, `proportional`) and both sides compute the same
frequencies; `dynamic` and `longrope` rescale with the sequence length seen per call, and the two
implementations call RoPE over different spans, so they are refused. Anything refused raises
`CheckpointError` naming the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import CheckpointError
from .checkpoint import load_drafter, read_config_json, read_weights, resolve_dir, save_drafter
from .config import ARCHITECTURE, DFlashConfig
from .model import DFlashDraftModel, qwen3_config

if TYPE_CHECKING:
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

MODEL_TYPE = "muse_glimmer_assistant"
# Ours -> transformers; every other tensor name (layers.*, norm.weight) is the same on both sides.
RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "proportional")
# transformers' class defaults for these belong to one 30B model; a checkpoint must state its own.
DFLASH_FIELDS = ("block_size", "mask_token_id", "target_layer_ids")


# -- configs -----------------------------------------------------------------------------------------


def transformers_config(config: DFlashConfig) -> MuseGlimmerAssistantConfig:
    """The MuseGlimmerAssistantConfig that runs `config`'s drafter exactly; refuses what would not."""
    from transformers import MuseGlimmerAssistantConfig

    rope = dict(qwen3_config(config).rope_parameters)
    _check_rope_type(rope, "rope_theta/rope_scaling")
    sliding = "sliding_attention" in config.layer_types
    if sliding and config.sliding_window < config.block_size:
        raise CheckpointError(
            f"sliding_window {config.sliding_window} < block_size {config.block_size}: transformers' sliding "
            "window is two-sided and would hide later block tokens from earlier ones; cannot export exactly"
        )
    tconfig = MuseGlimmerAssistantConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, hidden_act=config.raw.get("hidden_act", "silu"),
        rope_parameters=rope, max_position_embeddings=config.max_position_embeddings,
        layer_types=list(config.layer_types),
        # Unused unless a layer slides, but the field must be an int.
        sliding_window=config.sliding_window - 1 if sliding else config.max_position_embeddings,
        block_size=config.block_size, mask_token_id=config.mask_token_id,
        target_layer_ids=list(config.target_layer_ids),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        # Not transformers fields: kept so that the reverse import needs no target.
        num_target_layers=config.num_target_layers, vocab_size=config.vocab_size,
    )
    _check_rope_equal(config, tconfig)
    return tconfig


def dflash_config(raw: dict, *, num_target_layers: int | None = None, vocab_size: int | None = None,
                  source: str = "config.json") -> DFlashConfig:
    """Our config for a transformers DFlash assistant's config.json; refuses what would not run exactly.

    num_target_layers / vocab_size: the target's, where config.json lacks them (transformers has no such
    fields; our export writes them).
    """
    from transformers import MuseGlimmerAssistantConfig

    if raw.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{source}: model_type is {raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
    missing = [k for k in DFLASH_FIELDS if k not in raw]
    if missing:
        raise CheckpointError(f"{source}: missing {missing}; transformers would fill them with one model's "
                              "defaults, so they must be stated")
    try:
        tconfig = MuseGlimmerAssistantConfig.from_dict(raw)  # transformers' own defaults for the rest
    except (KeyError, TypeError, ValueError) as exc:  # its strict dataclass validation
        raise CheckpointError(f"{source}: transformers rejects this config ({exc})") from None
    num_target_layers = raw.get("num_target_layers", num_target_layers)
    vocab_size = raw.get("vocab_size", vocab_size)
    for name, value in (("num_target_layers", num_target_layers), ("vocab_size", vocab_size)):
        if value is None:
            raise CheckpointError(f"{source}: no {name} (transformers does not store it); pass --target")
    bad = set(tconfig.layer_types) - {"full_attention", "sliding_attention"}
    if bad:
        raise CheckpointError(f"{source}: layer_types {sorted(bad)} have no counterpart in our drafter")
    sliding = "sliding_attention" in tconfig.layer_types
    if sliding and tconfig.sliding_window < tconfig.block_size - 1:
        raise CheckpointError(
            f"{source}: sliding_window {tconfig.sliding_window} < block_size - 1 ({tconfig.block_size - 1}): "
            "its two-sided window hides later block tokens from earlier ones, which ours cannot express"
        )
    rope = dict(tconfig.rope_parameters)
    _check_rope_type(rope, "rope_parameters")
    ours = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": tconfig.hidden_size, "num_hidden_layers": tconfig.num_hidden_layers,
        "num_attention_heads": tconfig.num_attention_heads, "num_key_value_heads": tconfig.num_key_value_heads,
        "head_dim": tconfig.head_dim, "intermediate_size": tconfig.intermediate_size,
        "hidden_act": tconfig.hidden_act, "rms_norm_eps": tconfig.rms_norm_eps,
        "rope_theta": rope.pop("rope_theta"), "vocab_size": vocab_size,
        "max_position_embeddings": tconfig.max_position_embeddings,
        "attention_bias": False, "tie_word_embeddings": False,
        "block_size": tconfig.block_size, "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": list(tconfig.target_layer_ids), "mask_token_id": tconfig.mask_token_id},
    }
    if rope.get("rope_type") != "default":
        ours["rope_scaling"] = rope  # the public format's (transformers 4) spelling
    if sliding:
        ours["layer_types"] = list(tconfig.layer_types)
        ours["sliding_window"] = tconfig.sliding_window + 1
    config = DFlashConfig.from_dict(ours, source=source)
    _check_rope_equal(config, tconfig)
    return config


def _check_rope_type(rope: dict, field: str) -> None:
    kind = rope.get("rope_type", "default")
    if kind not in STATIC_ROPE:
        raise CheckpointError(f"{field}: rope_type {kind!r} rescales with the sequence length per call and the "
                              "two implementations call RoPE over different spans; "
                              f"convertible: {', '.join(STATIC_ROPE)}")


def _check_rope_equal(config: DFlashConfig, tconfig: MuseGlimmerAssistantConfig) -> None:
    """Both sides' RoPE frequencies and scaling, computed by their own classes, must agree exactly."""
    from transformers.models.muse_glimmer_assistant.modeling_muse_glimmer_assistant import (
        MuseGlimmerAssistantRotaryEmbedding,
    )
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    ours, theirs = Qwen3RotaryEmbedding(qwen3_config(config)), MuseGlimmerAssistantRotaryEmbedding(tconfig)
    if not (torch.equal(ours.inv_freq, theirs.inv_freq) and ours.attention_scaling == theirs.attention_scaling):
        raise CheckpointError(f"rope_parameters: RoPE {dict(tconfig.rope_parameters)} gives different frequencies "
                              "in the two implementations; cannot convert exactly")


# -- models ------------------------------------------------------------------------------------------


def to_transformers(model: DFlashDraftModel) -> MuseGlimmerAssistantModel:
    """A MuseGlimmerAssistantModel with `model`'s weights (copied), same dtype and device, in eval mode."""
    from transformers import MuseGlimmerAssistantModel

    param = next(model.parameters())
    assistant = MuseGlimmerAssistantModel(transformers_config(model.config))
    state = {RENAMES.get(k, k): v for k, v in model.state_dict().items()}
    _load_exact(assistant, state, "our drafter")
    return assistant.to(device=param.device, dtype=param.dtype).eval()


def from_transformers(assistant: MuseGlimmerAssistantModel, *, num_target_layers: int | None = None,
                      vocab_size: int | None = None) -> DFlashDraftModel:
    """Our DFlashDraftModel with a loaded MuseGlimmerAssistantModel's weights (copied)."""
    config = dflash_config(assistant.config.to_dict(), num_target_layers=num_target_layers,
                           vocab_size=vocab_size, source=f"{type(assistant).__name__}.config")
    param = next(assistant.parameters())
    return _from_state(config, assistant.state_dict(), "the assistant").to(param.device, param.dtype).eval()


def _from_state(config: DFlashConfig, state: dict, source: str) -> DFlashDraftModel:
    back = {v: k for k, v in RENAMES.items()}
    model = DFlashDraftModel(config)
    _load_exact(model, {back.get(k, k): v for k, v in state.items() if not k.endswith("inv_freq")}, source)
    return model


def _load_exact(model: torch.nn.Module, state: dict, source: str) -> None:
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{source}: tensor names do not convert (missing: {missing[:6]}; "
                              f"unexpected: {unexpected[:6]})")
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                                  f"the config implies {tuple(tensor.shape)}")
    model.load_state_dict(state)


# -- directories -------------------------------------------------------------------------------------


def export_transformers(drafter: str | Path, out: str | Path) -> Path:
    """Write the drafter at `drafter` (public DFlash format) as a checkpoint `AutoModel` loads."""
    model = load_drafter(drafter)
    assistant = to_transformers(model)
    out = Path(out)
    assistant.save_pretrained(out)
    return out


def import_transformers(source: str | Path, out: str | Path, *, num_target_layers: int | None = None,
                        vocab_size: int | None = None) -> Path:
    """Write a transformers DFlash assistant checkpoint at `source` in the public DFlash format at `out`."""
    directory = resolve_dir(source, "transformers DFlash assistant")
    raw, path = read_config_json(directory, "transformers DFlash assistant")
    config = dflash_config(raw, num_target_layers=num_target_layers, vocab_size=vocab_size, source=str(path))
    state = read_weights(directory)
    model = _from_state(config, state, str(directory))
    return save_drafter(model, out, dtype=next(iter(state.values())).dtype)
