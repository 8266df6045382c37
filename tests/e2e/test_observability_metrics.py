"""Metrics across real processes: /metrics equals the request's GenerationStats, and a real
Prometheus (Debian's `prometheus`) scrapes the three services and evaluates every PromQL
expression of the README, the alert rules and the dashboards."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from test_generate import sample

from specdec.client import Client
from specdec.serving.redis_embedded import free_port
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


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
    values.update({f"gamma<={g}": v for g, v in gamma_buckets(text).items()})
    return values


def _worker_passes(stack) -> dict[str, float]:
    """Seconds each worker has spent in its batched passes (its forward-time histogram's sum)."""
    return {
        tier: sample(scrape(stack.metrics_ports[tier]), "specdec_worker_forward_seconds_sum") or 0.0
        for tier in ("draft", "target")
    }


def gamma_buckets(text: str) -> dict[int, float]:
    """Rounds whose γ was at most g, for g = 0 .. 8 (the γ histogram's cumulative buckets)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(range(9), 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name != "specdec_num_speculative_tokens_bucket" or s.labels["le"] == "+Inf":
                continue
            if (le := float(s.labels["le"])) in out:
                out[int(le)] = s.value
    return out


def test_metrics_equal_the_requests_generation_stats(observed):
    port = observed.metrics_ports["coordinator"]
    before = _counters(scrape(port))
    passes_before = _worker_passes(observed)
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
    passes = {k: v - passes_before[k] for k, v in _worker_passes(observed).items()}
    stats = result.stats
    # the workers' own pass times, as the request's stats sum them (one session: each pass
    # is this request's alone), and inside the request's wall time
    assert stats.draft_forward_ms == pytest.approx(1000 * passes["draft"], rel=1e-9, abs=1e-6)
    assert stats.verify_forward_ms == pytest.approx(1000 * passes["target"], rel=1e-9, abs=1e-6)
    assert 0 < stats.draft_forward_ms + stats.verify_forward_ms < stats.total_time_ms
    # the prompt's round: its passes inside the time to the first token, and not all of them
    assert 0 < stats.first_token_forward_ms < stats.time_to_first_token_ms
    assert stats.first_token_forward_ms < stats.draft_forward_ms + stats.verify_forward_ms
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
    per_gamma = list(stats.rounds_per_gamma) + [0] * 9
    expected.update({f"gamma<={g}": sum(per_gamma[: g + 1]) for g in range(9)})
    assert sum(stats.rounds_per_gamma) == stats.rounds
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
