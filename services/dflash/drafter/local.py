"""A drafter in the same process as the decode loop: many sessions' blocks in one drafter forward."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DFlashError
from ..kv_cache import CacheShape, KVCache
from ..rounds import confident_length, make_block
from ..sampling import propose_tokens
from .model import DFlashDraftModel, PackedDraft
from .protocol import GREEDY, Draft, DraftRequest, DraftSampling

# The drafter's context cache is small (context keys/values only); sessions are bounded by count, not bytes.
_UNBOUNDED = 1 << 40


class LocalDrafter:
    """Runs a DFlashDraftModel with the target's (frozen, shared) embedding and LM head.

    Implements the `Drafter` protocol; keeps every session's context keys/values in one KVCache.
    """

    def __init__(self, model: DFlashDraftModel, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self.model = model
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        cfg = model.config
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.target_layer_ids = cfg.target_layer_ids
        param = next(model.parameters())
        self._max_rows = (cfg.raw.get("max_position_embeddings") or 1 << 20) + cfg.block_size
        self.cache = KVCache(CacheShape(len(model.layers), cfg.num_key_value_heads, cfg.head_dim, param.dtype,
                                        param.device), _UNBOUNDED)
        self._first_positions: dict[str, int] = {}  # sessions whose context does not start at 0

    def open(self, session_id: str, first_position: int) -> None:
        """Start a session afresh with context beginning at `first_position` instead of 0.

        For a session restarted from a window of its recent context: the oldest positions are not
        there, so the cache holds positions [first_position, ...) at their true RoPE positions.
        """
        self.release(session_id)
        self.cache.reserve(session_id, self._max_rows)
        self._first_positions[session_id] = first_position

    @torch.inference_mode()
    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        """One drafter forward for every request (see `Drafter.draft_batch`)."""
        if not requests:
            return []
        if len({r.session_id for r in requests}) != len(requests):
            raise DFlashError("draft_batch: a session appears twice in one batch")
        for r in requests:
            if r.restart:
                self.open(r.session_id, r.context_start)
            elif r.session_id not in self.cache:
                self.cache.reserve(r.session_id, self._max_rows)
            reached = self.session_length(r.session_id)
            if reached != r.context_start:
                raise DFlashError(
                    f"drafter session {r.session_id} holds context up to position {reached}, "
                    f"the call continues from {r.context_start}; send its recent context with restart"
                )
        device = self.embed_tokens.weight.device
        dtype = next(self.model.parameters()).dtype
        batch = PackedDraft(
            self.cache, tuple(r.session_id for r in requests),
            tuple(self._first_positions.get(r.session_id, 0) for r in requests),
            tuple(self.cache.length(r.session_id) for r in requests),
            tuple(r.context.shape[0] for r in requests), tuple(r.block_size for r in requests),
        )
        blocks = torch.cat([make_block(r.last_token, r.block_size, self.mask_token_id) for r in requests]).to(device)
        context = torch.cat([r.context.to(device=device, dtype=dtype) for r in requests])
        hidden = self.model.forward_packed(self.embed_tokens(blocks).to(dtype), context, batch)
        # One LM head over every session's proposal rows (the block's positions after its anchor), and
        # the greedy sessions' picks for all of them at once; sampled sessions pick on their own rows.
        rows = torch.cat([torch.arange(o + 1, o + r.block_size) for r, o in zip(requests, batch.blk_offsets)])
        logits = self.lm_head(hidden[rows.to(device)].to(self.lm_head.weight.dtype)).float()
        if any(r.sampling.greedy for r in requests):
            greedy_tokens, greedy_probs = propose_tokens(logits, GREEDY, 0, with_probs=True)
        drafts, row = [], 0
        for r in requests:
            n, start = r.block_size - 1, r.context_start + r.context.shape[0]
            if r.sampling.greedy:
                tokens, probs = greedy_tokens[row : row + n], greedy_probs[row : row + n]
            else:
                tokens, probs = propose_tokens(logits[row : row + n], r.sampling, start + 1, with_probs=True)
            row += n
            keep = confident_length(probs, r.sampling.min_confidence)
            drafts.append(Draft(tokens[:keep].to("cpu", torch.long), probs[:keep].to("cpu", torch.float32)))
        return drafts

    def draft(self, session_id: str, context: torch.Tensor, context_start: int, last_token: int, block_size: int,
              sampling: DraftSampling = GREEDY) -> torch.Tensor:
        """One session's proposals (a batch of one); see `Drafter.draft_batch`."""
        request = DraftRequest(session_id, context, context_start, last_token, block_size, sampling)
        return self.draft_batch([request])[0].tokens

    def release(self, session_id: str) -> None:
        self.cache.free(session_id)
        self._first_positions.pop(session_id, None)

    def session_length(self, session_id: str) -> int:
        """The position the session's context reaches (0 for an unknown session)."""
        if session_id not in self.cache:
            return 0
        return self._first_positions.get(session_id, 0) + self.cache.length(session_id)

    @property
    def num_sessions(self) -> int:
        return self.cache.num_sessions
