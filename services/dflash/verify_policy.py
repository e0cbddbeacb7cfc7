"""How many draft tokens each session verifies this step: speculation that never loses under load.

Verifying k proposals of session i commits, in expectation, 1 + sum_{j<=k} prod_{l<=j} p_il tokens,
where p_il is the drafter's probability of its l-th proposal. A step of n packed tokens costs t(n),
a curve measured on the real device at start-up. Starting from plain batched decoding (k = 0 for
everyone, one token each), proposals are added best first (highest prod p) while adding one raises
the step's expected tokens per millisecond; with a flat cost curve (a GPU at small batch) every
proposal is verified, with a steep one (a CPU, a big batch) few or none are.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .target import ForwardItem, TargetModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostCurve:
    """Milliseconds of one target forward against the tokens it packs: measured points, interpolated
    linearly (and extrapolated from the last two points), made non-decreasing."""

    tokens: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        running, fixed = 0.0, []
        for m in self.ms:
            running = max(running, m)
            fixed.append(running)
        object.__setattr__(self, "ms", tuple(fixed))

    def __call__(self, n: int) -> float:
        xs, ys = self.tokens, self.ms
        if len(xs) == 1 or n <= xs[0]:
            return ys[0] * min(max(n, 1) / xs[0], 1.0) if len(xs) > 1 else ys[0] * max(n, 1) / xs[0]
        i = min(bisect.bisect_left(xs, n), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    @classmethod
    def flat(cls) -> CostCurve:
        """Verification is free: the policy then verifies every proposal."""
        return cls((1, 1 << 20), (1.0, 1.0))


def measure_cost_curve(forward: Callable[[int], None], max_tokens: int, repeats: int = 3) -> CostCurve:
    """Time `forward(n)` (one packed target forward of n tokens) at powers of two up to max_tokens; the
    median of `repeats` after one warm-up each."""
    points = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, max_tokens} & set(range(1, max_tokens + 1)))
    ms = []
    for n in points:
        forward(n)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward(n)
            times.append((time.perf_counter() - t0) * 1000)
        ms.append(sorted(times)[len(times) // 2])
    return CostCurve(tuple(points), tuple(ms))


def measure_target_cost(target: TargetModel, max_step_tokens: int) -> CostCurve:
    """A target's forward time against packed tokens, on its device, on a throwaway cache holding 128
    positions of context (as a decoding session's would)."""
    context = min(128, target.max_positions // 2)
    most = min(max_step_tokens, target.max_positions - context - 1)
    scratch = target.new_cache(context + most)
    scratch.reserve("cost", context + most)
    target.forward(scratch, [ForwardItem("cost", (0,) * context, 0, last_only=True)])

    def forward(n: int) -> None:
        scratch.crop("cost", context)
        target.forward(scratch, [ForwardItem("cost", (0,) * n, context)])
        if target.device.type == "cuda":
            torch.cuda.synchronize()

    curve = measure_cost_curve(forward, max(most, 1))
    log.info("target cost curve (tokens -> ms): %s", dict(zip(curve.tokens, (round(m, 2) for m in curve.ms))))
    return curve


def choose_verify_lengths(probs: Sequence[torch.Tensor], base_tokens: int, cost: CostCurve,
                          fixed_ms: float = 0.0) -> list[int]:
    """For each session's proposal probabilities (a tensor [k_i], possibly empty), how many leading
    proposals to verify, given that the step already packs `base_tokens` tokens (one per decoding
    session plus any prefill chunks) and costs `fixed_ms` besides the target forward (drafting, and
    the per-round work of the engine and of the service around it, which verifying more does not add to)."""
    gains = [torch.cumprod(p.double(), 0).tolist() if p.numel() else [] for p in probs]
    best_first = _best_first(gains)
    return _verify_lengths(best_first, len(probs), _step_ms(cost, base_tokens, len(best_first), fixed_ms))[0]


def _best_first(gains: Sequence[Sequence[float]]) -> list[tuple[float, int]]:
    """Every proposal as (-expected gain, session), best first. A session's gains never increase along
    its block (a running product of probabilities), so this order verifies each session's proposals
    from its first on: it is the order of adding them one at a time, always the best next one."""
    return sorted((-g, i) for i, session in enumerate(gains) for g in session)


def _step_ms(cost: CostCurve, base_tokens: int, most: int, fixed_ms: float) -> list[float]:
    """[cost(base_tokens + j) + fixed_ms for j in 0..most + 1]: the scan below reads it instead of
    interpolating the curve twice per proposal."""
    return [cost(base_tokens + j) + fixed_ms for j in range(most + 2)]


def _verify_lengths(best_first: Sequence[tuple[float, int]], num_sessions: int,
                    step_ms: Sequence[float]) -> tuple[list[int], float]:
    """Take proposals best first while one more raises the step's expected tokens per millisecond
    (step_ms[j]: the step's time with j proposals verified); each decoding session commits at least
    its bonus token. -> (lengths, expected gain over plain decoding)."""
    lengths = [0] * num_sessions
    expected = float(num_sessions)
    for j, (neg_gain, i) in enumerate(best_first):
        if (expected - neg_gain) * step_ms[j] <= expected * step_ms[j + 1]:
            break  # the best remaining proposal no longer pays for the time it adds
        expected -= neg_gain
        lengths[i] += 1
    return lengths, expected - num_sessions


class DraftCost:
    """Milliseconds of one drafter call against the sessions it drafts, learned from the calls made
    (local or remote alike): per power-of-two bucket, the median of the last few calls (one warm-up or
    stall does not move it; the fastest would be optimistic where the cores are shared), interpolated;
    0 before any call, so sessions draft until the first calls have been timed. Past the largest bucket
    timed, the cost is taken as that bucket's (optimistic): one batched call is then tried and timed,
    instead of never drafting a batch because a lone session's cost, extrapolated linearly, looked
    prohibitive (a batched drafter forward costs far less than one per session)."""

    def __init__(self, window: int = 5) -> None:
        self.window = window
        self._ms: dict[int, deque[float]] = {}

    def observe(self, sessions: int, ms: float) -> None:
        if sessions < 1:
            return
        bucket = 1 << (sessions - 1).bit_length()
        # scaled to the bucket's size: the cost grows about linearly within it
        self._ms.setdefault(bucket, deque(maxlen=self.window)).append(ms * bucket / sessions)

    def __call__(self, sessions: int) -> float:
        if sessions < 1 or not self._ms:
            return 0.0
        points = sorted((x, _median(ys, 0.0)) for x, ys in self._ms.items())
        if sessions >= points[-1][0]:
            return points[-1][1]
        return CostCurve(tuple(x for x, _ in points), tuple(y for _, y in points))(sessions)


def acceptance_rate(accepted: float, rejected: float) -> float:
    """The per-token acceptance chance of a session's drafts, from its (decayed) counts of accepted
    proposals and of rounds cut short by a rejection (the geometric model's estimate)."""
    return accepted / (accepted + rejected)


def choose_drafted(rates: Sequence[float], max_drafts: Sequence[int], base_tokens: int, cost: CostCurve,
                   draft_cost: DraftCost, fixed_ms: float = 0.0, margin: float = 0.0) -> list[bool]:
    """Which sessions to draft this step, before drafting: the sessions most likely to be accepted
    first, as many as make the step's expected tokens per millisecond highest (none: plain decoding).

    rates: each session's per-token acceptance chance; max_drafts: the most proposals it may verify
    (0 where it cannot draft). Expected tokens use the geometric model: k proposals give
    sum_{j<=k} rate^j more than plain decoding. fixed_ms: see `choose_verify_lengths`. margin: by how
    much (relative) drafting must beat plain decoding: the model's own error, so that where speculation
    is only predicted to break even, an error does not make it lose.
    Plain floats, no tensors: this runs before every step, for every session.
    """
    order = sorted((i for i, m in enumerate(max_drafts) if m > 0), key=lambda i: -rates[i])
    best, best_rate = 0, len(rates) / (cost(base_tokens) + fixed_ms) * (1.0 + margin)
    proposals: list[tuple[float, int]] = []  # the first m sessions' proposals, best first
    forward_ms = _step_ms(cost, base_tokens, sum(max_drafts[i] for i in order), 0.0)
    for m, i in enumerate(order, start=1):
        gain = 1.0
        for _ in range(max_drafts[i]):
            gain *= rates[i]
            bisect.insort(proposals, (-gain, i))
        extra_ms = fixed_ms + draft_cost(m)
        step_ms = [ms + extra_ms for ms in forward_ms[: len(proposals) + 2]]
        lengths, gained = _verify_lengths(proposals, len(rates), step_ms)
        rate = (len(rates) + gained) / step_ms[sum(lengths)]
        if rate > best_rate:
            best, best_rate = m, rate
    drafted = set(order[:best])
    return [i in drafted for i in range(len(rates))]


class StepCalibration:
    """What the start-up cost curve does not know, learned from the steps run. Each step's time beyond
    drafting is fitted (least squares over the last `window` steps) as

        scale * forward the curve predicts  +  overhead per round * sessions in the step

    `forward_scale`: how much slower (or faster) the forward runs now than when the curve was measured:
    on a CPU the rest of the service competes for the cores the forward runs on, which slows the forward
    in proportion to its size. `round_overhead_ms`: what each round costs whatever it verifies: sampling,
    committing and streaming it, and in a service the store write and the hops to the client.

    The two pull the policy opposite ways (a slower forward makes verified tokens dearer, a costly round
    makes rounds that commit several tokens worth more), so each must be charged where it belongs. When
    the steps do not tell them apart (every step the same shape), the scale stays 1 and the whole excess
    counts per round.
    """

    def __init__(self, window: int = 32) -> None:
        self._steps: deque[tuple[float, float, int]] = deque(maxlen=window)  # (forward predicted, ms, sessions)
        self._last: tuple[float, float, float, int] | None = None  # (start, draft ms, forward predicted, sessions)
        self._fit: tuple[float, float, float] | None = (1.0, 0.0, 0.0)  # scale, per round, relative error

    def step_started(self, now: float) -> None:
        """At a step's start (perf_counter seconds): the previous step's period is now known."""
        if self._last is not None:
            start, draft_ms, forward_ms, sessions = self._last
            self._steps.append((forward_ms, max((now - start) * 1000 - draft_ms, 0.0), sessions))
            self._fit = None
        self._last = None

    def step_ran(self, start: float, draft_ms: float, predicted_verify_ms: float, sessions: int) -> None:
        """After a step's forward: its drafting time as measured, its forward as the curve predicts it."""
        self._last = (start, draft_ms, predicted_verify_ms, sessions) if sessions else None

    def idle(self) -> None:
        """The engine waited for work: the next step's period says nothing about the steps."""
        self._last = None

    @property
    def forward_scale(self) -> float:
        return self._fitted()[0]

    @property
    def round_overhead_ms(self) -> float:
        """Milliseconds per session per step beyond drafting and the (scaled) forward."""
        return self._fitted()[1]

    @property
    def relative_error(self) -> float:
        """The fit's typical error: the median of |measured - fitted| / measured over the window (0 before
        any step)."""
        return self._fitted()[2]

    def _fitted(self) -> tuple[float, float, float]:
        """Fitted once per step that adds to the window, whatever reads it how often."""
        if self._fit is None:
            scale, per_round = fit_step_time(self._steps)
            errors = deque(abs(y - scale * f - per_round * s) / y for f, y, s in self._steps if y > 0)
            self._fit = (scale, per_round, _median(errors, 0.0))
        return self._fit


def fit_step_time(steps: Sequence[tuple[float, float, int]]) -> tuple[float, float]:
    """(scale, per-session ms) fitting ms ~ scale * forward + per_session * sessions by least squares, the
    scale kept within [0.5, 4] and the per-session cost >= 0. When the steps are too alike to separate
    the two: (1, median excess per session), or (scale, 0) where the steps take less than the curve says."""
    if not steps:
        return 1.0, 0.0
    ff = sum(f * f for f, _, _ in steps)
    fs = sum(f * s for f, _, s in steps)
    ss = sum(s * s for _, _, s in steps)
    fy = sum(f * y for f, y, _ in steps)
    sy = sum(s * y for _, y, s in steps)
    det = ff * ss - fs * fs
    if len(steps) >= 4 and det > 1e-3 * ff * ss:
        scale = min(max((fy * ss - fs * sy) / det, 0.5), 4.0)
        per_session = (sy - scale * fs) / ss
        if per_session >= 0:
            return scale, per_session
        return min(max(fy / ff, 0.5), 4.0), 0.0
    ratio = fy / ff if ff > 0 else 1.0
    if ratio < 1.0:  # the forward runs faster than the curve says: nothing is left to charge per round
        return max(ratio, 0.5), 0.0
    excess = deque(max(y - f, 0.0) / s for f, y, s in steps)
    return 1.0, _median(excess, 0.0)


def _median(values: deque[float], default: float) -> float:
    """The median (the lower middle value of an even count); `default` when there are none."""
    if not values:
        return default
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


EXPLORE_EVERY = 8  # steps without any draft before one session drafts again (cost and acceptance move)
EXPLORE_AT_MOST_EVERY = 64  # ... doubling up to this while the explorations do not make drafting pay


class AdaptivePolicy:
    """One engine's `verify_policy: adaptive`, step by step: which sessions draft and how many of their
    proposals are verified, from the start-up cost curve, the drafter's cost learned from its calls and
    the per-round overhead learned from the steps (`StepCalibration`). The engine tells it what each step
    did; the decisions are the pure functions above."""

    def __init__(self, cost_curve: CostCurve) -> None:
        self.cost_curve = cost_curve
        self.draft_cost = DraftCost()
        self.calibration = StepCalibration()
        self._steps_without_draft = 0
        self._explore_every = EXPLORE_EVERY

    def overhead_ms(self, now: float, num_sessions: int) -> float:
        """At a step's start: the time this step will cost beyond drafting and the forward."""
        self.calibration.step_started(now)
        return self.calibration.round_overhead_ms * num_sessions

    def drafted(self, rates: Sequence[float], max_drafts: Sequence[int], waited: Sequence[int], base_tokens: int,
                overhead_ms: float) -> list[bool]:
        """`choose_drafted`, and when nobody has drafted for a while, the session that waited longest
        (`waited`: steps since each last drafted) drafts once, so its acceptance estimate and the drafter's
        cost stay current. The while is EXPLORE_EVERY steps, doubled (up to EXPLORE_AT_MOST_EVERY) after
        each exploration that still leaves drafting unpaid: a batch where speculation does not pay keeps
        paying for the explorations only rarely."""
        drafted = choose_drafted(rates, max_drafts, base_tokens, self._curve(), self.draft_cost, overhead_ms,
                                 margin=self.calibration.relative_error)
        if any(drafted):
            self._steps_without_draft, self._explore_every = 0, EXPLORE_EVERY
            return drafted
        self._steps_without_draft += 1
        if self._steps_without_draft >= self._explore_every:
            candidates = [i for i, m in enumerate(max_drafts) if m > 0]
            if candidates:
                drafted[max(candidates, key=lambda i: waited[i])] = True
                self._steps_without_draft = 0
                self._explore_every = min(2 * self._explore_every, EXPLORE_AT_MOST_EVERY)
        return drafted

    def drafter_ran(self, sessions: int, ms: float) -> None:
        self.draft_cost.observe(sessions, ms)

    def verify_lengths(self, probs: Sequence[torch.Tensor], base_tokens: int, fixed_ms: float) -> list[int]:
        return choose_verify_lengths(probs, base_tokens, self._curve(), fixed_ms)

    def step_ran(self, start: float, draft_ms: float, num_tokens: int, num_sessions: int) -> None:
        self.calibration.step_ran(start, draft_ms, self.cost_curve(num_tokens), num_sessions)

    def idle(self) -> None:
        self.calibration.idle()

    def _curve(self) -> CostCurve:
        """The start-up curve at the speed the forward runs now (`StepCalibration.forward_scale`)."""
        scale = self.calibration.forward_scale
        if scale == 1.0:
            return self.cost_curve
        return CostCurve(self.cost_curve.tokens, tuple(m * scale for m in self.cost_curve.ms))
