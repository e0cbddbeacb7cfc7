"""OpenTelemetry: one trace per Generate, a child span per speculative round, the drafter's span inside.

Spans (all in one trace):
  `text_completion {model}` (ingress, SERVER)  GenAI semantic-convention attributes: gen_ai.operation.name,
      gen_ai.request.model, gen_ai.request.max_tokens / temperature / top_p / top_k / seed,
      gen_ai.response.id (the session id), gen_ai.response.finish_reasons, gen_ai.usage.input_tokens,
      gen_ai.usage.output_tokens, plus dflash.tau and dflash.rounds.
  `dflash.round` (verifier)  dflash.round.index, draft_tokens, accepted_tokens, draft_ms, verify_ms,
      dflash.drafter.replica, dflash.drafter.fallback (true when the round ran target-only).
  `dflash.drafts` (verifier, CLIENT)  one DraftBatch round for many sessions: dflash.drafts.sessions,
      dflash.drafts.session_ids, dflash.drafter.replicas, dflash.drafter.fallback; a child of the
      `dflash.step` that launched it (drafted beside verification, it runs inside that step's forward).
  `dflash.draft` (drafter replica, SERVER)  dflash.session_id, dflash.drafter.rebuilt, context rows.
Context crosses Ray handle calls as a W3C carrier dict and gRPC calls as metadata (`traceparent`).

Exporters come from the standard environment: OTEL_TRACES_EXPORTER=otlp or OTEL_EXPORTER_OTLP_ENDPOINT /
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT switch the OTLP exporter on (its own OTEL_* variables configure it);
OTEL_TRACES_EXPORTER=console prints spans as JSON on stdout; by default nothing is exported. The
service's `trace_dir` setting also writes every finished span, as one JSON line, to
`<trace_dir>/spans-<service>-<pid>.jsonl`: one file per process, so the spans of a request's ingress,
verifier and drafter processes can be read side by side without a collector (debugging, tests).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

TRACER_NAME = "dflash"


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def wanted_exporters(env: Mapping[str, str]) -> set[str]:
    """The exporters the standard OTEL_* environment asks for, of those we ship: {"otlp", "console"}."""
    named = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if "none" in named:
        return set()
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        named.add("otlp")
    return named & {"otlp", "console"}


def otlp_wanted(env: Mapping[str, str]) -> bool:
    return "otlp" in wanted_exporters(env)


def setup_tracing(service_name: str, env: Mapping[str, str] | None = None, trace_dir: str = "") -> bool:
    """Install a TracerProvider when the environment or `trace_dir` asks for an exporter; True if so.

    Called once per process at the edge (a replica's constructor, `dflash serve`).
    """
    env = os.environ if env is None else env
    exporters = wanted_exporters(env)
    if not exporters and not trace_dir:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    name = env.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if "otlp" in exporters:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if "console" in exporters:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if trace_dir:
        provider.add_span_processor(SimpleSpanProcessor(span_file_exporter(trace_dir, service_name)))
    trace.set_tracer_provider(provider)
    return True


def span_file_exporter(trace_dir: str, service_name: str) -> ConsoleSpanExporter:
    """Finished spans as JSON lines in `<trace_dir>/spans-<service>-<pid>.jsonl` (line-buffered)."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    os.makedirs(trace_dir, exist_ok=True)
    out = open(os.path.join(trace_dir, f"spans-{service_name}-{os.getpid()}.jsonl"), "a", buffering=1)
    return ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")


def carrier() -> dict[str, str]:
    """The current span context as a W3C carrier (for Ray handle calls)."""
    out: dict[str, str] = {}
    propagate.inject(out)
    return out


def outgoing_metadata() -> list[tuple[str, str]]:
    """The current span context as gRPC metadata."""
    return list(carrier().items())


def context_from(carrier_or_metadata: Mapping[str, str] | Sequence[tuple[str, str]] | None) -> otel_context.Context:
    """An OpenTelemetry context from a carrier dict or gRPC invocation metadata."""
    if carrier_or_metadata is None:
        return otel_context.get_current()
    if not isinstance(carrier_or_metadata, Mapping):
        carrier_or_metadata = {k: v for k, v in carrier_or_metadata if isinstance(v, str)}
    return propagate.extract(carrier_or_metadata)


def request_attributes(model: str, params: Mapping, session_id: str) -> dict:
    attrs = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "dflash",
        "gen_ai.request.model": model,
        "gen_ai.response.id": session_id,
    }
    for key, name in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                      ("top_k", "top_k"), ("seed", "seed")):
        if params.get(key) is not None:
            attrs[f"gen_ai.request.{name}"] = params[key]
    if params.get("stop"):
        attrs["gen_ai.request.stop_sequences"] = list(params["stop"])
    return attrs


def final_attributes(finish_reason: str, prompt_tokens: int, completion_tokens: int, tau: float, rounds: int) -> dict:
    return {
        "gen_ai.response.finish_reasons": [finish_reason],
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": completion_tokens,
        "dflash.tau": tau,
        "dflash.rounds": rounds,
    }
