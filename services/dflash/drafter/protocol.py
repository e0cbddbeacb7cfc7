"""The seam between the decode loop and a drafter, wherever the drafter runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import DFlashError
from ..params import MIN_SAMPLING_TEMPERATURE, SamplingParams


@dataclass(frozen=True)
class DraftSampling:
    """How a drafter turns its logits into proposals; only the speed of decoding depends on it.

    temperature 0: the drafter's argmax. Otherwise the request's own temperature, top-k and top-p
    applied to the drafter's logits, plus the very Gumbel noise the target samples each position with
    (`sampling.py`, from `seed` and the position): a coupled sample. Where the drafter's distribution
    is close to the target's, it then proposes the token the target is about to draw, so a round is
    accepted with the chance that two close distributions' samples agree, rather than the target's
    probability of the drafter's argmax (small wherever the target is unsure, as at temperature 1).
    min_confidence: see `SamplingParams.draft_confidence`; it reads the drafter's probability of each
    token it proposes.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        checks = (
            # SamplingParams turns a smaller positive temperature into 0: dividing logits by it overflows.
            ("temperature", math.isfinite(self.temperature)
             and (self.temperature == 0.0 or self.temperature >= MIN_SAMPLING_TEMPERATURE),
             f"0 (greedy) or in [{MIN_SAMPLING_TEMPERATURE:g}, inf)"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("top_p", self.greedy or 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("seed", 0 <= self.seed < 1 << 64, "in [0, 2**64)"),
            ("min_confidence", 0.0 <= self.min_confidence < 1.0, "in [0, 1)"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise DFlashError(f"{name}: {getattr(self, name)} is not {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def for_request(cls, params: SamplingParams, seed: int) -> DraftSampling:
        """The rule for a request's SamplingParams and its sampling seed."""
        if params.greedy:
            return cls(min_confidence=params.draft_confidence)
        return cls(params.temperature, params.top_k, params.top_p, seed, params.draft_confidence)


GREEDY = DraftSampling()


@dataclass(frozen=True)
class DraftRequest:
    """One session's part of a batched draft call.

    context: [n, num_features * hidden] target features of positions context_start .. context_start+n-1,
        the positions committed since the previous call (all prompt positions on the first call).
    last_token: the last committed token, at position context_start + n (not yet seen by the target).
    block_size: the block the drafter fills (proposals for positions context_start + n + 1 onwards).
    restart: the context is the session's whole context from context_start (a window of its most
        recent positions): the drafter drops what it holds for the session and starts afresh from it.
    """

    session_id: str
    context: torch.Tensor
    context_start: int
    last_token: int
    block_size: int
    sampling: DraftSampling = GREEDY
    restart: bool = False


@dataclass(frozen=True)
class Draft:
    """A session's proposals: tokens [k] (LongTensor, CPU) and the drafter's probability of each [k]
    (float32), which the scheduler reads to decide how many of them to verify. `replica` names who
    drafted ("local" in process, "" when nobody could: then tokens is empty and the round is target-only)."""

    tokens: torch.Tensor
    probs: torch.Tensor
    replica: str = "local"

    @classmethod
    def none(cls) -> Draft:
        return _NO_DRAFT


_NO_DRAFT = Draft(torch.empty(0, dtype=torch.long), torch.empty(0), "")  # shared: tensors are never written


class Drafter(Protocol):
    """Proposes blocks for many sessions per call. Implementations: `LocalDrafter` (in process), the gRPC
    client `RemoteDrafter` (service).

    The drafter keeps per-session context (its KV cache of target features) between calls. Each call
    brings only the context it has not seen yet, so its cache grows by exactly the committed tokens.
    """

    block_size: int
    """The largest block the drafter was trained for."""

    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    separate_device: bool
    """True when drafting runs on devices of its own (remote replicas): the engine then drafts beside
    verification instead of before it (draft_pipeline.py). Read with getattr, False when absent."""

    def draft_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        """Draft every request's block (one drafter forward per replica); results in request order.

        Each Draft holds block_size - 1 proposals, or with sampling.min_confidence > 0 only the leading
        ones `rounds.confident_length` keeps (at least one). Raises `DFlashError`s only; a session the
        drafter does not hold up to context_start (and not a restart) is an error the caller answers
        by sending its recent context again with `restart`.
        """
        ...

    def release(self, session_id: str) -> None:
        """Forget a session's cache (finished, cancelled, or moved)."""
        ...
