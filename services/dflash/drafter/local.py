"""A drafter in the same process as the decode loop: many sessions' blocks in one drafter forward."""

from __future__ import annotations

import torch
from torch import nn

from ..attention_backend import AttentionBackend, backend_for, page_tokens_for
from ..block_manager import BlockManager, CacheShape
from ..errors import DFlashError
from ..packed_linear import PackedLinear
from ..rounds import confident_length
from ..sampling import propose_tokens
from .model import DFlashDraftModel, PackedDraft
from .protocol import GREEDY, Draft, DraftRequest, DraftSampling

# The drafter's context cache is small (context keys/values only); sessions are bounded by count, not
# bytes, so its pool starts at this many positions and doubles when sessions need more.
_INITIAL_TOKENS = 1 << 14


class LocalDrafter:
    """Runs a DFlashDraftModel with the target's (frozen, shared) embedding and LM head.

    Implements the `Drafter` protocol; keeps every session's context keys/values in one paged pool
    (`BlockManager`), attended through the device's attention backend (attention_backend.py).
    """

    separate_device = False  # on the target's device: drafting beside the target only takes its compute

    def __init__(self, model: DFlashDraftModel, embed_tokens: nn.Module, lm_head: nn.Module,
                 attention: str | AttentionBackend = "auto") -> None:
        self.model = model
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self._head_dtype = lm_head.dtype if isinstance(lm_head, PackedLinear) else lm_head.weight.dtype
        cfg = model.config
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.target_layer_ids = cfg.target_layer_ids
        param = next(model.parameters())
        self._max_rows = (cfg.raw.get("max_position_embeddings") or 1 << 20) + cfg.block_size
        self.attention = backend_for(param.device, attention, param.dtype) if isinstance(attention, str) else attention
        self.cache = BlockManager(CacheShape(len(model.layers), cfg.num_key_value_heads, cfg.head_dim, param.dtype,
                                             param.device), _INITIAL_TOKENS, page_tokens_for(self.attention),
                                  growable=True)
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
            self.cache, self.attention, tuple(r.session_id for r in requests),
            tuple(self._first_positions.get(r.session_id, 0) for r in requests),
            tuple(self.cache.length(r.session_id) for r in requests),
            tuple(r.context.shape[0] for r in requests), tuple(r.block_size for r in requests),
        )
        blocks = [t for r in requests for t in (r.last_token, *[self.mask_token_id] * (r.block_size - 1))]
        blocks = torch.tensor(blocks, dtype=torch.long).to(device, non_blocking=True)
        context = torch.cat([r.context for r in requests]).to(device=device, dtype=dtype)
        hidden = self.model.forward_packed(self.embed_tokens(blocks).to(dtype), context, batch)
        # One LM head over every session's proposal rows (the block's positions after its anchor), and
        # the greedy sessions' picks for all of them at once; sampled sessions pick on their own rows.
        rows = [o + j for r, o in zip(requests, batch.blk_offsets) for j in range(1, r.block_size)]
        rows = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
        logits = self.lm_head(hidden.index_select(0, rows).to(self._head_dtype)).float()
        tokens, probs = propose_tokens(logits, GREEDY, 0, with_probs=True)
        sampled = [(i, r) for i, r in enumerate(requests) if not r.sampling.greedy]
        if sampled:
            tokens, probs, row = tokens.clone(), probs.clone(), 0
            starts = []
            for r in requests:
                starts.append(row)
                row += r.block_size - 1
            for i, r in sampled:
                a, n = starts[i], r.block_size - 1
                tokens[a : a + n], probs[a : a + n] = propose_tokens(
                    logits[a : a + n], r.sampling, r.context_start + r.context.shape[0] + 1, with_probs=True)
        # One device->host copy for the tokens and their probabilities (token ids are exact in float64).
        host = torch.stack([tokens.double(), probs.double()]).cpu()
        tokens, probs = host[0].long(), host[1].float()
        host_probs = host[1].tolist()
        drafts, row = [], 0
        for r in requests:
            n = r.block_size - 1
            keep = confident_length(host_probs[row : row + n], r.sampling.min_confidence)
            drafts.append(Draft(tokens[row : row + keep], probs[row : row + keep]))
            row += n
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
