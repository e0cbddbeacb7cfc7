"""Exporter selection from the standard OTEL_* environment and the per-process span files.

The global tracer provider can be set once per process (tests/test_service_inprocess.py owns it), so
these tests build their own provider around the exporter that setup_tracing would install.
"""

import json
import os

import pytest
from dflash.service import tracing
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor


@pytest.mark.parametrize("env, wanted", [
    ({}, set()),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, {"otlp"}),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, {"otlp"}),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, {"otlp"}),
    ({"OTEL_TRACES_EXPORTER": "console, otlp"}, {"console", "otlp"}),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, set()),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, set()),  # not shipped: nothing rather than a crash
])
def test_exporters_follow_the_standard_environment(env, wanted):
    assert tracing.wanted_exporters(env) == wanted
    assert tracing.otlp_wanted(env) == ("otlp" in wanted)


def test_no_exporter_and_no_trace_dir_installs_nothing():
    assert tracing.setup_tracing("dflash-test", env={}) is False


def test_span_file_holds_one_json_line_per_span_with_parent_links(tmp_path):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(tracing.span_file_exporter(str(tmp_path), "dflash-test")))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request") as request:
        with tracer.start_as_current_span("dflash.round") as round_span:
            round_span.set_attribute("dflash.round.index", 1)
    [path] = list(tmp_path.iterdir())
    assert path.name == f"spans-dflash-test-{os.getpid()}.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # written as each span ends
    assert [s["name"] for s in lines] == ["dflash.round", "request"]
    assert lines[0]["parent_id"] == f"0x{request.get_span_context().span_id:016x}"
    assert lines[0]["context"]["trace_id"] == lines[1]["context"]["trace_id"]
    assert lines[0]["attributes"] == {"dflash.round.index": 1}
