"""The verifier's view of each batched step: a `dflash.round` span per session, a `dflash.step` span
for the shared forward, and the scheduler's Prometheus metrics.

The step runs in whichever request's thread needed output first, so spans are made after the fact,
with the step's recorded start and end times: each round span is a child of its own request's trace
(the context captured when the request was submitted), and the step span links to all of them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from opentelemetry import trace

from ..engine import StepReport
from . import tracing
from .metrics import ServiceMetrics


class StepTelemetry:
    """A `StepObserver` (engine.py) for the service."""

    def __init__(self, metrics: ServiceMetrics | None = None) -> None:
        self.metrics = metrics or ServiceMetrics("none")

    def step_scope(self) -> AbstractContextManager[trace.Span]:
        """The `dflash.step` span, current while the step runs (the drafter calls inside are its children)."""
        return tracing.tracer().start_as_current_span(
            "dflash.step", context=trace.set_span_in_context(trace.INVALID_SPAN))

    def on_step(self, report: StepReport) -> None:
        step = trace.get_current_span()
        step.set_attributes({
            "dflash.step.sessions": len(report.rounds), "dflash.step.tokens": report.num_tokens,
            "dflash.step.prefill_tokens": report.prefill_tokens, "dflash.step.draft_ms": report.draft_ms,
            "dflash.step.verify_ms": report.verify_ms,
            "dflash.step.request_ids": [gen.request_id for gen, _ in report.rounds],
        })
        link = [trace.Link(step.get_span_context())] if step.get_span_context().is_valid else []
        tracer = tracing.tracer()
        for gen, out in report.rounds:
            s = out.stats
            if s.index > 0:
                self.metrics.record_round()
            if gen.trace_context is None:
                continue
            span = tracer.start_span("dflash.round", context=gen.trace_context, links=link, start_time=report.start_ns,
                                     attributes={
                "dflash.round.index": s.index, "dflash.round.draft_tokens": s.draft_tokens,
                "dflash.round.accepted_tokens": s.accepted_tokens, "dflash.round.committed": s.committed,
                "dflash.round.draft_ms": s.draft_ms, "dflash.round.verify_ms": s.verify_ms,
                "dflash.drafter.replica": s.drafter, "dflash.round.policy_arm": s.policy_arm,
                "dflash.round.policy_reason": s.policy_reason,
                "dflash.drafter.fallback": s.index > 0 and gen.block_size > 1 and not s.drafter,
            })
            span.end(end_time=report.end_ns)
        self.metrics.record_step(report.num_tokens, report.verify_lengths, (report.end_ns - report.start_ns) / 1e9,
                                 report.num_running, report.num_waiting)

    def on_remote_step(self, report: StepReport) -> None:
        """A step the engine made in its own process (engine_process.py): its `dflash.step` span is given
        the step's own times, as `step_scope` would have."""
        step = tracing.tracer().start_span("dflash.step", context=trace.set_span_in_context(trace.INVALID_SPAN),
                                           start_time=report.start_ns)
        with trace.use_span(step, end_on_exit=False):
            self.on_step(report)
        step.end(end_time=report.end_ns)

    def on_sessions(self, num_running: int, num_waiting: int) -> None:
        # After the engine retired what its step finished, failed or cancelled: the gauges read 0 on a
        # server idle since its last request, also after a cancel that no step followed.
        self.metrics.record_sessions(num_running, num_waiting)
