"""Prometheus metrics: tau, tokens/s, rounds, requests and errors.

Backend chosen by config (`metrics`): "ray" records through ray.util.metrics, which every Ray node
exports on its Prometheus endpoint (what the Helm chart scrapes); "prometheus" uses prometheus_client
with its own registry (tests, processes outside Ray); "none" records nothing.

  dflash_requests_total{status}        finished Generate calls by outcome
  dflash_errors_total{code}            requests answered with a gRPC error code
  dflash_rounds_total                  speculative (verify) rounds
  dflash_drafter_fallbacks_total       rounds run target-only because no drafter answered
  dflash_tau                           histogram of per-request acceptance length
  dflash_decode_tokens_per_second      histogram of per-request decode speed
  dflash_running_sessions              gauge: sessions in the verifier's running batch
  dflash_queued_sessions               gauge: requests waiting for admission (cache or running limit)
  dflash_step_tokens                   histogram of tokens per batched target forward
  dflash_verify_tokens                 histogram of draft tokens verified per session per step
  dflash_step_seconds                  histogram of batched step time (draft + verify)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import prometheus_client
    from ray.util import metrics as ray_metrics

TAU_BUCKETS = [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 16]
TPS_BUCKETS = [1, 5, 10, 25, 50, 100, 200, 400, 800, 1600]
STEP_TOKEN_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
# Ray wants positive bounds: 0.5 counts the k = 0 (plain decoding) steps
VERIFY_BUCKETS = [0.5, 1, 2, 3, 4, 6, 8, 12, 15, 16, 31]
STEP_S_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5]


class ServiceMetrics:
    def __init__(self, backend: str = "prometheus",
                 registry: prometheus_client.CollectorRegistry | None = None) -> None:
        self.backend = backend
        self.registry = registry
        if backend == "none":
            return
        make = _ray_metric if backend == "ray" else self._prometheus_metric
        self.requests = make("counter", "dflash_requests_total", "Generate calls by outcome", ("status",))
        self.errors = make("counter", "dflash_errors_total", "Generate calls answered with an error", ("code",))
        self.rounds = make("counter", "dflash_rounds_total", "speculative verify rounds", ())
        self.fallbacks = make("counter", "dflash_drafter_fallbacks_total", "rounds run target-only", ())
        self.tau = make("histogram", "dflash_tau", "acceptance length per request", (), TAU_BUCKETS)
        self.tokens_per_s = make("histogram", "dflash_decode_tokens_per_second", "decode speed", (), TPS_BUCKETS)
        self.running = make("gauge", "dflash_running_sessions", "sessions in the running batch", ())
        self.queued = make("gauge", "dflash_queued_sessions", "requests waiting for admission", ())
        self.step_tokens = make("histogram", "dflash_step_tokens", "tokens per batched target forward", (),
                                STEP_TOKEN_BUCKETS)
        self.verify_tokens = make("histogram", "dflash_verify_tokens", "draft tokens verified per session per step",
                                  (), VERIFY_BUCKETS)
        self.step_seconds = make("histogram", "dflash_step_seconds", "batched step time", (), STEP_S_BUCKETS)

    def record_round(self) -> None:
        if self.backend != "none":
            _inc(self.rounds, {})

    def record_fallback(self) -> None:
        if self.backend != "none":
            _inc(self.fallbacks, {})

    def record_request(self, status: str, tau: float = 0.0, tokens_per_s: float = 0.0) -> None:
        if self.backend == "none":
            return
        _inc(self.requests, {"status": status})
        if status == "finished":
            _observe(self.tau, tau)
            _observe(self.tokens_per_s, tokens_per_s)

    def record_step(self, num_tokens: int, verify_lengths: list[int], seconds: float, running: int,
                    queued: int) -> None:
        """One scheduler step: its packed tokens, each decoding session's verified draft length, its time,
        and the sessions running and queued once it is over."""
        if self.backend == "none":
            return
        _observe(self.step_tokens, num_tokens)
        for k in verify_lengths:
            _observe(self.verify_tokens, k)
        _observe(self.step_seconds, seconds)
        self.record_sessions(running, queued)

    def record_sessions(self, running: int, queued: int) -> None:
        """The running batch and the admission queue as they stand (the gauges)."""
        if self.backend == "none":
            return
        self.running.set(running)
        self.queued.set(queued)

    def record_error(self, code: str) -> None:
        if self.backend != "none":
            _inc(self.errors, {"code": code})

    def _prometheus_metric(
        self, kind: str, name: str, doc: str, labels: tuple[str, ...], buckets: list[float] | None = None,
    ) -> prometheus_client.Counter | prometheus_client.Gauge | prometheus_client.Histogram:
        import prometheus_client as pc

        if self.registry is None:
            self.registry = pc.CollectorRegistry()
        if kind == "counter":
            return pc.Counter(name.removesuffix("_total"), doc, labels, registry=self.registry)
        if kind == "gauge":
            return pc.Gauge(name, doc, labels, registry=self.registry)
        return pc.Histogram(name, doc, labels, buckets=buckets, registry=self.registry)


def _ray_metric(
    kind: str, name: str, doc: str, labels: tuple[str, ...], buckets: list[float] | None = None,
) -> ray_metrics.Counter | ray_metrics.Gauge | ray_metrics.Histogram:
    from ray.util import metrics

    if kind == "counter":
        return metrics.Counter(name, doc, tag_keys=labels)
    if kind == "gauge":
        return metrics.Gauge(name, doc, tag_keys=labels)
    return metrics.Histogram(name, doc, boundaries=buckets, tag_keys=labels)


def _inc(metric: prometheus_client.Counter | ray_metrics.Counter, labels: dict[str, str]) -> None:
    if hasattr(metric, "labels"):
        (metric.labels(**labels) if labels else metric).inc()
    else:
        metric.inc(1, tags=labels or None)


def _observe(metric: prometheus_client.Histogram | ray_metrics.Histogram, value: float) -> None:
    metric.observe(value)
