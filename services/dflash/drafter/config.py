"""The drafter's config.json in the public DFlash format, parsed once into a frozen dataclass."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError

ARCHITECTURE = "DFlashDraftModel"


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The paper's layer choice: spread evenly from the 2nd to the 3rd-to-last target layer."""
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + k * span / (num_features - 1)) for k in range(num_features)]


@dataclass(frozen=True)
class DFlashConfig:
    """Everything the drafter needs from config.json; `raw` keeps the whole file for saving."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    raw: dict = field(compare=False, repr=False)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DFlashConfig:
        raw = copy.deepcopy(raw)
        dflash = raw.get("dflash_config")
        if not isinstance(dflash, dict):
            raise CheckpointError(
                f"{source}: missing 'dflash_config' ({{'target_layer_ids': [...], 'mask_token_id': N}}); "
                "is this a DFlash drafter checkpoint?"
            )

        def need(key: str, where: dict = raw, kind: type = int) -> Any:
            if key not in where:
                raise CheckpointError(f"{source}: missing required key '{key}'")
            value = where[key]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise CheckpointError(f"{source}: '{key}' must be an integer, got {value!r}")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        layers = need("num_hidden_layers")
        layer_ids = dflash.get("target_layer_ids")
        if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) for i in layer_ids):
            raise CheckpointError(f"{source}: dflash_config.target_layer_ids must be a non-empty list of integers")
        layer_types = raw.get("layer_types") or ["full_attention"] * layers
        if len(layer_types) != layers or set(layer_types) - {"full_attention", "sliding_attention"}:
            raise CheckpointError(
                f"{source}: layer_types must list 'full_attention' or 'sliding_attention' for each of {layers} layers"
            )
        sliding = raw.get("sliding_window")
        if "sliding_attention" in layer_types and not sliding:
            raise CheckpointError(f"{source}: layer_types asks for sliding_attention but sliding_window is not set")
        config = cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            intermediate_size=need("intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            vocab_size=need("vocab_size"),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            block_size=need("block_size"),
            num_target_layers=need("num_target_layers"),
            target_layer_ids=tuple(layer_ids),
            mask_token_id=need("mask_token_id", dflash),
            layer_types=tuple(layer_types),
            sliding_window=sliding if "sliding_attention" in layer_types else None,
            raw=raw,
        )
        if config.block_size < 2:
            raise CheckpointError(f"{source}: block_size must be at least 2, got {config.block_size}")
        bad = [i for i in config.target_layer_ids if not 0 <= i < config.num_target_layers]
        if bad:
            raise CheckpointError(
                f"{source}: target_layer_ids {bad} are outside the target's {config.num_target_layers} layers"
            )
        return config

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        num_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int,
        num_features: int | None = None,
        target_layer_ids: list[int] | None = None,
        intermediate_size: int | None = None,
    ) -> DFlashConfig:
        """A fresh drafter config shaped like a Hugging Face target config (for training or tests)."""
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_target = text.num_hidden_layers
        if target_layer_ids is None:
            # The paper spreads n layers over 1 .. L-3; a shallow target has only L-3 distinct layers there.
            target_layer_ids = default_target_layer_ids(num_target, num_features or min(5, max(1, num_target - 3)))
        heads = text.num_attention_heads
        rope_theta = getattr(text, "rope_theta", None) or (getattr(text, "rope_parameters", None) or {}).get(
            "rope_theta", 10000.0
        )
        raw = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": text.hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
            "intermediate_size": intermediate_size or text.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "rope_theta": rope_theta,
            "vocab_size": text.vocab_size,
            "max_position_embeddings": text.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "block_size": block_size,
            "num_target_layers": num_target,
            "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id},
        }
        return cls.from_dict(raw, source="new drafter config")
