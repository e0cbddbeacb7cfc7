"""How much each step drafts and verifies: decisions held against what they achieve.

Three choices ("arms") for a step's decoding sessions, four with drafters on devices of their own:
  full       every session drafts and verifies every proposal (what a batch-1 engine does)
  confident  every session drafts; the cost model keeps the proposals that pay (below)
  plain      nobody drafts: plain batched decoding
  piped      as full, with drafting beside verification (draft_pipeline.py): half the sessions verify
             while the other half's drafts are made, so only the drafting that is not hidden counts
For each batch-size bucket the policy keeps the goodput each arm really achieved (tokens committed
per session per step period, the whole loop included: drafting, the forward, commit, streaming; the
period counted in plain steps of as many sessions as measured at start-up, so batch sizes within a
bucket compare) and
goes with the best, trying the others in short bursts on a schedule, rarer for the
ones that lose by much (plain gets no burst while the best arm yields well over the yardstick's plain
step: its worth is known without one); an explored arm is judged on its last two bursts, so a change in what pays
(another batch mix, other prompts, a busier machine) is followed within a few bursts, and the best
changes only for an arm that beats it by MARGIN (a switch to drafting costs a drafter catch-up). A
batch size not seen before starts from the best arm of the nearest one, unless the cost model says
plain pays there (below); the cost model proposes; measurements decide.

A new batch size's start (of more than SMALL_BATCH sessions): drafting's yield is predicted as tau
(committed tokens per drafting session-step, as measured so far; TAU_PRIOR before any) over the time of
verifying every session's whole block (`cost_curve`) and drafting it (the drafter's time per token so
far, extrapolated linearly: batched drafting costs less per token, so this leans to plain; a drafter on
the target's device is priced at start-up, `measure_drafter_cost`, with its catch-up), plain's as
one token over a plain step (`batch_curve`). Where plain is predicted to yield more, the bucket starts
on plain and first tries drafting once what that burst is predicted to lose is EXPLORE_SHARE of the time
since: on this CPU a fresh service's first 16 streams started on full (no bucket near) and spent its
first eight steps at 150-190 ms each against a 25 ms plain step, 15% of a 9-second run.

The confident arm's model: verifying k proposals of session i commits, in expectation,
1 + sum_{j<=k} prod_{l<=j} p_il tokens, where p_il is how often the target accepted proposals to which
the drafter gave the probability of session i's l-th (AcceptanceCalibration, learnt as it runs).
A step of n packed tokens costs t(n), a curve measured on the device at start-up. Starting from one
token per session, proposals are added best first (highest prod p) while one more raises the step's
expected tokens per millisecond.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .drafter.protocol import Drafter, DraftRequest
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


def measure_batch_cost(target: TargetModel, max_sessions: int) -> CostCurve:
    """A plain decoding step's time against the sessions it decodes (one token each, 128 positions of
    context each), on its device: what the measured policy compares every arm's step period with."""
    context = min(128, target.max_positions // 2)
    scratch = target.new_cache(max_sessions * (context + 1), max_sessions)
    for i in range(max_sessions):
        scratch.reserve(f"b{i}", context + 1)
    target.forward(scratch, [ForwardItem(f"b{i}", (0,) * context, 0, last_only=True) for i in range(max_sessions)])

    def forward(n: int) -> None:
        for i in range(n):
            scratch.crop(f"b{i}", context)
        target.forward(scratch, [ForwardItem(f"b{i}", (0,), context) for i in range(n)])
        if target.device.type == "cuda":
            torch.cuda.synchronize()

    curve = measure_cost_curve(forward, max_sessions)
    log.info("plain step cost (sessions -> ms): %s", dict(zip(curve.tokens, (round(m, 2) for m in curve.ms))))
    return curve


def measure_drafter_cost(drafter: Drafter, width: int, dtype: torch.dtype, device: torch.device,
                         sessions: int, repeats: int = 3) -> tuple[float, float]:
    """A drafter's cost at start-up, on throwaway sessions: (ms per block token of a drafting step of
    `sessions` blocks, each over 128 positions of context; ms per session per context row it catches
    up on). Without it a fresh engine's first look at drafting in a big batch was priced with neither
    (the drafter unmeasured until it first drafted): at 16 streams on this 2-core CPU that look took 5
    steps of 170 ms against 21 ms plain ones, a quarter of a 3-second batch. `width`: the context
    features' width (num_features * the target's hidden size)."""
    block, ids = drafter.block_size, [f"cost-{i}" for i in range(sessions)]

    def call(rows: int, start: int) -> float:
        context = torch.zeros(rows, width, dtype=dtype, device=device)
        requests = [DraftRequest(sid, context, start, 0, block, restart=start == 0) for sid in ids]
        t0 = time.perf_counter()
        drafter.draft_batch(requests)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000

    try:
        call(128, 0)
        at, steps, ups = 128, [], []
        for _ in range(repeats):
            steps.append(call(1, at))
            ups.append(call(33, at + 1))
            at += 34
        step_ms, up_ms = sorted(steps)[len(steps) // 2], sorted(ups)[len(ups) // 2]
    finally:
        for sid in ids:
            drafter.release(sid)
    per_token = step_ms / (sessions * block)
    per_row = max(up_ms - step_ms, 0.0) / (32 * sessions)
    log.info("drafter cost: %.4f ms per block token (%d sessions), %.4f ms per context row", per_token, sessions,
             per_row)
    return per_token, per_row


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


class AcceptanceCalibration:
    """How often the target accepted a proposal (the ones before it accepted) against the drafter's
    probability of it: counts per probability bin, starting from one half. The confident arm weighs
    proposals by these rates, not by the drafter's own probabilities: the demo drafter is right far more
    often than it says (a lone stream's proposals at p ~ 0.3 were accepted 12 in a row), and weighed by
    p the arm verified one token where every proposal would have been accepted."""

    BINS = 10
    HALF_LIFE = 2000  # proposals per bin: older counts are halved beyond it, so a drift is followed

    def __init__(self) -> None:
        self.accepted = torch.full((self.BINS,), 1.0, dtype=torch.float64)
        self.seen = torch.full((self.BINS,), 2.0, dtype=torch.float64)

    def __call__(self, probs: torch.Tensor) -> torch.Tensor:
        return (self.accepted / self.seen)[self._bins(probs)]

    def observe(self, probs: Sequence[torch.Tensor], verified: Sequence[int], accepted: Sequence[int]) -> None:
        """Each session's proposal probabilities, how many of them were verified, how many accepted: the
        accepted ones and the first rejected one are outcomes (what follows a rejection is not)."""
        seen, outcome = [], []
        for p, k, a in zip(probs, verified, accepted):
            n = min(a + 1, k)
            if n:
                seen.append(p[:n])
                outcome.append(torch.arange(n) < a)
        if not seen:
            return
        bins = self._bins(torch.cat(seen))
        self.seen += torch.bincount(bins, minlength=self.BINS)
        self.accepted += torch.bincount(bins, weights=torch.cat(outcome).double(), minlength=self.BINS)
        full = self.seen > self.HALF_LIFE
        self.seen[full] /= 2
        self.accepted[full] /= 2

    def _bins(self, probs: torch.Tensor) -> torch.Tensor:
        return (probs.double() * self.BINS).long().clamp(0, self.BINS - 1)


ARMS = ("full", "confident", "plain")
PIPED = "piped"  # an arm only for engines whose drafter runs apart (remote replicas)
EXPLORE_EVERY = 32  # steps on the best arm between explorations of another (x2, x4 after repeated losses)
# A plain burst is skipped while the best arm yields this many times what the start-up yardstick says a
# plain step does (a plain step is what the yardstick measured; under load it is slower, not faster).
PLAIN_CLEAR = 1 + 2 * 0.10
FIRST_LOOK = 8  # steps into a new batch size (or a new lone stream) before its other arms are first tried
SMALL_BATCH = 2  # sessions: a batch this small is looked at afresh when most of its sessions are new
BURST = 3  # measured steps per exploration (a drafting burst after plain steps runs one more: see _Bucket)
DRAFT_SAMPLE = 8  # session-steps a drafting burst measures at least (8 steps of a lone stream)
# The best arm's steps just before a burst, which the burst is held against: enough that a drafting
# arm's yield, which swings with how predictable the text is for a few tokens, averages over more
# than one hard or easy stretch (with 6, a lone stream went plain for a run of four hard tokens).
BESIDE = 16
CONFIRM = 6  # steps before an arm that looked better is tried again, to confirm it
KEEP = 2  # explorations of an arm averaged into its ratio to the best
EXPLORE_SHARE = 0.03  # of the time, what exploring arms that lose may cost
SMALL_BACKOFF = 8  # at most this many burst lengths between a small batch's drafting explorations
MARGIN = 0.10  # another arm replaces the best one when it measures this much better (switching costs)
# Committed tokens per drafting session-step before any is measured: 1 + 1/2 + 1/4 + ..., proposals
# accepted at AcceptanceCalibration's starting rate of one half.
TAU_PRIOR = 2.0
TAU_WEIGHT = 0.05  # of each step in the running tau and drafter cost (about the last 20 steps)


@dataclass(frozen=True)
class Decision:
    """One step's choice. `reason`: "best" (the arm measured best for this batch), "exploring"
    (measuring another arm)."""

    arm: str
    reason: str

    @property
    def drafts(self) -> bool:
        return self.arm != "plain"


@dataclass
class CatchUp:
    """What a drafter's catch-up costs per session and plain step since its last draft (the context
    rows it then takes in), as measured at the first step of drafting bursts after plain ones; None
    before any. One per policy: it is the drafter's cost, whatever the batch."""

    ms: float | None = None

    def observe(self, ms: float) -> None:
        self.ms = ms if self.ms is None else (self.ms + ms) / 2

    def gap(self, lost_ms: float, plain_ms: float, sessions: int) -> float:
        """Plain steps (of plain_ms) before a look at drafting that loses lost_ms besides its catch-up,
        so that the look, catch-up included, costs EXPLORE_SHARE of the time; inf where the catch-up per
        step alone costs more."""
        budget = EXPLORE_SHARE * plain_ms - (self.ms or 0.0) * sessions
        return lost_ms / budget if budget > 0 else float("inf")


class _Bucket:
    """One batch size bucket: its best arm, each other arm's measured ratio to it, the schedule.

    A burst of another arm is held against the best arm's steps just before it, not against an
    average over a long window: what a step yields drifts (contexts grow, text gets more or less
    predictable, the machine gets busier), and only steps close in time compare. The first step of a
    drafting burst after plain ones is its drafter's catch-up on all the context the plain steps made,
    a cost paid once per switch. In a batch of one or two it is left out of the ratio (MARGIN stands
    for it): counted in a burst of three it would keep drafting from ever winning back a stream it
    once lost (a lone stream whose text turns predictable after a hard start). In a bigger batch it
    counts: there it is every session's context since the last draft (16 streams after 250 plain
    steps: 418 ms, 25 plain steps), and a burst that won only without it switched 16 streams to full
    drafting for the last, most predictable tokens of their texts and kept them drafting into the
    hard start of the next ones (0.79x plain over the run)."""

    def __init__(self, best: str, arms: tuple[str, ...] = ARMS, small: bool = False,
                 catch_up: CatchUp | None = None) -> None:
        self.arms = arms
        self.small = small  # a batch of one or two: its yield is its own text's (see judge)
        self.steps = 0
        self.best = best
        self.beside: deque[tuple[float, float]] = deque(maxlen=BESIDE)  # (tokens per session * plain ms, ms)
        self.ratios: dict[str, deque[float]] = {a: deque(maxlen=KEEP) for a in arms}
        self.losses = dict.fromkeys(arms, 0)  # explorations in a row that lost to the best
        others = [a for a in arms if a != best]
        self.next_explore = {a: FIRST_LOOK + i * BURST for i, a in enumerate([*others, best])}
        self.burst: tuple[str, int] | None = None  # (arm, steps left to decide)
        self.warmup = False  # the burst's next measured step is its drafter's catch-up
        self.warmup_ms = 0.0  # a small batch's catch-up: left out of the ratio, not of what the burst cost
        self.measured: list[tuple[float, float]] = []  # the burst's steps, as measured
        self.last_drafted = 0  # the step that last drafted
        self.plain_run = 0  # plain steps before the burst's catch-up
        self.sessions = 1  # decoding at the burst's start
        self.catch_up = catch_up or CatchUp()  # the policy's, shared by its buckets

    def _look_gap(self, burst: list[tuple[float, float]], last: float, beside_ms: float) -> float:
        """Plain steps before drafting is looked at again in a bigger batch on plain, so that a look costs
        at most EXPLORE_SHARE of the time: what its steps lost, and its catch-up, which grows with every
        plain step before it (each session's context since its last draft: at 16 streams on a 2-core CPU
        1.4 ms per plain step of 15 ms). Where the catch-up alone takes more than the share, drafting is
        not looked at again in this batch: every look would cost more the later it came."""
        rest = burst[1:]
        if self.plain_run >= BESIDE:
            self.catch_up.observe(max(burst[0][1] - _mean_ms(rest), 0.0) / (self.plain_run * self.sessions))
        lost_ms = sum(m for _, m in rest) * max(1.0 - last, 0.0)
        return self.catch_up.gap(lost_ms, beside_ms, self.sessions)

    def ratio(self, arm: str) -> float | None:
        ratios = self.ratios[arm]
        return sum(ratios) / len(ratios) if ratios else None

    def measure(self, arm: str, value: float, ms: float) -> None:
        if arm == self.best and self.burst is None and not self.measured:
            self.beside.append((value, ms))
        elif self.warmup:
            self.warmup = False
            if self.small:
                self.warmup_ms = ms
            else:
                self.measured.append((value, ms))
        elif self.burst is not None or self.measured:
            self.measured.append((value, ms))

    def judge(self, arm: str) -> None:
        """A burst of `arm` has been measured: its ratio to the best arm beside it, when it is explored
        next, and a switch when the ratio, over the last explorations, beats the best by MARGIN."""
        burst, self.measured = self.measured, []
        measured = bool(burst and self.beside)
        if measured:
            self.ratios[arm].append(_rate(burst) / _rate(self.beside) if _rate(self.beside) else 1.0)
        last = self.ratios[arm][-1] if self.ratios[arm] else 1.0
        self.losses[arm] = self.losses[arm] + 1 if last <= 0.95 else 0
        gap = float(_explore_gap(last, self.losses[arm]))  # in steps of the explored arm
        if measured and _mean_ms(self.beside) > 0:
            # The gap is time, not steps: a burst of steps 6x as long as the best arm's waits 6x as many
            # of the best's (counted in steps, exploring drafting took a third of the time at 16
            # streams), and one 5x shorter a fifth (a drafting arm that won in a predictable stretch
            # kept 16 streams for seconds). And what a losing burst cost, its catch-up included, is
            # at most EXPLORE_SHARE of the time until the next one.
            beside_ms = _mean_ms(self.beside)
            burst_ms = sum(m for _, m in burst) + self.warmup_ms
            if not self.small and arm != "plain" and self.best == "plain" and len(burst) > 1:
                gap = max(gap * _mean_ms(burst[1:]) / beside_ms, self._look_gap(burst, last, beside_ms))
            elif not (self.small and arm != "plain" and last < 1):
                lost_ms = burst_ms * max(1.0 - last, 0.0)
                gap = max(gap * _mean_ms(burst) / beside_ms, lost_ms / EXPLORE_SHARE / beside_ms)
            else:
                # A lone stream's loss says how hard its text was for a few tokens, and its text
                # changes: serving_path's and the demo's prompts are hard for their first 20-40 tokens
                # (drafting steps commit 1-3 tokens) and predictable after (5-16). By the rule above a
                # first look that fell in the hard start waited past the stream's end (the demo's
                # prompt: tau 1.65-1.70 in 3 of 5 fresh engines, against 2.89 verifying every block).
                # Drafting is tried again after as long as it ran, twice as long after each loss in a
                # row, at most SMALL_BACKOFF times: a drafter that keeps losing is then run a ninth of
                # the time. Not in a bigger batch: its sessions average the text out, what scatters
                # there is the machine (through the service, 16 streams drafted at tau 2.5 and lost 20%
                # by it), and a drafting step costs up to six plain ones.
                gap = burst_ms * min(1 << max(self.losses[arm] - 1, 0), SMALL_BACKOFF) / beside_ms
        self.next_explore[arm] = self.steps + max(round(gap), CONFIRM) if gap < float("inf") else gap
        if self.best == "plain" and last <= 0.95:
            # Drafting lost here: the other drafting arms wait as long (one drafting burst of 16
            # sessions cost six plain steps, and three arms explored apart tripled that).
            for other in self.arms:
                if other not in ("plain", arm):
                    self.next_explore[other] = max(self.next_explore[other], self.next_explore[arm])
        # One burst alone switches only when it wins by much: at 8 streams a drafting burst measured
        # 1.1-1.3x plain where one session's text was predictable for a few steps, and kept the batch.
        # In a bigger batch, a tie goes to plain: drafting there costs what no step measures (sessions
        # drafting at their own pace end apart, and the stragglers finish in small batches: at 8 streams
        # full drafting matched plain step for step and lost 20% over the run by its tail), and going
        # plain costs no catch-up.
        needed = MARGIN if len(self.ratios[arm]) == KEEP else 3 * MARGIN
        if arm == "plain" and not self.small:
            needed -= MARGIN
        if measured and self.ratio(arm) > 1 + needed:
            switch = self.ratio(arm)
            for other in self.arms:  # ratios to the old best become ratios to the new one
                self.ratios[other] = deque((r / switch for r in self.ratios[other]), maxlen=KEEP)
            self.ratios[self.best].append(1 / switch)
            self.ratios[arm].clear()
            self.best, self.beside = arm, deque(burst[-BESIDE:], maxlen=BESIDE)


def _explore_gap(last: float, losses: int) -> int:
    """Steps on the best arm before an arm is explored again, from its last ratio to the best and how
    many explorations in a row it lost: soon when it looked better (to confirm it), backing off while
    it keeps losing. One loss is not many: a lone stream's text can be hard for its first tens of
    tokens and predictable after them."""
    if last > 1 + MARGIN:
        return CONFIRM
    return EXPLORE_EVERY * min(1 << max(losses - 1, 0), 4)


def _running(average: float | None, value: float) -> float:
    """An exponentially weighted running average (TAU_WEIGHT per value); the first value when none."""
    return value if average is None else average + TAU_WEIGHT * (value - average)


def _mean_ms(steps: Sequence[tuple[float, float]]) -> float:
    return sum(m for _, m in steps) / len(steps)


def _rate(steps: Sequence[tuple[float, float]]) -> float:
    ms = sum(m for _, m in steps)
    return sum(v for v, _ in steps) / ms if ms > 0 else 0.0


class MeasuredPolicy:
    """One engine's `verify_policy: adaptive`. Each step: `decide` (before drafting), `verify_lengths`
    (after), `step_ran` (after the forward and commit); `step_started` at every step's start closes the
    previous step's period; `idle` when the loop waited for work (that period measures nothing)."""

    def __init__(self, cost_curve: CostCurve, batch_curve: CostCurve | None = None,
                 arms: tuple[str, ...] = ARMS, drafter_cost: tuple[float, float] | None = None) -> None:
        self.arms = arms  # ARMS, plus PIPED for a drafter that runs apart
        self.cost_curve = cost_curve  # the forward's ms against packed tokens (the confident arm's model)
        self.batch_curve = batch_curve or cost_curve  # a plain step's ms against sessions (the yardstick)
        self.calibration = AcceptanceCalibration()
        self.catch_up = CatchUp()
        self.tau = TAU_PRIOR  # committed tokens per verified drafting session-step, running
        self.draft_ms_per_token: float | None = None  # the drafter's time per block token, running
        if drafter_cost is not None:  # measured at start-up (measure_drafter_cost): the first prices known
            self.draft_ms_per_token, self.catch_up.ms = drafter_cost
        self._buckets: dict[int, _Bucket] = {}
        self._open: tuple[_Bucket, str, float, float] | None = None  # bucket, arm, start, tokens per session

    def decide(self, num_decoding: int, fresh: int = 0, full_tokens: int | None = None,
               prefills: bool = False) -> Decision:
        """`fresh`: how many of the sessions decode for the first time; `full_tokens`: the tokens the step
        would verify with every proposal (each session's block), for a new batch size's start (None: no
        prediction, the nearest bucket's best arm); `prefills`: the step also prefills (it measures
        nothing, so no burst starts on it: one whose steps all prefilled was judged on nothing and
        looked at again 32 steps later, at 16 streams a catch-up each time). A batch of one or two is its
        own text's yield: when most of it is new, what its bucket measured was another text's (a lone
        stream after a burst of load learnt plain from the hardest straggler of that burst), and every
        other arm is looked at again within FIRST_LOOK steps. A bigger batch's mix averages over texts."""
        bucket = self._bucket(num_decoding, full_tokens)
        bucket.steps += 1
        decision = self._choose(bucket, num_decoding, fresh, prefills)
        if decision.drafts:
            bucket.last_drafted = bucket.steps
        return decision

    def _choose(self, bucket: _Bucket, num_decoding: int, fresh: int, prefills: bool) -> Decision:
        if num_decoding <= SMALL_BATCH and 2 * fresh >= num_decoding:
            for arm in bucket.arms:
                if arm != bucket.best:
                    bucket.next_explore[arm] = min(bucket.next_explore[arm], bucket.steps + FIRST_LOOK)
                    bucket.losses[arm] = 0  # the losses in a row were another text's
        if bucket.burst is not None:
            arm, left = bucket.burst
            if left > 0:
                bucket.burst = (arm, left - 1)
                return Decision(arm, "exploring")
            bucket.burst = None
            bucket.judge(arm)  # its last step was measured as this step started
        due = [a for a in bucket.arms if a != bucket.best and bucket.steps >= bucket.next_explore[a]]
        if not due or not bucket.beside or prefills:
            return Decision(bucket.best, "best")
        arm = min(due, key=bucket.next_explore.__getitem__)
        if arm == "plain" and _rate(bucket.beside) > PLAIN_CLEAR:
            # The yardstick is a plain step: the best arm's rate says what plain would be worth (1 / rate)
            # without a burst to measure it; looked at again soon, as looking costs nothing.
            bucket.next_explore[arm] = bucket.steps + CONFIRM
            return Decision(bucket.best, "best")
        catch_up = arm != "plain" and bucket.best == "plain"
        # A plain step commits one token per session, whatever the text: three measure it. A drafting
        # step's tokens swing with it (1 to 12 for a lone stream within a few steps): a burst of them
        # spans DRAFT_SAMPLE session-steps.
        steps = BURST if arm == "plain" else max(BURST, -(-DRAFT_SAMPLE // num_decoding))
        bucket.burst, bucket.measured, bucket.warmup, bucket.warmup_ms = (arm, steps - 1 + catch_up), [], catch_up, 0.0
        if catch_up:
            bucket.plain_run, bucket.sessions = bucket.steps - bucket.last_drafted, num_decoding
        return Decision(arm, "exploring")

    def verify_lengths(self, decision: Decision, probs: Sequence[torch.Tensor], base_tokens: int,
                       draft_ms: float) -> list[int]:
        """Proposals each session verifies: all of them (full), what the cost model finds worth its time
        (confident), none (plain)."""
        tokens = sum(p.numel() + 1 for p in probs)
        if decision.drafts and draft_ms > 0 and tokens:
            self.draft_ms_per_token = _running(self.draft_ms_per_token, draft_ms / tokens)
        if decision.arm == "confident":
            return choose_verify_lengths([self.calibration(p) for p in probs], base_tokens, self.cost_curve, draft_ms)
        return [p.numel() if decision.drafts else 0 for p in probs]

    def verified(self, probs: Sequence[torch.Tensor], lengths: Sequence[int], accepted: Sequence[int]) -> None:
        """What the target accepted of what it verified (for the confident arm's calibration)."""
        if any(lengths):
            self.calibration.observe(probs, lengths, accepted)
            drafted = [a + 1 for k, a in zip(lengths, accepted) if k]
            self.tau = _running(self.tau, sum(drafted) / len(drafted))

    def step_started(self, now: float) -> None:
        if self._open is not None:
            bucket, arm, start, value = self._open
            bucket.measure(arm, value, (now - start) * 1000)
        self._open = None

    def step_ran(self, decision: Decision, start: float, num_decoding: int, emitted: int,
                 prefill_tokens: int) -> None:
        """A decoding step's outcome, measured when the next step starts, as tokens per session per
        plain step of as many sessions (`batch_curve`, measured at start-up): batches of different
        sizes in one bucket then compare, and a drafting arm's ragged ends (sessions finishing at
        different steps) are not mistaken for speed. A step that prefills is not what
        an arm costs and is not measured; the first step of a drafting arm after plain ones is (its
        drafter catches up on their context: part of what switching to it costs)."""
        if num_decoding and not prefill_tokens:
            plain_ms = self.batch_curve(num_decoding)
            self._open = (self._bucket(num_decoding), decision.arm, start, emitted / num_decoding * plain_ms)

    def idle(self) -> None:
        """The loop waited for work: the steps before are another set of texts' (at another point of
        them), which what comes next must not be held against."""
        self._open = None
        for bucket in self._buckets.values():
            bucket.beside.clear()

    def best(self, num_decoding: int) -> tuple[str, dict[str, float | None]]:
        """The best arm at this batch and each other arm's measured ratio to it, for metrics and tests."""
        bucket = self._bucket(num_decoding)
        return bucket.best, {a: bucket.ratio(a) for a in bucket.arms if a != bucket.best}

    def _bucket(self, num_decoding: int, full_tokens: int | None = None) -> _Bucket:
        """A new batch size starts from the best arm of the nearest one measured (full when none), or on
        plain where the cost model predicts that plain yields more (see the module's docstring)."""
        key = 1 << max(num_decoding - 1, 0).bit_length()  # 1, 2, 4, 8, 16, ...
        bucket = self._buckets.get(key)
        if bucket is None:
            near = min(self._buckets, key=lambda k: abs(k.bit_length() - key.bit_length()), default=None)
            best = self._buckets[near].best if near is not None else ARMS[0]
            predicted = self._predicted_drafting(num_decoding, full_tokens)
            # Only above SMALL_BATCH: in a batch of one or two a drafting step costs two or three plain
            # ones, so a first look costs little, and the prediction's tau (the prior, or another
            # batch's) is not its text's: a fresh engine's lone stream started on plain and stayed there.
            # Above it, a batch starts on plain unless drafting is predicted to win by MARGIN (a tie
            # goes to plain: see _Bucket.judge).
            starts_plain = predicted is not None and predicted < 1 + MARGIN and key > SMALL_BATCH
            bucket = self._buckets[key] = _Bucket("plain" if starts_plain else best, self.arms,
                                                  small=key <= SMALL_BATCH, catch_up=self.catch_up)
            if starts_plain:
                plain_ms = self.batch_curve(num_decoding)
                lost_ms = (BURST + 1) * self._drafting_ms(full_tokens) * max(1 - predicted, 0.0)  # + catch-up
                gap = self.catch_up.gap(lost_ms, plain_ms, num_decoding)
                first = max(FIRST_LOOK, round(gap)) if gap < float("inf") else gap
                for arm in bucket.arms:
                    if arm != "plain":
                        bucket.next_explore[arm] = max(bucket.next_explore[arm], first)
        return bucket

    def _predicted_drafting(self, num_decoding: int, full_tokens: int | None) -> float | None:
        """The cost model's drafting yield over plain's at this batch: tau over the time of drafting and
        verifying full_tokens (the drafter's time per token as measured so far, none before), against
        one token over a plain step of as many sessions; None without full_tokens."""
        if not full_tokens or full_tokens <= num_decoding:
            return None
        return self.tau * self.batch_curve(num_decoding) / self._drafting_ms(full_tokens)

    def _drafting_ms(self, full_tokens: int) -> float:
        return self.cost_curve(full_tokens) + (self.draft_ms_per_token or 0.0) * full_tokens
