"""Per-round and per-request statistics, as the paper counts them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoundStats:
    """One round. Round 0 is the prefill (one token, no draft).

    draft_tokens: tokens proposed (block size - 1); accepted_tokens: of those, how many the target kept;
    committed: accepted + the bonus token (tau counts this); emitted: what survived stops and limits.
    policy_arm / policy_reason: the verify policy's choice for the round's step and why it made it (a round
    with draft_tokens 0 says there why nothing was verified).
    """

    index: int
    draft_tokens: int
    accepted_tokens: int
    committed: int
    emitted: int
    draft_ms: float
    verify_ms: float
    drafter: str = ""  # the replica that drafted the round ("local" in process, "" for none: target-only)
    policy_arm: str = ""  # how the step verified: "full", "confident" or "plain" (verify_policy.py)
    policy_reason: str = ""  # why: "best", "exploring", "policy off", "nothing to draft", ...


@dataclass
class GenerationStats:
    """Totals for one request; `tau` is mean committed tokens per verify round, bonus token included."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_histogram: Counter = field(default_factory=Counter)

    def add_round(self, r: RoundStats) -> None:
        self.draft_s += r.draft_ms / 1000
        self.verify_s += r.verify_ms / 1000
        if r.index == 0:
            return
        self.rounds += 1
        self.draft_tokens += r.draft_tokens
        self.accepted_tokens += r.accepted_tokens
        self.acceptance_histogram[r.committed] += 1

    @property
    def tau(self) -> float:
        if not self.rounds:
            return 0.0
        return sum(k * n for k, n in self.acceptance_histogram.items()) / self.rounds

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (prefill excluded, as the paper measures)."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 and self.generated_tokens > 1 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rounds": self.rounds,
            "tau": round(self.tau, 4),
            "acceptance_histogram": {str(k): v for k, v in sorted(self.acceptance_histogram.items())},
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "ttft_s": round(self.ttft_s, 6),
            "decode_s": round(self.decode_s, 6),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
        }
