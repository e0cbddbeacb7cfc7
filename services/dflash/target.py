"""The target model: one forward both prefills and verifies, returning logits and the drafter's features."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


# transformers >= 5.2x crops by a negative count of tokens to remove; earlier releases by the new length.
_CROP_TAKES_COUNT = "tokens_to_remove" in inspect.signature(DynamicCache.crop).parameters


@dataclass
class TargetOutput:
    """logits: [L, V] float32 for the kept positions; features: [L, n*H] selected hidden states."""

    logits: torch.Tensor
    features: torch.Tensor


class TargetModel:
    """Wraps any Hugging Face causal LM.

    `layer_ids` are decoder-layer indices; the output of decoder layer i is `hidden_states[i + 1]`
    (index 0 is the embedding output). Caches are transformers `DynamicCache`s owned by the caller.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: tuple[int, ...] = ()):
        self.model = model.eval()
        self.layer_ids = tuple(layer_ids)
        text = model.config.get_text_config()
        self.vocab_size = text.vocab_size
        self.max_positions = getattr(text, "max_position_embeddings", None) or (1 << 30)
        params = inspect.signature(model.forward).parameters
        # transformers renames past_key_values to cache (deprecated from 5.x, removed in 5.40).
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | torch.Tensor, start: int, cache: DynamicCache, last_only: bool = False):
        """Run tokens at absolute positions start.. through the model, extending `cache`.

        The cache must hold exactly `start` positions. Returns TargetOutput; with last_only, logits
        of the last position only (prefill), features always for every position.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).view(1, -1)
        positions = torch.arange(start, start + ids.shape[1], device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=bool(self.layer_ids),
            logits_to_keep=1 if last_only else 0,
            **{self._cache_kwarg: cache},
        )
        if self.layer_ids:
            features = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        else:
            features = ids.new_zeros((ids.shape[1], 0), dtype=torch.float32)
        return TargetOutput(logits=out.logits[0].float(), features=features)

    @staticmethod
    def crop(cache: DynamicCache, length: int) -> None:
        """Roll the cache back to its first `length` positions (drop rejected draft tokens)."""
        extra = cache.get_seq_length() - length
        if extra > 0:
            cache.crop(-extra if _CROP_TAKES_COUNT else length)
