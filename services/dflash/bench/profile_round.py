"""Where one DFlash round's time goes, measured around the engine's public calls.

One session runs alone through the real engine (`submit`, then `step`: after its prefill, each step
is one round of that session). Timers wrap the calls a step makes on its parts (the drafter's
`draft_batch`, the target's `forward`, the cache's `crop`, the engine's feature queue) and forward
hooks time the networks inside them. The pure acceptance functions are timed again on the round's
own tensors. What no timer covers is Python overhead: scheduling, statistics, stop handling, text
decoding, the loop itself.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine import SpeculativeEngine
from ..errors import DFlashError
from ..generation import Generation, RoundOutput
from ..params import SamplingParams
from ..rounds import accept_length, committed_tokens
from ..sampling import sample_tokens

if TYPE_CHECKING:
    from torch import nn

PARTS = (
    ("draft_forward", "draft forward (drafter layers)"),
    ("draft_head", "draft LM head"),
    ("draft_io", "draft input/argmax/copy"),
    ("features", "context-feature transfer (gather, queue)"),
    ("verify_forward", "verify forward (target, block)"),
    ("acceptance", "posterior + acceptance"),
    ("trim", "cache trimming"),
    ("python", "Python overhead (rest of the round)"),
)


@dataclass(frozen=True)
class RoundProfile:
    block_size: int
    rounds: int  # rounds averaged (the fastest 75% of those run)
    round_ms: float
    parts_ms: dict[str, float]  # mean per part; the parts add up to round_ms
    committed_per_round: float
    target_step_ms: float | None  # one target-only round (block 1), when a baseline engine was given
    draft_confidence: float
    verified_per_round: float  # tokens the target verified per round (the last token + the drafts)

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "draft_confidence": self.draft_confidence,
                "verified_per_round": round(self.verified_per_round, 3),
                "rounds": self.rounds, "round_ms": round(self.round_ms, 3),
                "parts_ms": {k: round(v, 3) for k, v in self.parts_ms.items()},
                "committed_per_round": round(self.committed_per_round, 3),
                "target_step_ms": None if self.target_step_ms is None else round(self.target_step_ms, 3)}


class _Timers:
    """Instance-level timing wrappers and forward hooks, all removed by `close`."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.phase = None
        self.last: dict[str, object] = {}  # the latest return value of each wrapped call
        self._undo = []

    def wrap(self, obj: object, name: str, key: str, phase: str | None = None) -> None:
        inner = getattr(obj, name)

        def timed(*args: object, **kwargs: object) -> object:
            outer, t0 = self.phase, time.perf_counter()
            self.phase = phase or outer
            try:
                self.last[key] = result = inner(*args, **kwargs)
                return result
            finally:
                self.acc[key] += time.perf_counter() - t0
                self.phase = outer

        setattr(obj, name, timed)
        self._undo.append(lambda: delattr(obj, name))

    def hook(self, module: nn.Module, key: str, only_in: str | None = None) -> None:
        started = []

        def pre(*_: object) -> None:
            started.append(time.perf_counter())

        def post(*_: object) -> None:
            t0 = started.pop()
            if only_in is None or self.phase == only_in:
                self.acc[key] += time.perf_counter() - t0

        for handle in (module.register_forward_pre_hook(pre), module.register_forward_hook(post)):
            self._undo.append(handle.remove)

    def take(self) -> dict[str, float]:
        out, self.acc = dict(self.acc), defaultdict(float)
        return out

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def profile_round(engine: SpeculativeEngine, prompt_ids: list[int], block_size: int, rounds: int = 24,
                  warmup: int = 3, baseline: SpeculativeEngine | None = None,
                  draft_confidence: float = 0.0) -> RoundProfile:
    """Time of each part of `rounds` greedy rounds (after `warmup`) on one prompt; see `_summarize`.

    The engine (and the baseline) must be idle: a step runs every running session, and the profile
    is of one session's round. One session goes through `submit` and `step`; each step after its
    prefill is one round, whose RoundStats come from the session's outbox. Afterwards the session is
    gone from the engine, its target cache and the drafter, and every timer is removed.
    """
    _check_idle(engine)
    params = SamplingParams(max_new_tokens=(rounds + warmup + 1) * block_size, block_size=block_size,
                            ignore_eos=True, draft_confidence=draft_confidence)
    gen = engine.start(prompt_ids, params)
    engine.submit(gen)
    timers = _Timers()
    samples = []
    try:
        prefill_one(engine, gen)
        timers.wrap(engine.drafter, "draft_batch", "draft", phase="draft")
        timers.wrap(engine.target, "forward", "verify", phase="verify")
        timers.wrap(engine.cache, "crop", "trim")
        timers.wrap(engine, "_kept_features", "queue")
        timers.hook(engine.target.model, "verify_forward", only_in="verify")
        model = getattr(engine.drafter, "model", None)
        if model is not None:  # a drafter in this process (a remote one's time is all draft_io)
            if hasattr(model, "forward_packed"):  # what draft_batch runs: a method, not the module's __call__
                timers.wrap(model, "forward_packed", "draft_forward")
            else:
                timers.hook(model, "draft_forward", only_in="draft")
            timers.hook(engine.target.lm_head, "draft_head", only_in="draft")
        for i in range(warmup + rounds):
            if gen.done:
                break
            position = gen.position
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            out = _one_round(gen)
            acc = timers.take()
            acc["acceptance"] = _acceptance_seconds(timers.last, gen.params, gen.seed, position + 1,
                                                    out.stats.draft_tokens)
            if i >= warmup:
                samples.append((wall, acc, out.stats.committed, out.stats.draft_tokens + 1))
    finally:
        timers.close()
        engine.cancel(gen)
    if not samples:
        raise DFlashError(f"profile: no round after {warmup} warm-up rounds; ask for more rounds")
    step_ms = _target_step_ms(baseline, prompt_ids, rounds) if baseline else None
    return _summarize(block_size, draft_confidence, samples, step_ms)


