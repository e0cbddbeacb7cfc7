"""A drafter in the same process as the decode loop."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DFlashError
from ..rounds import confident_length, make_block
from ..sampling import propose_tokens
from .model import DFlashDraftModel, DraftCache
from .protocol import GREEDY, DraftSampling


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
        self._first_positions: dict[str, int] = {}  # sessions whose context does not start at 0

    def open(self, session_id: str, first_position: int) -> None:
        """Start a session afresh with context beginning at `first_position` instead of 0.

        For a drafter rebuilding a session from a windowed context log: the oldest positions are
        gone, so the cache holds positions [first_position, ...) at their true RoPE positions.
        """
        self._caches[session_id] = DraftCache(len(self.model.layers))
        self._first_positions[session_id] = first_position

    @torch.inference_mode()
    def draft(
        self, session_id: str, context: torch.Tensor, context_start: int, last_token: int, block_size: int,
        sampling: DraftSampling = GREEDY,
    ) -> torch.Tensor:
        cache = self._caches.get(session_id)
        if cache is None:
            cache = self._caches[session_id] = DraftCache(len(self.model.layers))
        first = self._first_positions.get(session_id, 0)
        if first + cache.length != context_start:
            raise DFlashError(
                f"drafter session {session_id} holds context up to position {first + cache.length}, "
                f"the call continues from {context_start}; replay the context from position 0"
            )
        device = self.embed_tokens.weight.device
        block = make_block(last_token, block_size, self.mask_token_id).to(device).unsqueeze(0)
        start = context_start + context.shape[0]
        positions = torch.arange(first, start + block_size, device=device).unsqueeze(0)
        dtype = next(self.model.parameters()).dtype
        hidden = self.model(
            self.embed_tokens(block).to(dtype),
            context.to(device=device, dtype=dtype).unsqueeze(0),
            positions,
            cache=cache,
        )
        logits = self.lm_head(hidden[0, 1:].to(self.lm_head.weight.dtype))
        cut = sampling.min_confidence > 0.0
        tokens, probs = propose_tokens(logits.float(), sampling, start + 1, with_probs=cut)
        return tokens[: confident_length(probs, sampling.min_confidence)] if cut else tokens

    def release(self, session_id: str) -> None:
        self._caches.pop(session_id, None)
        self._first_positions.pop(session_id, None)

    def session_length(self, session_id: str) -> int:
        """The position the session's context reaches (0 for an unknown session)."""
        cache = self._caches.get(session_id)
        return 0 if cache is None else self._first_positions.get(session_id, 0) + cache.length
