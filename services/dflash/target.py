"""The target model: one packed forward prefills and verifies many sessions, returning logits and features."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from . import packed_attention
from .kv_cache import CacheShape, KVCache
from .packed_attention import NO_MASK, PackedBatch


@dataclass
class TargetOutput:
    """logits: [L, V] float32 for the kept positions; features: [L, n*H] selected hidden states."""

    logits: torch.Tensor
    features: torch.Tensor


@dataclass(frozen=True)
class ForwardItem:
    """One session's part of a packed forward: `token_ids` at absolute positions start.., onto a cache
    holding exactly `start` positions; `last_only` keeps the logits of the last token only (prefill)."""

    session_id: str
    token_ids: tuple[int, ...]
    start: int
    last_only: bool = False


class TargetModel:
    """Wraps any Hugging Face causal LM whose attention goes through transformers' AttentionInterface.

    `layer_ids` are decoder-layer indices; the output of decoder layer i is `hidden_states[i + 1]`
    (index 0 is the embedding output). The model's attention is switched to `packed_attention`, which
    is plain SDPA unless a packed batch is passed, so the model still works elsewhere (`generate()`).
    """

    def __init__(self, model: PreTrainedModel, layer_ids: tuple[int, ...] = ()) -> None:
        self.model = model.eval()
        self.model.set_attn_implementation(packed_attention.IMPLEMENTATION)
        self.layer_ids = tuple(layer_ids)
        text = model.config.get_text_config()
        self.vocab_size = text.vocab_size
        self.max_positions = getattr(text, "max_position_embeddings", None) or (1 << 30)
        self.cache_shape = CacheShape(
            num_layers=text.num_hidden_layers,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            dtype=model.dtype,
            device=model.device,
        )

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def new_cache(self, budget_tokens: int) -> KVCache:
        """A cache for many sessions holding at most `budget_tokens` positions in all."""
        return KVCache(self.cache_shape, budget_tokens)

    @torch.inference_mode()
    def forward(self, cache: KVCache, items: list[ForwardItem]) -> list[TargetOutput]:
        """One forward over every item's tokens, extending each session's cache; outputs in item order.

        Logits for every token of an item (or its last with last_only), features for every token.
        """
        batch = PackedBatch(cache, tuple(i.session_id for i in items), tuple(i.start for i in items),
                            tuple(len(i.token_ids) for i in items))
        ids = torch.tensor([t for i in items for t in i.token_ids], dtype=torch.long, device=self.device)
        keep = []
        for item, offset in zip(items, batch.offsets):
            n = len(item.token_ids)
            keep.extend([offset + n - 1] if item.last_only else range(offset, offset + n))
        out = self.model(
            input_ids=ids.unsqueeze(0),
            position_ids=batch.positions(self.device),
            attention_mask=NO_MASK,
            use_cache=False,
            output_hidden_states=bool(self.layer_ids),
            logits_to_keep=torch.tensor(keep, device=self.device),
            dflash_batch=batch,
        )
        logits = out.logits[0].float()
        if self.layer_ids:
            features = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        else:
            features = ids.new_zeros((ids.shape[0], 0), dtype=torch.float32)
        results, row = [], 0
        for item, offset in zip(items, batch.offsets):
            n = len(item.token_ids)
            kept = 1 if item.last_only else n
            results.append(TargetOutput(logits[row : row + kept], features[offset : offset + n]))
            row += kept
        return results

    def forward_alone(self, token_ids: Iterable[int]) -> TargetOutput:
        """One sequence from position 0 on a throwaway cache: logits and features of every token."""
        ids = tuple(int(t) for t in token_ids)
        cache = self.new_cache(len(ids))
        cache.reserve("alone", len(ids))
        return self.forward(cache, [ForwardItem("alone", ids, 0)])[0]
