"""The DFlash engine: many requests, one step at a time: schedule, draft all, verify all in one forward,
accept and commit each.

A step reads like the paper's round, for every running session at once:
    plan = schedule()                     # who decodes, which prompt chunks are prefilled
    drafts = drafter.draft_batch(...)     # one drafter forward per replica for all decoding sessions
    k = verify lengths                    # adaptive: what pays at this batch on this device
    outs = target.forward(...)            # ONE packed forward: verify blocks + prefill chunks
    accept, commit, emit per session      # the pure round functions of rounds.py
    delivery.deliver(rounds)              # stored, then streamed (with the loop on: beside the next step)
With drafters on devices of their own (remote replicas), drafting runs beside verification instead of
before it: two cohorts of sessions take turns (draft_pipeline.py).
A single request is the same path with one session. In process, whichever request's stream needs output
next runs the step (under the engine's lock), for everyone; a server calls `start_loop()` and one
background thread steps while streams wait for their output.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from .delivery import StepDelivery
from .draft_pipeline import DraftPipeline, cohort_split
from .drafter.protocol import Draft, Drafter, DraftRequest
from .errors import DFlashError
from .generation import Generation, RoundOutput, wake
from .intake import RequestLimits, new_generation
from .journal import RoundJournal
from .params import SamplingParams
from .rounds import accept_length, committed_tokens
from .sampling import sample_rows
from .scheduler import Scheduler, SchedulerConfig, StepPlan
from .stats import GenerationStats, RoundStats
from .target import ForwardItem, PackedOutput, TargetModel, TargetOutput
from .verify_policy import (
    ARMS,
    PIPED,
    CostCurve,
    Decision,
    MeasuredPolicy,
    measure_batch_cost,
    measure_drafter_cost,
    measure_target_cost,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats


@dataclass
class StepReport:
    """What one step did, for metrics and traces (times from time.time_ns)."""

    start_ns: int
    end_ns: int
    draft_ms: float
    verify_ms: float
    num_tokens: int
    rounds: list[tuple[Generation, RoundOutput]] = field(default_factory=list)
    verify_lengths: list[int] = field(default_factory=list)
    prefill_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0


class StepObserver(Protocol):
    """Told about every step (metrics, tracing); called under the engine's lock, so keep it quick."""

    def step_scope(self) -> AbstractContextManager:
        """Entered around each step (a tracing span, say)."""
        ...

    def on_step(self, report: StepReport) -> None:
        """At the end of each step, inside its scope: every round it computed, before they are
        delivered (a round the journal then refuses, for a session taken over, is in it)."""
        ...

    def on_sessions(self, num_running: int, num_waiting: int) -> None:
        """After every step and every retirement of finished, failed or cancelled sessions (also when
        no step followed them): the running set and the queue as they now stand."""
        ...


