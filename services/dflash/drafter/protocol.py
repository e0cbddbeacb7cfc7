"""The seam between the decode loop and a drafter, wherever the drafter runs."""

from __future__ import annotations

from typing import Protocol

import torch


class Drafter(Protocol):
    """Proposes one block per call. Implementations: `LocalDrafter` (in process), a gRPC client (service).

    The drafter keeps per-session context (its KV cache of target features) between calls. Each call
    brings only the context it has not seen yet, so its cache grows by exactly the committed tokens.
    """

    block_size: int
    """The largest block the drafter was trained for."""

    mask_token_id: int
    target_layer_ids: tuple[int, ...]

    def draft(
        self,
        session_id: str,
        context: torch.Tensor,
        context_start: int,
        last_token: int,
        block_size: int,
        min_confidence: float = 0.0,
    ) -> torch.Tensor:
        """Draft the tokens after `last_token`.

        context: [n, num_features * hidden] target features of positions context_start .. context_start+n-1,
            the positions committed since the previous call (all prompt positions on the first call).
        last_token: the last committed token, at position context_start + n (not yet seen by the target).
        Returns a LongTensor [block_size - 1]: proposals for positions context_start + n + 1 onwards;
            with min_confidence > 0 only the leading ones `rounds.confident_length` keeps (at least one).
        Raises KeyError-free `DFlashError`s only; an unknown session with context_start > 0 is an error
        the caller answers by replaying context from position 0.
        """
        ...

    def release(self, session_id: str) -> None:
        """Forget a session's cache (finished, cancelled, or moved)."""
        ...
