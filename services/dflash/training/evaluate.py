"""Acceptance length on held-out prompts, measured with the real speculative engine (greedy)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..drafter.local import LocalDrafter
from ..drafter.model import DFlashDraftModel
from ..engine import SpeculativeEngine
from ..loading import eos_ids
from ..params import SamplingParams
from ..scheduler import SchedulerConfig
from ..target import TargetModel

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class EvalResult:
    """tau: committed tokens per verify round over all prompts (bonus included, as the paper counts)."""

    tau: float
    rounds: int
    generated_tokens: int
    histogram: dict[str, int]

    def to_dict(self) -> dict:
        return {"tau": round(self.tau, 4), "rounds": self.rounds, "generated_tokens": self.generated_tokens,
                "acceptance_histogram": self.histogram}


def evaluate_tau(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    drafter: DFlashDraftModel,
    prompts: list[list[int]],
    max_new_tokens: int,
) -> EvalResult:
    """Run every prompt through a SpeculativeEngine over the in-memory target and drafter."""
    was_training = drafter.training
    drafter.eval()
    target = TargetModel(model, drafter.config.target_layer_ids)
    local = LocalDrafter(drafter, target.embed_tokens, target.lm_head)
    engine = SpeculativeEngine(target, local, tokenizer, eos_ids(model), SchedulerConfig(verify_policy="full"))
    params = SamplingParams(max_new_tokens=max_new_tokens)
    histogram: Counter = Counter()
    rounds = generated = 0
    try:
        for ids in prompts:
            stats = engine.run(ids, params).stats
            histogram.update(stats.acceptance_histogram)
            rounds += stats.rounds
            generated += stats.generated_tokens
    finally:
        drafter.train(was_training)
    tau = sum(k * n for k, n in histogram.items()) / rounds if rounds else 0.0
    return EvalResult(tau, rounds, generated, {str(k): v for k, v in sorted(histogram.items())})


