"""The settings of `dflash demo build`: one frozen recipe, with the shipped demo pair's settings as defaults.

The shipped pair (services/dflash/assets/demo) came from a longer path of runs than this one recipe:
each model was trained in several runs, each from the weights of the one before, on data added as the
runs went (its manifest's `history`; docs/training.md tells it). The defaults put that path's end point
into one run per model: the shipped models' shapes and losses, the union of the data they were trained
on, and the optimizer steps of the runs that led to them, added up. The comments name the source of each.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Corpus:
    """The prompts the target completes for the drafter's data, and the held-out evaluation prompts."""

    # At def/class lines of the training modules, every distinct one (a cap: CPython 3.11's hold 15878;
    # history: data-more).
    definition_prompts: int = 20000
    # At def/class lines of the stdlib's test suites and tools, which the target never trains on
    # (history: data-unseen).
    unseen_prompts: int = 6000
    # At other lines of the same files: text the definition-start prompts never begin with (history:
    # data-fresh 12000 + data-fresh2 16000 + the 12000 of data-fresh3 the shipped drafter trained on).
    midfile_prompts: int = 40000
    # From the 12 held-out modules, for the drafter's held-out tau and the eval stage (history: all).
    eval_prompts: int = 24
    prompt_chars: int = 300
    # The tokenizer and the target read the first N training files (None: all of them, as shipped).
    max_files: int | None = None


@dataclass(frozen=True)
class LM:
    """A Qwen3 causal LM trained from scratch by dflash.demo.pretrain (the target and the AR draft)."""

    hidden_size: int = 256
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    steps: int = 800
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 1.5e-3
    warmup: int = 80
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    eval_windows: int = 64


@dataclass(frozen=True)
class Drafter:
    """`dflash train` settings of the DFlash drafter."""

    layers: int = 3  # the shipped drafter (history: drafter-grow3 grew drafter-fresh's 2 layers to 3)
    target_layer_ids: tuple[int, ...] = (1, 3, 5)  # history: drafter-spread moved them from 1, 2, 3
    block_size: int = 16
    # The shipped drafter's path: 3000 + 2500 + 2600 + 2734 + 2400 + 2100 + 1500 = 16834 steps.
    steps: int = 16800
    batch_size: int = 8
    max_length: int = 384
    max_anchors: int = 48
    lr: float = 1.5e-3  # the first run's (from a random init; the runs that continued it used 1e-3)
    gamma: float = 4.0  # every run since drafter-more
    distill_weight: float = 0.5  # every run since drafter-extended
    eval_max_new_tokens: int = 96  # the held-out tau every run was judged by


@dataclass(frozen=True)
class Recipe:
    """Everything `dflash demo build` trains with; `threads` and paths are not part of it."""

    seed: int = 0
    vocab_size: int = 4096
    corpus: Corpus = Corpus()
    # The shipped target: 6.8M parameters, 800 steps x 32 x 256 tokens (history: target).
    target: LM = LM()
    regen_max_new_tokens: int = 256
    regen_batch_size: int = 32
    drafter: Drafter = Drafter()
    # The shipped AR draft: 2 layers, 3.7M parameters. Steps: its path, 4000 + 4400 + 4700 + 3800 + 3600;
    # each of those runs took the wall time of the drafter run beside it (one core each), the same budget.
    # lr and warmup: the first run's.
    ar_draft: LM = LM(layers=2, steps=20500, batch_size=16, lr=2e-3, warmup=40, eval_windows=32)
    eval_max_new_tokens: int = 128

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def scaled(self, budget: float) -> Recipe:
        """The recipe with --budget applied: the number of prompts of each kind (not the evaluation
        prompts), the optimizer steps of the target, the drafter and the AR draft, and the target's and AR
        draft's warmup steps, each times `budget` (rounded, at least 1). The drafter's warmup is a share of
        its steps, so it follows. Model shapes, batch sizes, sequence lengths, learning rates and the
        evaluation stay as they are."""
        if budget == 1:
            return self

        def times(n: int) -> int:
            return max(1, round(n * budget))

        def lm(m: LM) -> LM:
            return dataclasses.replace(m, steps=times(m.steps), warmup=times(m.warmup))

        c = self.corpus
        return dataclasses.replace(
            self,
            corpus=dataclasses.replace(c, definition_prompts=times(c.definition_prompts),
                                       unseen_prompts=times(c.unseen_prompts),
                                       midfile_prompts=times(c.midfile_prompts)),
            target=lm(self.target), ar_draft=lm(self.ar_draft),
            drafter=dataclasses.replace(self.drafter, steps=times(self.drafter.steps)),
        )


# --quick: every stage on tiny models and data, end to end in about 2 minutes on 2 CPU cores. It checks the
# recipe, not the method: its drafter is barely trained.
QUICK = Recipe(
    vocab_size=1024,
    corpus=Corpus(definition_prompts=48, unseen_prompts=16, midfile_prompts=32, eval_prompts=4, max_files=40),
    target=LM(hidden_size=64, layers=4, heads=2, kv_heads=1, head_dim=32, intermediate_size=128, steps=100,
              batch_size=16, seq_len=128, lr=3e-3, warmup=10, eval_windows=8),
    regen_max_new_tokens=48,
    regen_batch_size=32,
    drafter=Drafter(layers=1, target_layer_ids=(1, 2), steps=24, max_length=192, max_anchors=8,
                    eval_max_new_tokens=24),
    ar_draft=LM(hidden_size=64, layers=1, heads=2, kv_heads=1, head_dim=32, intermediate_size=128, steps=40,
                batch_size=8, seq_len=128, lr=3e-3, warmup=4, eval_windows=8),
    eval_max_new_tokens=24,
)


def first_difference(saved: dict, now: dict, prefix: str = "") -> str | None:
    """The first setting that differs between two `Recipe.to_dict()`s, as 'path: saved -> now'."""
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_difference(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key}: {a!r} -> {b!r}"
    return None
