"""Observability across real processes: one request is one trace (collected by a real OTLP
receiver — the OTLP trace service from `opentelemetry-proto` served over gRPC in this test),
/metrics equals the request's GenerationStats, and a real Prometheus (Debian's `prometheus`)
scrapes the three services and evaluates every PromQL expression of the README, the alert
rules and the dashboards."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from test_generate import sample

from specdec.client import Client
from specdec.launcher.stack import Stack, StackSettings
from specdec.serving.redis_embedded import free_port
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SERVICES = {"specdec-coordinator", "specdec-draft-worker", "specdec-target-worker"}
# Spans of different processes share this machine's wall clock; allow for rounding.
CLOCK_SLACK_NS = 2_000_000


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start: int
    end: int
    attributes: dict = field(default_factory=dict)

    @property
    def duration(self) -> int:
        return self.end - self.start


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span it is sent."""

    def __init__(self):
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for s in scope.spans:
                        self.spans.append(
                            Span(
                                resource.get("service.name", ""),
                                s.trace_id.hex(),
                                s.span_id.hex(),
                                s.parent_span_id.hex(),
                                s.name,
                                s.start_time_unix_nano,
                                s.end_time_unix_nano,
                                {a.key: _value(a.value) for a in s.attributes},
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sink.endpoint = f"http://127.0.0.1:{port}"
    yield sink
    server.stop(0)


@pytest.fixture(scope="module")
def observed(model_dirs, receiver):
    """The stack as real processes with tracing to the receiver and /metrics on each service."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans arrive while the test waits
    }
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)  # the stack's children inherit the environment
    ports = {"coordinator": free_port(), "target": free_port(), "draft": free_port()}
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=free_port(),
        log_level="warning",
        # rounds as the trace assertions below expect them: one Propose per round with
        # candidates (pipelined rounds add a `specdec.draft_ahead` span that overlaps the
        # verify, and a round using its block has no Propose of its own)
        coordinator_args=["--metrics-port", str(ports["coordinator"]), "--pipeline", "off"],
        # the sampling math in fixed shapes (CUDA graphs on a GPU, eagerly here), so the
        # workers export specdec_worker_sampling_graph_* as a GPU worker does
        target_args=["--metrics-port", str(ports["target"]), "--sampling-graphs", "on"],
        draft_args=["--metrics-port", str(ports["draft"]), "--sampling-graphs", "on"],
    )
    try:
        with Stack(settings) as stack:
            stack.metrics_ports = ports
            yield stack
    finally:
        mp.undo()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def wait_for_trace(receiver: Receiver, trace_id: str, names: set[str]) -> list[Span]:
    """The trace's spans once every name in `names` arrived and nothing new came for 0.5 s."""
    deadline = time.monotonic() + 30
    seen = -1
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        if names <= {s.name for s in spans} and len(spans) == seen:
            return spans
        seen = len(spans)
        time.sleep(0.5)
    raise AssertionError(f"trace {trace_id}: got {sorted({s.name for s in spans})}")


def children(spans: list[Span], parent: Span, name: str | None = None) -> list[Span]:
    return [s for s in spans if s.parent_id == parent.span_id and (name is None or s.name == name)]


def covered(parent: Span, spans: list[Span]) -> int:
    """Nanoseconds of `parent` during which at least one of `spans` runs."""
    cuts = sorted((max(s.start, parent.start), min(s.end, parent.end)) for s in spans)
    total, reach = 0, parent.start
    for start, end in cuts:
        if end > max(start, reach):
            total += end - max(start, reach)
            reach = end
    return total


def within(child: Span, parent: Span) -> bool:
    return child.start >= parent.start - CLOCK_SLACK_NS and child.end <= parent.end + CLOCK_SLACK_NS


# A prompt longer than --prefill-threshold (32 tokens), so the first round sends a Prefill.
LONG_PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 4


def test_one_request_is_one_trace_across_three_processes(observed, receiver):
    with Client(observed.address) as client:
        result = client.generate(
            LONG_PROMPT, max_new_tokens=24, num_speculative_tokens=3, ignore_eos=True
        )
    stats = result.stats
    assert len(client.trace_id) == 32, "the coordinator answers with a W3C traceresponse"
    spans = wait_for_trace(
        receiver,
        client.trace_id,
        {"TargetService/Verify", "DraftService/Propose", "TargetService/Prefill", "forward"},
    )
    assert {s.service for s in spans} == SERVICES
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if s.parent_id not in by_id]
    assert [(r.name, r.parent_id) for r in roots] == [("CoordinatorService/GenerateStream", "")]
    root = roots[0]
    for s in spans:  # every span lies inside its parent, across processes too
        if s is not root and s.name != "specdec.release":  # freeing KV after the answer
            assert within(s, by_id[s.parent_id]), (s.name, by_id[s.parent_id].name)
    (release,) = children(spans, root, "specdec.release")
    assert {s.name for s in children(spans, release)} == {"draft/Release", "target/Release"}

    rounds = sorted(children(spans, root, "specdec.round"), key=lambda s: s.start)
    assert len(rounds) == stats.rounds
    assert [r.attributes["round"] for r in rounds] == list(range(1, stats.rounds + 1))
    assert sum(r.attributes["accepted"] for r in rounds) == stats.accepted_tokens
    assert sum(r.attributes["gamma"] for r in rounds) == stats.draft_tokens
    assert sum(r.attributes["tokens"] for r in rounds) == stats.generated_tokens == 24
    prefills = [s for s in spans if s.name == "specdec.prefill"]
    assert len(prefills) == 1 and prefills[0].parent_id == rounds[0].span_id

    # each round's commit runs beside the next round (a child of the session's span): it
    # starts after its round's verify, the commits land in order, the last inside its round
    commits = sorted(children(spans, root, "specdec.commit"), key=lambda s: s.start)
    assert [c.attributes["round"] for c in commits] == list(range(1, stats.rounds + 1))
    assert sum(c.attributes["tokens"] for c in commits) == 24
    for earlier, later in zip(commits, commits[1:]):
        assert earlier.end <= later.start + CLOCK_SLACK_NS
    assert within(commits[-1], rounds[-1])
    busy = total = 0
    verifies = []
    for r, commit in zip(rounds, commits):
        verify = children(spans, r, "target/Verify")
        assert len(verify) == 1 and children(spans, r, "specdec.commit") == [], r.attributes
        assert commit.start >= verify[0].end - CLOCK_SLACK_NS
        verifies.append(verify[0])
    for commit, next_verify in zip(commits, verifies[1:]):  # it overlaps the next round
        assert commit.start < next_verify.end, (commit.attributes, next_verify.attributes)
        (server,) = children(spans, verify[0], "TargetService/Verify")
        assert server.service == "specdec-target-worker"
        (queue,) = children(spans, server, "queue")
        (forward,) = children(spans, server, "forward")
        assert forward.attributes["batch_size"] >= 1 and forward.attributes["batch_seq"] >= 1
        assert queue.duration + forward.duration <= server.duration + CLOCK_SLACK_NS
        assert server.duration <= verify[0].duration + CLOCK_SLACK_NS
        propose = children(spans, r, "draft/Propose")
        if r.attributes["gamma"]:
            assert len(propose) == 1
            (draft_server,) = children(spans, propose[0], "DraftService/Propose")
            assert draft_server.service == "specdec-draft-worker"
            assert {s.name for s in children(spans, draft_server)} == {"queue", "forward"}
        else:
            assert propose == []
        parts = children(spans, r)
        assert sum(p.duration for p in parts) <= r.duration + CLOCK_SLACK_NS
        busy += covered(r, parts + commits)
        total += r.duration
    # the round's own work (choosing γ, checking answers, detokenising) is small: its
    # children and the commits it waits for cover most of each round
    assert busy >= 0.8 * total, (busy, total)
    assert sum(r.duration for r in rounds) <= root.duration


def test_a_callers_trace_context_is_joined(observed, receiver):
    """A client call made inside the caller's own span becomes part of the caller's trace."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("caller")
    with tracer.start_as_current_span("caller-request") as parent:
        with Client(observed.address) as client:
            client.generate("import os", max_new_tokens=4, num_speculative_tokens=2)
        ctx = parent.get_span_context()
    assert client.trace_id == f"{ctx.trace_id:032x}"
    spans = wait_for_trace(receiver, client.trace_id, {"TargetService/Verify"})
    (root,) = [s for s in spans if s.name == "CoordinatorService/GenerateStream"]
    assert root.parent_id == f"{ctx.span_id:016x}"
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing leaked


def _counters(text: str) -> dict[str, float]:
    per_pos = {}
    for position in range(8):
        v = sample(
            text, "specdec_spec_decode_num_accepted_tokens_per_pos_total", position=str(position)
        )
        per_pos[position] = v or 0.0
    values = {
        name: sample(text, f"specdec_{name}_total") or 0.0
        for name in (
            "prompt_tokens",
            "generated_tokens",
            "rounds",
            "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens",
        )
    }
    values["length"] = sample(text, "specdec_requests_total", finish_reason="LENGTH") or 0.0
    values.update({f"pos{p}": v for p, v in per_pos.items()})
    return values


def test_metrics_equal_the_requests_generation_stats(observed):
    port = observed.metrics_ports["coordinator"]
    before = _counters(scrape(port))
    with Client(observed.address) as client:
        result = client.generate(
            "class Stack:\n    def push(self, x):",
            max_new_tokens=40,
            temperature=0.9,
            seed=7,
            ignore_eos=True,
        )
    after = _counters(scrape(port))
    delta = {k: after[k] - before[k] for k in after}
    stats = result.stats
    assert stats.accepted_tokens > 0 and stats.drafts > 0  # the pair agrees often
    expected = {
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "rounds": stats.rounds,
        "spec_decode_num_drafts": stats.drafts,
        "spec_decode_num_draft_tokens": stats.draft_tokens,
        "spec_decode_num_accepted_tokens": stats.accepted_tokens,
        "length": 1,
    }
    per_position = list(stats.accepted_per_position) + [0] * 8
    expected.update({f"pos{p}": per_position[p] for p in range(8)})
    assert delta == expected


# --- a real Prometheus --------------------------------------------------------------------

# Counters of events a healthy run does not have (they appear with the first event).
EVENT_METRICS = (
    "failovers",
    "takeovers",
    "lost_sessions",
    "resyncs",
    "rejected_requests",
    "backpressure",
    "bad_answers",
    "shed_requests",
    "kv_evictions",
    "drafts_ahead",  # only once --pipeline drafts a block (auto does not on the tiny models)
)
COMPARISON = re.compile(r"\s*(>|<|>=|<=|==|!=)\s*[0-9.e+-]+\s*$")
SELECTOR = re.compile(r"specdec_[a-z0-9_]+(?:\{[^}]*\})?")


def readme_expressions() -> list[str]:
    """The PromQL of the README's Metrics table (third column)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Metrics") : text.index("### Traces")]
    exprs = []
    for line in section.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `specdec_") and len(cells) >= 3:
            exprs += [e for e in re.findall(r"`([^`]+)`", cells[2]) if "(" in e]
    return exprs


def rule_and_dashboard_expressions() -> list[str]:
    """The alert rules', dashboards' and prometheus-adapter rules' PromQL (Grafana variables
    substituted)."""
    from observability_exprs import promql_expressions

    return [e.promql for e in promql_expressions()]


class Prometheus:
    def __init__(self, url: str):
        self.url = url

    def query(self, expr: str) -> dict:
        q = urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as exc:  # 400 = a PromQL error, with its reason
            return json.load(exc)

    def check(self, expr: str, whole: bool = True) -> str | None:
        """None when `expr` evaluates and its data is there, else why not. Every series it
        selects must exist (unless it counts rare events); with `whole`, so must the result
        (of its left side, for `x > 0.25`: a condition may rightly be empty)."""
        answer = self.query(expr)
        if answer.get("status") != "success":
            return f"{answer.get('errorType')}: {answer.get('error')}"
        for selector in SELECTOR.findall(expr):
            if any(name in selector for name in EVENT_METRICS):
                continue
            if not self.query(selector)["data"]["result"]:
                return f"no series {selector}"
        rare = any(name in expr for name in EVENT_METRICS)
        if whole and not rare and not self.query(COMPARISON.sub("", expr))["data"]["result"]:
            return "no data"
        return None


@pytest.fixture(scope="module")
def prometheus(observed, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is needed (make test installs it)"
    root = tmp_path_factory.mktemp("prometheus")
    rules = sorted(str(p) for p in (REPO / "deploy" / "observability").glob("*.yaml"))
    rules = [p for p in rules if p.endswith(("alerts.yaml", "recording.yaml"))]
    jobs = {f"specdec-{name}": port for name, port in observed.metrics_ports.items()}
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": rules,
        # the labels a ServiceMonitor's relabelling gives each target in a cluster
        "scrape_configs": [
            {
                "job_name": job,
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{port}"],
                        "labels": {"namespace": "default", "pod": f"{job}-0"},
                    }
                ],
            }
            for job, port in jobs.items()
        ],
    }
    (root / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = open(root / "prometheus.log", "w")  # noqa: SIM115 - open while Prometheus runs
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                up = prom.query("sum(up)")["data"]["result"]
                if up and float(up[0]["value"][1]) == len(jobs):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError((root / "prometheus.log").read_text()[-2000:])
        yield prom
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_a_real_prometheus_evaluates_every_documented_query(observed, prometheus):
    # one refused call per worker (worker errors by code), then traffic while Prometheus
    # scrapes every second, so rates have several samples
    for address, stub_cls, call in (
        (observed.draft_addresses[0], draft_pb2_grpc.DraftWorkerStub, "Propose"),
        (observed.target_addresses[0], target_pb2_grpc.TargetWorkerStub, "Verify"),
    ):
        with grpc.insecure_channel(address) as channel:
            request = (
                draft_pb2.ProposeRequest if call == "Propose" else target_pb2.VerifyRequest
            )()
            with pytest.raises(grpc.RpcError) as refused:
                getattr(stub_cls(channel), call)(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client(observed.address) as client:
        for i in range(6):
            client.generate(f"def f{i}(x):", max_new_tokens=16, temperature=0.7 * (i % 2))
            time.sleep(0.5)
    time.sleep(3)
    readme = readme_expressions()
    assert len(readme) >= 25, readme
    others = rule_and_dashboard_expressions()
    assert len(others) >= 40, others
    failures = {e: why for e in readme if (why := prometheus.check(e)) is not None}
    failures |= {e: why for e in others if (why := prometheus.check(e, whole=False))}
    assert failures == {}, "\n".join(f"{why}: {e}" for e, why in failures.items())
    # acceptance as Prometheus computes it agrees with the counters it scraped
    rate = prometheus.query(
        "sum(specdec_spec_decode_num_accepted_tokens_total)"
        " / sum(specdec_spec_decode_num_draft_tokens_total)"
    )["data"]["result"]
    assert 0.0 < float(rate[0]["value"][1]) <= 1.0


def test_the_prometheus_checker_can_fail(prometheus):
    """Negative controls: a misspelt metric has no data; broken PromQL is an error."""
    assert prometheus.check("sum(rate(specdec_generated_token_total[1m]))").startswith("no series")
    assert prometheus.check('sum(specdec_worker_in_flight{role="targets"})').startswith("no series")
    assert prometheus.check("sum(rate(specdec_generated_tokens_total[1m])").startswith("bad_data")
    assert prometheus.check("sum(rate(specdec_generated_tokens_total[1m]))") is None


# --- failover and takeover in the trace ---------------------------------------------------


MAX_TOKENS = 160  # room to see the failover's spans arrive before the coordinator is killed


@pytest.fixture(scope="module")
def faulty(model_dirs, receiver):
    """Two drafts and two coordinators, traced, for the failover and takeover spans."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    mp.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=free_port(),
        draft_workers=2,
        log_level="error",
        coordinator_args=["--lease-s", "1.0", "--draft-timeout-s", "2"],
    )
    try:
        with Stack(settings) as stack:
            stack.second_port = free_port()
            stack.add_coordinator(stack.second_port, name="coordinator-b")
            yield stack
    finally:
        mp.undo()


def test_a_failover_and_a_takeover_are_spans_of_the_request(faulty, receiver):
    """The session's draft is killed mid-stream (the session moves to the other draft and its
    fixed γ stays 3), then its coordinator: the client resumes on the other one, which takes
    over. The coordinator is killed only once the failover's spans reached the collector (a
    kill sooner would test the exporter's batch delay, not the failover)."""
    import signal

    addresses = [faulty.address, f"127.0.0.1:{faulty.second_port}"]
    killed: list[str] = []

    def moved(trace_id: str) -> bool:
        """The failover span arrived, and a Propose on the new draft that started after it."""
        spans = receiver.trace(trace_id)
        failovers = [s for s in spans if s.name == "specdec.failover"]
        return bool(failovers) and any(
            s.name == "draft/Propose"
            and s.attributes["worker"] == failovers[0].attributes["to"]
            and s.start > failovers[0].start
            for s in spans
        )

    with Client(addresses, timeout_s=120, backoff_s=0.3) as client:
        stream = client.stream(
            "def add(a, b):", max_new_tokens=MAX_TOKENS, num_speculative_tokens=3,
            ignore_eos=True, session_id="traced-faults",
        )  # fmt: skip
        first_trace = ""
        tokens = 0
        for chunk in stream:
            first_trace = first_trace or client.trace_id
            tokens += len(chunk.token_ids)
            if tokens >= 10 and not killed:
                info = client.get_session("traced-faults")
                index = faulty.draft_addresses.index(info.draft_worker)
                faulty.child(f"draft-worker-{index}").signal(signal.SIGKILL)
                killed.append(info.draft_worker)
            elif tokens >= 30 and len(killed) == 1 and moved(first_trace):
                faulty.child("coordinator").signal(signal.SIGKILL)
                killed.append("coordinator")
        second_trace = client.trace_id
    assert len(killed) == 2, f"the session ended ({tokens} tokens) before its failover was seen"
    assert tokens == MAX_TOKENS
    assert second_trace and second_trace != first_trace  # the resumed call is its own trace

    first = receiver.trace(first_trace)
    (failover,) = [s for s in first if s.name == "specdec.failover"]
    assert failover.attributes["tier"] == "draft"
    assert failover.attributes["worker"] == killed[0]
    new_draft = failover.attributes["to"]
    assert new_draft not in ("", killed[0])
    by_id = {s.span_id: s for s in first}
    round_ = by_id[failover.parent_id]
    assert round_.name == "specdec.round"
    # every Propose before the failover went to the dead draft, every one after it to the new
    # one (the failed call was the round's own Propose, proposed again on the new draft, or
    # its block drafted ahead), and no round went target-only: γ stayed 3 throughout
    proposes = sorted((s for s in first if s.name == "draft/Propose"), key=lambda s: s.start)
    assert {p.attributes["worker"] for p in proposes if p.start < failover.start} == {killed[0]}
    after = [p.attributes["worker"] for p in proposes if p.start > failover.start]
    assert after and set(after) == {new_draft}
    rounds = [s for s in first if s.name == "specdec.round" and s.end > failover.start]
    assert rounds and all(r.attributes["gamma"] == 3 for r in rounds)

    second = wait_for_trace(receiver, second_trace, {"specdec.takeover", "TargetService/Verify"})
    (takeover,) = [s for s in second if s.name == "specdec.takeover"]
    assert takeover.service == "specdec-coordinator"
    assert takeover.attributes["session_id"] == "traced-faults"
    assert 30 <= takeover.attributes["generated"] < MAX_TOKENS
    resumed = children(second, takeover, "specdec.round")
    assert resumed and sum(r.attributes["tokens"] for r in resumed) == (
        MAX_TOKENS - takeover.attributes["generated"]
    )