def _check_idle(engine: SpeculativeEngine) -> None:
    if engine.num_running or engine.num_waiting:
        raise DFlashError(f"profile: the engine has {engine.num_running} running and {engine.num_waiting} waiting "
                          "requests; profile an idle engine (a step runs every session)")


def prefill_one(engine: SpeculativeEngine, gen: Generation) -> None:
    """Step until the session's prompt is in the cache and its first token is out (untimed)."""
    while not gen.output_ids:
        if gen.error is not None:
            raise gen.error
        if not engine.step():
            raise DFlashError("profile: the engine did not admit the request (cache budget?)")
    gen.outbox.clear()


def _one_round(gen: Generation) -> RoundOutput:
    """The round the last step produced for `gen` (exactly one: the engine ran that session alone)."""
    if gen.error is not None:
        raise gen.error
    if len(gen.outbox) != 1:
        raise DFlashError(f"profile: a step produced {len(gen.outbox)} rounds for the session, expected one")
    return gen.outbox.popleft()


def _acceptance_seconds(last: dict, params: SamplingParams, seed: int, position: int, verified: int) -> float:
    """The round's sampling of the posterior and acceptance, timed again on its own tensors."""
    t0 = time.perf_counter()
    posterior = sample_tokens(last["verify"][0].logits, params, seed, position).cpu()
    draft = last["draft"][0].tokens[:verified].to("cpu")
    committed_tokens(draft, posterior, accept_length(draft, posterior))
    return time.perf_counter() - t0


