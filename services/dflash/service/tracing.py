"""OpenTelemetry: one trace per Generate, a child span per speculative round, the drafter's span inside.

Spans (all in one trace):
  `text_completion {model}` (ingress, SERVER)  GenAI semantic-convention attributes: gen_ai.operation.name,
      gen_ai.request.model, gen_ai.request.max_tokens / temperature / top_p / top_k / seed,
      gen_ai.response.id (the session id), gen_ai.response.finish_reasons, gen_ai.usage.input_tokens,
      gen_ai.usage.output_tokens, plus dflash.tau and dflash.rounds.
  `dflash.round` (verifier)  dflash.round.index, draft_tokens, accepted_tokens, draft_ms, verify_ms,
      dflash.drafter.replica, dflash.drafter.fallback (true when the round ran target-only).
  `dflash.draft` (drafter replica, SERVER)  dflash.session_id, dflash.drafter.rebuilt, context rows.
Context crosses Ray handle calls as a W3C carrier dict and gRPC calls as metadata (`traceparent`).

Exporters come from the standard environment: OTEL_TRACES_EXPORTER=otlp or OTEL_EXPORTER_OTLP_ENDPOINT /
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT switch the OTLP exporter on (its own OTEL_* variables configure it);
by default nothing is exported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

TRACER_NAME = "dflash"


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def otlp_wanted(env: Mapping[str, str]) -> bool:
    exporter = env.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "none":
        return False
    return exporter == "otlp" or bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Install a TracerProvider with an OTLP exporter when the environment asks for one; True if so.

    Called once per process at the edge (a replica's constructor, `dflash serve`).
    """
    env = os.environ if env is None else env
    if not otlp_wanted(env):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = env.get("OTEL_SERVICE_NAME", service_name)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


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