class SpeculativeEngine:
    """Lossless speculative decoding of a target with a DFlash drafter (or none: block size 1)."""

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        eos_token_ids: Iterable[int] = (),
        config: SchedulerConfig = SchedulerConfig(),
        cost_curve: CostCurve | None = None,
        observer: StepObserver | None = None,
        journal: RoundJournal | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.limits = RequestLimits(target.vocab_size, target.max_positions, drafter.block_size if drafter else 0)
        self.config = config
        # Decode/verify steps as CUDA graphs where they can be: up to every session verifying a block.
        graph_tokens = min(config.max_step_tokens, config.max_running * (drafter.block_size if drafter else 1))
        graph_tokens = -(-graph_tokens // 16) * 16 if target.can_use_graphs else 0
        self.cache = target.new_cache(config.cache_tokens, config.max_running, spare_tokens=graph_tokens)
        if graph_tokens:
            target.capture_graphs(self.cache, config.max_running, graph_tokens)
        self.scheduler = Scheduler(config, self.cache)
        self.observer = observer
        self.journal = journal
        self.delivery = StepDelivery(journal, self._publish)
        # Two locks, so that a step in progress never makes a request wait to be queued or cancelled:
        # _lock is held for a whole step (one step at a time); _admission only for the short changes to
        # the scheduler's queue and running set. Streams wait on their own Generation.wakeup.
        self._lock = threading.RLock()
        self._admission = threading.Lock()
        self._work = threading.Event()  # set when a request arrives or is cancelled (the loop waits on it)
        self._loop: threading.Thread | None = None
        self.pipeline = DraftPipeline(drafter) if drafter is not None and _pipelined(config, drafter) else None
        self.policy: MeasuredPolicy | None = None  # None: every proposal is verified
        if config.verify_policy == "adaptive" and (cost_curve is not None or drafter is not None):
            # "auto": drafting beside verification is an arm, taken only where it measures better
            arms = (*ARMS, PIPED) if self.pipeline is not None and config.pipeline_drafts == "auto" else ARMS
            if cost_curve is None:
                cost_curve = measure_target_cost(target, config.max_step_tokens)
                # A drafter on the target's device is priced at start-up too; a remote one when it drafts.
                drafter_cost = None if drafter is None or drafter.separate_device else measure_drafter_cost(
                    drafter, len(target.layer_ids) * target.model.config.get_text_config().hidden_size,
                    target.model.dtype, target.model.device, min(config.max_running, 16))
                self.policy = MeasuredPolicy(cost_curve, measure_batch_cost(target, config.max_running), arms,
                                             drafter_cost)
            else:
                self.policy = MeasuredPolicy(cost_curve, arms=arms)

    # -- requests ---------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        committed_ids: list[int] | None = None,
        seed: int | None = None,
        trace_context: object = None,
        stream_interval_ms: float | None = None,
    ) -> Iterator[RoundOutput]:
        """Stream rounds: the prefill round (first token), then one per draft-and-verify round.

        Raises InvalidRequestError (a bad field) or QueueFullError at once, before the first round.
        """
        gen = self.start(prompt_ids, params, request_id, committed_ids, seed, stream_interval_ms)
        gen.trace_context = trace_context
        self.submit(gen)
        return self.stream(gen)

    def start(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        committed_ids: list[int] | None = None,
        seed: int | None = None,
        stream_interval_ms: float | None = None,
    ) -> Generation:
        """Validate a request and build its state (not yet queued); raises InvalidRequestError naming the field.

        To resume a request whose caches were lost, pass the tokens it already committed and the seed
        it used: generation continues exactly where it stopped (nothing repeated, nothing lost).
        `stream_interval_ms` overrides the engine's stream interval for this request (0: every round).
        """
        return new_generation(self.limits, prompt_ids, params, tokenizer=self.tokenizer,
                              eos_token_ids=self.eos_token_ids, request_id=request_id, committed_ids=committed_ids,
                              seed=seed, stream_interval_ms=stream_interval_ms)

    def submit(self, gen: Generation) -> None:
        """Queue a request for the step loop; QueueFullError when the queue is full."""
        reserve = min(len(gen.prompt_ids) + gen.params.max_new_tokens + gen.block_size, self.target.max_positions)
        with self._admission:
            self.scheduler.add(gen, reserve)
        self._work.set()

    def start_loop(self) -> None:
        """From now on, step in one background thread whenever there is work (a server with many
        streams): streams then wait for their output instead of taking turns at stepping."""
        with self._lock:
            if self._loop is None:
                self.delivery.run_beside()
                self._loop = threading.Thread(target=self._step_forever, daemon=True, name="dflash-engine-loop")
                self._loop.start()

    def _step_forever(self) -> None:
        while True:
            self._work.clear()
            if not (self.scheduler.running or self.scheduler.waiting):
                if self.policy is not None:
                    self.policy.idle()
                self._work.wait()
                continue
            try:
                if not self.step():
                    self._work.wait(0.05)  # queued requests that cannot be admitted yet
            except Exception:  # noqa: BLE001 - a failed step already failed its sessions; the loop must live on
                log.exception("engine loop: step failed")
                time.sleep(0.01)

    def stream(self, gen: Generation) -> Iterator[RoundOutput]:
        """The rounds of a submitted request, running steps (for every session) while it needs output.
        Closing the iterator early cancels the request and frees its cache."""
        for rounds in self.stream_batches(gen):
            yield from rounds

    def stream_batches(self, gen: Generation) -> Iterator[list[RoundOutput]]:
        """Like `stream`, but each item is every round that is ready when the reader asks: with the loop
        running, what the stream interval gathered (the first token at once); without, one round per
        step this reader runs."""
        try:
            while True:
                if self._loop is not None and not gen.outbox and not gen.settled:  # the loop wakes it when
                    gen.wakeup.wait()                                             # its output is worth sending
                    gen.wakeup.clear()
                rounds = gen.take_ready()
                if rounds:
                    yield rounds
                if rounds is not None and (not rounds or rounds[-1].finish_reason is not None):
                    return  # its end, or cancelled
                if rounds is None and self._loop is None:
                    self.step(waiter=gen)
        finally:
            if not gen.finished:
                self.cancel(gen)

    def cancel(self, gen: Generation) -> None:
        """Stop a request between steps and free its caches (no effect on the others). With the loop
        running, the loop frees them after the step in progress; without, they are freed now."""
        if not gen.finished:
            gen.cancelled = True
        gen.wakeup.set()
        if self._loop is not None:
            self._work.set()
            return
        with self._lock:
            self._retire(gen)

    def run(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate to the end and collect the stream."""
        rounds = list(self.generate(prompt_ids, params))
        tokens = [t for r in rounds for t in r.token_ids]
        text = "".join(r.text for r in rounds)
        return GenerationResult(tokens, text, rounds[-1].finish_reason, rounds[-1].totals)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise DFlashError("this engine has no tokenizer; pass token ids")
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # -- the step ---------------------------------------------------------------------------------

    def step(self, waiter: Generation | None = None) -> bool:
        """Run one step for every running session; False when there was nothing to do. With `waiter`,
        only if that request still needs output (another stream's step may have produced it)."""
        with self._lock:
            if waiter is not None and (waiter.outbox or waiter.done):
                return True
            self._retire_done()
            with self._admission:
                plan = self.scheduler.schedule()
            if not plan:
                self._report_sessions()
                return False
            stepped = plan.decodes + [g for g, _ in plan.prefills]
            rounds: list[tuple[Generation, RoundOutput]] = []
            try:
                with self.observer.step_scope() if self.observer is not None else nullcontext():
                    rounds = self._run(plan)
            except Exception as exc:  # noqa: BLE001 - the step's sessions fail, the engine serves on
                log.exception("step failed for %d sessions", len(stepped))
                for gen in stepped:
                    gen.error = exc
            self.delivery.deliver(rounds, stepped)
            self._retire_done()
            self._report_sessions()
            return True

    def _report_sessions(self) -> None:
        if self.observer is not None:
            self.observer.on_sessions(self.scheduler.num_running, self.scheduler.num_waiting)

    def _publish(self, gens: list[Generation]) -> None:
        """Wake the streams whose output is worth a message now: one call per listener (an asyncio
        consumer) for all its streams, a thread's event for the others."""
        now, interval_s = time.perf_counter(), self.config.stream_interval_ms / 1000
        woken = [gen for gen in gens if gen.worth_streaming(now, interval_s)]
        for gen in woken:
            gen.woken_at = now
        wake(woken)

    def _run(self, plan: StepPlan) -> list[tuple[Generation, RoundOutput]]:
        """The step's forward and commits: each session's round, for delivery (stored, then streamed)."""
        start_ns, t0 = time.time_ns(), time.perf_counter()
        if self.policy is not None:
            self.policy.step_started(t0)
        prefill_tokens = sum(n for _, n in plan.prefills)
        sizes = [self._round_block_size(g) for g in plan.decodes]
        # A step in which nobody could draft (block-size-1 requests only) is no arm's: the policy is not told
        # of it (its bucket would be made without the cost model's start, and its measures mixed up).
        chose = any(size > 1 for size in sizes)
        decision = self._decide(sizes, chose, sum(g.num_rounds == 0 for g in plan.decodes), bool(plan.prefills))
        if not decision.drafts:
            sizes = [1] * len(sizes)
        if self.pipeline is None:
            decodes, drafts = plan.decodes, self._propose(plan.decodes, sizes)
            round_draft_ms = None
        else:  # with overlap, this step's cohort verifies the drafts it holds while the other one's are drafted
            overlap = self.config.pipeline_drafts == "on" or decision.arm == PIPED
            decodes, drafts, round_draft_ms = self._pipelined(plan.decodes, sizes, bool(plan.prefills), overlap)
            if not decodes and not plan.prefills:
                return []  # every session is drafting (the cohorts even out): nothing to verify yet
        t1 = time.perf_counter()
        draft_ms = (t1 - t0) * 1000  # pipelined: only what the step waited for drafts, not what they took
        if round_draft_ms is None:
            round_draft_ms = [draft_ms] * len(decodes)
        base_tokens = len(decodes) + prefill_tokens
        lengths = self._verify_lengths(decision, drafts, base_tokens, draft_ms)
        verified = [d.tokens.tolist()[:k] for d, k in zip(drafts, lengths)]
        items = [ForwardItem(g.request_id, (g.last_token, *v), g.position) for g, v in zip(decodes, verified)]
        items += [ForwardItem(g.request_id, tuple(g.prefill_ids[g.num_cached : g.num_cached + n]), g.num_cached,
                              last_only=True) for g, n in plan.prefills]
        outs = self.target.forward(self.cache, items)
        num_decodes = len(decodes)
        # Every pick of the step in one device->host copy: the decodes' posteriors, and the first token
        # of each prompt whose last chunk this is (a resumed request samples nothing).
        rows = [(g.params, g.seed, g.position + 1, outs.logit_starts[i], len(v) + 1)
                for i, (g, v) in enumerate(zip(decodes, verified))]
        firsts = [i for i, (g, n) in enumerate(plan.prefills, start=num_decodes)
                  if g.num_cached + n == len(g.prefill_ids) and not g.output_ids]
        rows += [(plan.prefills[i - num_decodes][0].params, plan.prefills[i - num_decodes][0].seed,
                  len(plan.prefills[i - num_decodes][0].prompt_ids), outs.logit_starts[i], 1) for i in firsts]
        picks = sample_rows(outs.logits, rows)
        posteriors, first_tokens = picks[:num_decodes], dict(zip(firsts, (p[0] for p in picks[num_decodes:])))
        accepted = [accept_length(v, post) for v, post in zip(verified, posteriors)]
        if self.policy is not None:
            self.policy.verified([d.probs for d in drafts], lengths, accepted)
        features = self._kept_features(decodes, outs, accepted)
        verify_ms = self._ms_since(t1)
        num_tokens = sum(len(i.token_ids) for i in items)
        report = StepReport(start_ns, 0, draft_ms, verify_ms, num_tokens,
                            verify_lengths=lengths, prefill_tokens=prefill_tokens)
        for gen, draft, tokens, post, n, feats, ms in zip(decodes, drafts, verified, posteriors, accepted, features,
                                                          round_draft_ms):
            round_out = self._verify_round(gen, tokens, post, n, feats, ms, verify_ms, draft.replica, decision)
            report.rounds.append((gen, round_out))
        if self.policy is not None and chose:
            emitted = sum(len(r.token_ids) for _, r in report.rounds)
            self.policy.step_ran(decision, t0, len(plan.decodes), emitted, prefill_tokens)
        for i, (gen, n) in enumerate(plan.prefills, start=num_decodes):
            round_out = self._prefill_chunk(gen, n, outs[i], first_tokens.get(i), verify_ms)
            if round_out is not None:
                report.rounds.append((gen, round_out))
        report.end_ns = time.time_ns()
        report.num_running, report.num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
        if self.observer is not None:
            self.observer.on_step(report)
        return report.rounds

    def _propose(self, decodes: list[Generation], sizes: list[int]) -> list[Draft]:
        """Drafts for every decoding session in one drafter call; Draft.none() where the round drafts nothing.

        The drafter always fills the block it was trained on (as far as the context window allows)
        and the round keeps the first size - 1 proposals: a smaller block size shortens what the
        target verifies, not the block the drafter sees, because a block of another length (fewer
        mask slots to attend to) is one it never saw in training.
        """
        drafts = [Draft.none() for _ in decodes]
        asks = [(i, g) for i, (g, size) in enumerate(zip(decodes, sizes)) if size > 1]
        if not asks:
            return drafts
        requests = [self._draft_request(g) for _, g in asks]
        for (i, _), d in zip(asks, self.drafter.draft_batch(requests)):
            keep = sizes[i] - 1
            drafts[i] = d if d.tokens.shape[0] <= keep else Draft(d.tokens[:keep], d.probs[:keep], d.replica)
        return drafts

    def _launch(self, decodes: list[Generation], which: list[int]) -> None:
        """Start drafting these sessions beside what follows (their context is handed over now)."""
        if which:
            gens = [decodes[i] for i in which]
            self.pipeline.launch([g.request_id for g in gens], [self._draft_request(g) for g in gens])

    def _draft_request(self, g: Generation) -> DraftRequest:
        """A session's next draft call, with the context the drafter has not seen (handed over now)."""
        room = self.target.max_positions - 1 - g.position
        drafted = max(self._round_block_size(g), min(self.drafter.block_size, room))
        context = g.pending_features[0] if len(g.pending_features) == 1 else torch.cat(g.pending_features)
        request = DraftRequest(g.request_id, context, g.drafter_start, g.last_token, drafted, g.draft_sampling)
        g.drafter_start += context.shape[0]
        g.pending_features = []
        return request

    def _pipelined(self, decodes: list[Generation], sizes: list[int], prefills: bool,
                   overlap: bool) -> tuple[list[Generation], list[Draft], list[float]]:
        """The sessions this step verifies, with their drafts and what each draft took: those holding a
        draft (launched last step) and those not drafting; with `overlap`, drafts are launched for about
        half of the others (`cohort_split`), which verify next step. Without (another arm of the policy),
        or for a lone drafting session (nothing to overlap it with), the drafts launched are waited for
        at once and verified now: the serial step."""
        pipe = self.pipeline
        pipe.collect()  # last step's launches: normally done while that step verified
        drafting = [i for i, size in enumerate(sizes) if size > 1]
        ready = [i for i in drafting if pipe.holds(decodes[i].request_id)]
        fresh = [i for i in drafting if not pipe.holds(decodes[i].request_id)]
        launch = fresh[:cohort_split(len(fresh), len(ready))] if overlap else fresh
        self._launch(decodes, launch)
        if launch and (not overlap or not ready and len(drafting) == len(decodes) and not prefills):
            # Nothing else to verify now: verify what was just drafted, while the sessions kept back (if
            # any) draft beside it. Serial (no overlap, a lone stream) when none were kept back.
            pipe.collect()
            ready, launch = ready + launch, [i for i in fresh if i not in set(launch)]
            self._launch(decodes, launch)
        verify = [i for i in range(len(decodes)) if sizes[i] <= 1 or i in set(ready)]
        held = [pipe.take(decodes[i].request_id, sizes[i] - 1) for i in verify]
        return ([decodes[i] for i in verify], [h.draft if h else Draft.none() for h in held],
                [h.ms if h else 0.0 for h in held])

    def _decide(self, sizes: list[int], drafting: bool, fresh: int, prefills: bool) -> Decision:
        """Whether this step drafts and how its proposals are verified (verify_policy.py); `drafting`: some
        session may draft; `fresh`: how many of the sessions decode for the first time; `prefills`: the
        step also prefills."""
        if not drafting:
            return Decision("plain", "nothing to draft")
        if self.policy is None:
            return Decision("full", "policy off")
        return self.policy.decide(len(sizes), fresh, sum(sizes), prefills)

    def _verify_lengths(self, decision: Decision, drafts: list[Draft], base_tokens: int, draft_ms: float) -> list[int]:
        if self.policy is None:
            return [d.tokens.shape[0] for d in drafts]
        return self.policy.verify_lengths(decision, [d.probs for d in drafts], base_tokens, draft_ms)

    def _kept_features(self, decodes: list[Generation], outs: PackedOutput,
                       accepted: list[int]) -> list[torch.Tensor | None]:
        """Each drafting session's features of its committed rows (the next draft's context): one gather
        for all sessions, then a view per session."""
        drafting = [i for i, g in enumerate(decodes) if g.block_size > 1]
        if not drafting:
            return [None] * len(decodes)
        rows = [outs.offsets[i] + j for i in drafting for j in range(accepted[i] + 1)]
        kept = outs.features.index_select(0, torch.tensor(rows).to(outs.features.device, non_blocking=True))
        views: list[torch.Tensor | None] = [None] * len(decodes)
        at = 0
        for i in drafting:
            views[i] = kept[at : at + accepted[i] + 1]
            at += accepted[i] + 1
        return views

    def _verify_round(self, gen: Generation, draft: list[int], posterior: list[int], accepted: int,
                      features: torch.Tensor | None, draft_ms: float, verify_ms: float, drafter: str,
                      decision: Decision) -> RoundOutput:
        """Commit the agreed prefix of the draft plus the bonus token; keep the cache up to it."""
        new_tokens = committed_tokens(draft, posterior, accepted)
        self.cache.crop(gen.request_id, gen.position + accepted + 1)
        if features is not None:
            gen.pending_features.append(features)
        stats = RoundStats(gen.num_rounds + 1, len(draft), accepted, accepted + 1, 0, draft_ms, verify_ms, drafter,
                           decision.arm if gen.block_size > 1 else "plain",
                           decision.reason if gen.block_size > 1 else "block size 1")
        return gen.emit(self.target.max_positions, new_tokens, stats)

    def _prefill_chunk(self, gen: Generation, n: int, out: TargetOutput, first: int | None,
                       verify_ms: float) -> RoundOutput | None:
        """A chunk of the prompt is in the cache; after the last one, emit the first token (`first`,
        sampled with the step's other picks).

        A resumed request (output_ids already committed) re-prefills prompt + committed tokens but
        the last, samples nothing, and yields an empty round: its caches are rebuilt, its text not.
        """
        gen.num_cached += n
        if gen.block_size > 1:
            # a copy of its own rows, so the step's whole feature tensor is not kept alive meanwhile
            gen.pending_features.append(out.features.clone())
        if gen.prefilling:
            return None
        if gen.output_ids:
            return RoundOutput([], "", RoundStats(0, 0, 0, 0, 0, 0.0, verify_ms), gen.stats, None)
        return gen.emit(self.target.max_positions, [first], RoundStats(0, 0, 0, 1, 0, 0.0, verify_ms))

    def _retire_done(self) -> None:
        """Free every finished, failed or cancelled session (running or still queued)."""
        with self._admission:
            done = [g for g in (*self.scheduler.running, *self.scheduler.waiting) if g.done]
        for gen in done:
            self._retire(gen)

    def _retire(self, gen: Generation) -> None:
        if gen.retired:
            return
        gen.retired = True
        with self._admission:
            self.scheduler.retire(gen)
        gen.pending_features = []
        if self.pipeline is not None:
            self.pipeline.drop(gen.request_id)
        if self.drafter is not None and gen.block_size > 1:
            try:
                self.drafter.release(gen.request_id)
            except DFlashError:
                log.warning("drafter release failed for %s", gen.request_id)

    # -- bookkeeping ------------------------------------------------------------------------------

    def _round_block_size(self, gen: Generation) -> int:
        room = self.target.max_positions - 1 - gen.position
        return max(1, min(gen.block_size, gen.remaining, room))

    def _ms_since(self, t0: float) -> float:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000


def _pipelined(config: SchedulerConfig, drafter: Drafter) -> bool:
    """Whether drafts may run beside verification (`scheduler.pipeline_drafts`): "on" always; "auto" for
    drafters on devices of their own (on one device, drafting beside the target only takes from its
    compute), as the adaptive policy's `piped` arm."""
    if config.pipeline_drafts == "auto":
        return bool(getattr(drafter, "separate_device", False))
    return config.pipeline_drafts == "on"