def _summarize(block_size: int, draft_confidence: float, samples: list[tuple[float, dict[str, float], int, int]],
               target_step_ms: float | None) -> RoundProfile:
    """Mean of each part over the fastest 75% of rounds: parts add up to the round, and a round
    that a background process interrupted does not count."""
    kept = sorted(samples, key=lambda s: s[0])[: max(1, (3 * len(samples) + 3) // 4)]
    parts = defaultdict(list)
    for wall, acc, *_ in kept:
        p = {
            "draft_forward": acc.get("draft_forward", 0.0),
            "draft_head": acc.get("draft_head", 0.0),
            "verify_forward": acc.get("verify_forward", 0.0),
            "trim": acc.get("trim", 0.0),
            "acceptance": acc["acceptance"],
        }
        p["draft_io"] = acc.get("draft", 0.0) - p["draft_forward"] - p["draft_head"]
        # target.forward beyond the network (packing, hidden-state gather) + queueing the features
        p["features"] = (acc.get("verify", 0.0) - p["verify_forward"]) + acc.get("queue", 0.0)
        p["python"] = (wall - acc.get("draft", 0.0) - acc.get("verify", 0.0) - acc.get("queue", 0.0) - p["trim"]
                       - p["acceptance"])
        for k, v in p.items():
            parts[k].append(1000 * v)
    means = {k: statistics.fmean(parts[k]) for k, _ in PARTS}
    return RoundProfile(block_size, len(kept), statistics.fmean(1000 * s[0] for s in kept), means,
                        statistics.fmean(s[2] for s in samples), target_step_ms, draft_confidence,
                        statistics.fmean(s[3] for s in samples))


def _target_step_ms(baseline: SpeculativeEngine, prompt_ids: list[int], rounds: int) -> float:
    """One target-only round (block 1) of the baseline engine, the same way: one session, step by step."""
    _check_idle(baseline)
    gen = baseline.start(prompt_ids, SamplingParams(max_new_tokens=rounds + 8, block_size=1, ignore_eos=True))
    baseline.submit(gen)
    try:
        prefill_one(baseline, gen)
        times = []
        for _ in range(rounds + 3):
            if gen.done:
                break
            t0 = time.perf_counter()
            baseline.step()
            times.append(1000 * (time.perf_counter() - t0))
            _one_round(gen)
        times = sorted(times[3:] or times)
        return statistics.fmean(times[: max(1, (3 * len(times) + 3) // 4)])
    finally:
        baseline.cancel(gen)


def format_profile(p: RoundProfile, tau: float | None = None) -> str:
    """The breakdown as a Markdown table, then what it implies."""
    total = sum(p.parts_ms.values()) or 1.0
    cut = f", draft confidence {p.draft_confidence:g}" if p.draft_confidence else ""
    lines = [f"| part of one round (block {p.block_size}{cut}, {p.verified_per_round:.1f} tokens verified, "
             f"mean of {p.rounds}) | ms | share |", "|---|---|---|"]
    for key, label in PARTS:
        lines.append(f"| {label} | {p.parts_ms[key]:.2f} | {100 * p.parts_ms[key] / total:.0f}% |")
    lines.append(f"| **round** | **{p.round_ms:.2f}** | |")
    notes = ["", "The drafter's own cache holds only committed context, so it has nothing to trim."]
    biggest = max(PARTS, key=lambda kv: p.parts_ms[kv[0]])
    notes.append(f"Largest part: {biggest[1]} ({100 * p.parts_ms[biggest[0]] / total:.0f}% of the round).")
    if p.target_step_ms:
        rel = p.round_ms / p.target_step_ms
        at_tau = f" = {tau / rel:.2f}x at the measured tau {tau:.2f}." if tau else "."
        notes.append(f"A target-only round costs {p.target_step_ms:.2f} ms; a DFlash round costs {rel:.2f}x that, "
                     f"so speedup = tau / {rel:.2f}{at_tau}")
        if tau:
            notes.append(f"For a 3x speedup at tau {tau:.2f}, the round must cost at most {tau / 3:.2f}x "
                         "a target step.")
    return "\n".join(lines + notes)
