"""Which span exporters the standard OTEL_* variables select, and the errors for what this
build cannot do (a service refuses to start with them, naming the variable)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec.serving import telemetry, trace_export

OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
)


@pytest.fixture
def env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("variables", "exporters"),
    [
        ({}, []),  # off by default
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            ["otlp"],
        ),
    ],
)
def test_exporters_follow_the_standard_variables(env, variables, exporters):
    for name, value in variables.items():
        env.setenv(name, value)
    assert trace_export.trace_exporters() == exporters


@pytest.mark.parametrize(
    ("variables", "names"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
    ],
)
def test_what_cannot_be_done_is_refused_by_name(env, variables, names):
    for name, value in variables.items():
        env.setenv(name, value)
    with pytest.raises(trace_export.TracingConfigError, match=names):
        trace_export.trace_exporters()


def test_a_worker_refuses_to_start_with_an_unusable_exporter(env):
    """The check runs before any model loads: a usage error naming the variable, no traceback."""
    env.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    proc = subprocess.run(
        [sys.executable, "-m", "target_worker", "--model", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "OTEL_TRACES_EXPORTER" in proc.stderr and "Traceback" not in proc.stderr


def test_spans_are_free_no_ops_when_tracing_is_off(env):
    assert not telemetry.tracing()
    assert telemetry.trace_metadata() is None
    with telemetry.span("specdec.round", gamma=3) as s:
        assert s is None
    telemetry.record_span("queue", 1, 2)  # nothing to record, nothing raised


FLUSH_SCRIPT = """
import sys, time
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from specdec.serving import telemetry

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
trace.set_tracer_provider(provider)
telemetry._tracing = True
for n in range(3):  # a burst: the calls made while a flush runs are not lost
    with telemetry.span("specdec.failover", tier="draft", n=n):
        pass
    if sys.argv[1] == "flush":
        telemetry.flush_soon()
deadline = time.monotonic() + 1.0
while time.monotonic() < deadline and len(exporter.get_finished_spans()) < 3:
    time.sleep(0.01)
print(len(exporter.get_finished_spans()))
"""


@pytest.mark.parametrize(("mode", "exported"), [("flush", "3"), ("wait", "0")])
def test_a_failover_span_is_exported_at_once_not_at_the_next_batch(mode, exported):
    """flush_soon sends what the batch processor holds within the second; without it (the
    negative control) nothing leaves before the 60 s schedule delay."""
    proc = subprocess.run(
        [sys.executable, "-c", FLUSH_SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == exported
