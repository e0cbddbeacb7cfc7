"""A drafter in the same process as the decode loop."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DFlashError
from .model import DFlashDraftModel, DraftCache


class LocalDrafter:
    """Runs a DFlashDraftModel with the target's (frozen, shared) embedding and LM head.

    Implements the `Drafter` protocol; keeps one DraftCache per session in memory.
    """

    def __init__(self, model: DFlashDraftModel, embed_tokens: nn.Module, lm_head: nn.Module):
        self.model = model
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.block_size = model.config.block_size
        self.mask_token_id = model.config.mask_token_id
        self.target_layer_ids = model.config.target_layer_ids
        self._caches: dict[str, DraftCache] = {}

    @torch.inference_mode()
    def draft(
        self, session_id: str, context: torch.Tensor, context_start: int, last_token: int, block_size: int
    ) -> torch.Tensor:
        cache = self._caches.get(session_id)
        if cache is None:
            cache = self._caches[session_id] = DraftCache(len(self.model.layers))
        if cache.length != context_start:
            raise DFlashError(
                f"drafter session {session_id} holds {cache.length} context positions, "
                f"the call continues from {context_start}; replay the context from position 0"
            )
        device = self.embed_tokens.weight.device
        block = torch.full((1, block_size), self.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = last_token
        start = context_start + context.shape[0]
        positions = torch.arange(start + block_size, device=device).unsqueeze(0)
        dtype = next(self.model.parameters()).dtype
        hidden = self.model(
            self.embed_tokens(block).to(dtype),
            context.to(device=device, dtype=dtype).unsqueeze(0),
            positions,
            cache=cache,
        )
        logits = self.lm_head(hidden[0, 1:].to(self.lm_head.weight.dtype))
        return logits.argmax(dim=-1)

    def release(self, session_id: str) -> None:
        self._caches.pop(session_id, None)

    def session_length(self, session_id: str) -> int:
        cache = self._caches.get(session_id)
        return 0 if cache is None else cache.length
