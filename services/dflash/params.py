"""Per-request decoding parameters, validated once where a request enters the system."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import InvalidRequestError

MAX_NEW_TOKENS_LIMIT = 1 << 20
# max_new_tokens unset: this many, or what the context leaves after the prompt when that is fewer (as
# vLLM fills the room left when max_tokens is unset). A value set and larger than the room is refused.
DEFAULT_MAX_NEW_TOKENS = 128
MAX_SEED = (1 << 64) - 1  # the proto's uint64; sampling.position_seed mixes all 64 bits
# Sampling divides the logits by the temperature. Below this one the quotient can overflow float32 (a
# logit of 50 over 1e-40 is 5e41), and the distribution it tends to is already one-hot: such a
# temperature decodes greedily, the limit of sampling as the temperature falls to 0.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    temperature 0 is greedy, and so is any temperature below MIN_SAMPLING_TEMPERATURE (the limit of
    sampling as the temperature falls to 0; `temperature` then reads 0). A very large temperature
    samples uniformly from what top-k and top-p keep, its own limit. top_k 0 (or at least the
    vocabulary) and top_p 1.0 switch those filters off; top_k 1 or a tiny top_p keeps the most likely
    token alone. `seed` fixes the sampled output: the same seed gives the same tokens at any block size
    (see sampling.py).
    `max_new_tokens` None: DEFAULT_MAX_NEW_TOKENS or what the context leaves, whichever is fewer
    (intake.py resolves it against the prompt); a value that does not fit the context is refused.
    `block_size` None uses the drafter's trained block size; 1 switches drafting off.
    `draft_confidence` in [0, 1) shortens each round's draft to the proposals the drafter is jointly
    confident in (the running product of its top-token probabilities stays >= this; the first is always
    kept): the target then verifies fewer tokens where a long draft would mostly be rejected. 0 verifies
    the whole block. The output does not depend on it, only the speed.
    """

    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    block_size: int | None = None
    draft_confidence: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None:
            _check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0 (0 is greedy), got {self.temperature}")
        if self.temperature < MIN_SAMPLING_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, 0, 1 << 31)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1, 1024)
        _check_float("draft_confidence", self.draft_confidence)
        if not 0.0 <= self.draft_confidence < 1.0:
            raise InvalidRequestError("draft_confidence", f"must be in [0, 1) (0 verifies the whole block), "
                                      f"got {self.draft_confidence}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, 1 << 31)
        if self.extra:
            raise InvalidRequestError(next(iter(self.extra)), "unknown sampling parameter")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidRequestError(name, f"must be between {lo} and {hi}, got {value}")


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value!r}")
