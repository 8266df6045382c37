"""deploy/observability: the alert rules pass promtool and their unit tests, the dashboards
load, and every PromQL expression parses and names only metrics specdec exports.

promtool comes from Debian's prometheus package (CI installs it); without it these tests
fail, they do not skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from observability_exprs import (
    ADAPTER_RULES,
    DASHBOARDS,
    OBSERVABILITY,
    dashboard_files,
    promql_expressions,
    rule_expressions,
    rule_files,
    substitute_grafana_variables,
)

REPO = Path(__file__).resolve().parents[2]
METRICS = REPO / "specdec" / "serving" / "metrics.py"
ALERTS = OBSERVABILITY / "alerts.yaml"
ALERTS_TEST = OBSERVABILITY / "alerts_test.yaml"

# Alert name -> a metric its expression must read: the conditions the alerts must cover.
REQUIRED_ALERTS = {
    "SpecdecAcceptanceCollapse": "specdec_spec_decode_num_accepted_tokens_total",
    "SpecdecVerifyQueueDeep": "specdec_worker_in_flight",
    "SpecdecVerifyQueueSlow": "specdec_worker_queue_seconds_bucket",
    "SpecdecWorkerFailovers": "specdec_failovers_total",
    "SpecdecSessionTakeovers": "specdec_takeovers_total",
    "SpecdecLostSessions": "specdec_lost_sessions_total",
    "SpecdecRedisSlow": "specdec_redis_seconds_bucket",
    "SpecdecLoadShedding": "specdec_shed_requests_total",
    "SpecdecWorkerBadAnswers": "specdec_worker_bad_answers_total",
    "SpecdecKVCacheNearCapacity": "specdec_worker_kv_capacity_bytes",
    "SpecdecSamplingGraphsOff": "specdec_worker_sampling_graph_calls_total",
}
DASHBOARD_NAMES = {"specdec-overview", "specdec-coordinator", "specdec-draft", "specdec-target"}


@pytest.fixture(scope="module")
def promtool() -> str | None:
    return shutil.which("promtool")


def run_promtool(promtool: str | None, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # a missing promtool fails the test that needs it (never a skip)
    assert promtool, (
        "promtool not found: install Debian's prometheus package (apt install prometheus)"
    )
    return subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


# --- metric names ---------------------------------------------------------------------------

SERIES_SUFFIXES = {
    "counter": ("_total",),
    "observable_counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "observable_gauge": ("",),
}
# Words that are never metric names: aggregations, modifiers, set operators, literals.
PROMQL_WORDS = {"sum", "avg", "min", "max", "count", "group", "stddev", "stdvar", "quantile"}
PROMQL_WORDS |= {"topk", "bottomk", "count_values", "bool", "offset", "inf", "nan"}
PROMQL_WORDS |= {"by", "without", "on", "ignoring", "group_left", "group_right"}
PROMQL_WORDS |= {"and", "or", "unless"}


def exported_series() -> set[str]:
    """The Prometheus series names of every instrument metrics.py creates."""
    text = METRICS.read_text()
    created = re.findall(r'create_(\w+)\(\s*"(specdec_\w+)"', text)
    assert {name for _, name in created} == set(re.findall(r'"(specdec_\w+)"', text)), (
        "an instrument is created in a way this test does not read"
    )
    return {name + suffix for kind, name in created for suffix in SERIES_SUFFIXES[kind]}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers outside strings, label
    matchers, ranges and label lists, that are neither functions nor PromQL keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", expr):
        if expr[match.end() :].lstrip().startswith("(") or match.group().lower() in PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def unknown_metrics(exprs: list[str]) -> dict[str, set[str]]:
    known = exported_series()
    return {e: metric_names(e) - known for e in exprs if metric_names(e) - known}


def template_queries() -> list[str]:
    """The queries of the dashboards' templating variables (label_values(<selector>, label))."""
    queries = []
    for path in dashboard_files():
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable["type"] == "query":
                inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable["definition"])
                assert inner, f"{path.name}: ${variable['name']}: not a label_values() query"
                queries.append(substitute_grafana_variables(inner.group(1)))
    return queries


def test_exported_series_follow_the_instrument_kinds():
    series = exported_series()
    assert {"specdec_generated_tokens_total", "specdec_active_sessions"} <= series
    assert {"specdec_round_seconds_bucket", "specdec_round_seconds_count"} <= series
    assert "specdec_active_sessions_total" not in series  # a gauge has no _total
    assert "specdec_generated_tokens" not in series  # a counter is read as ..._total


def test_every_expression_names_only_metrics_that_telemetry_exports():
    exprs = [e.promql for e in promql_expressions()] + template_queries()
    assert len(exprs) > 60
    assert unknown_metrics(exprs) == {}


def test_the_metric_check_catches_unknown_names_and_wrong_suffixes():
    assert metric_names('sum by (le, op) (rate(specdec_redis_seconds_bucket{op="x"}[5m]))') == {
        "specdec_redis_seconds_bucket"
    }
    assert metric_names("1 + a / on (pod) group_left b offset 1h > 1e3") == {"a", "b"}
    bad = [
        "sum(rate(specdec_generated_token_total[5m]))",  # typo
        "sum(specdec_active_sessions_total)",  # a gauge read as a counter
        "histogram_quantile(0.9, rate(specdec_round_seconds[5m]))",  # the bare histogram
        'up{job="specdec"}',  # not a specdec metric
    ]
    assert set(unknown_metrics(bad)) == set(bad)


# --- PromQL syntax, checked by promtool -------------------------------------------------------


def promql_check(promtool: str, exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`promtool check rules` on a throw-away rule file with one recording rule per expr."""
    rules = [{"record": f"check:expr_{n}", "expr": e} for n, e in enumerate(exprs)]
    path = tmp_path / "exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}))
    return run_promtool(promtool, "check", "rules", path.name, cwd=tmp_path)


def test_every_expression_parses(promtool, tmp_path):
    exprs = [e.promql for e in promql_expressions()] + template_queries()
    result = promql_check(promtool, exprs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_the_syntax_check_rejects_a_broken_expression(promtool, tmp_path):
    exprs = [e.promql for e in promql_expressions()]
    broken = 'sum by (le) (rate(specdec_round_seconds_bucket{pod=~".*"}[1m])'  # a ")" short
    result = promql_check(promtool, [*exprs, broken], tmp_path)
    assert result.returncode != 0
    assert f'"check:expr_{len(exprs)}"' in result.stdout + result.stderr
    assert "parse error" in result.stdout + result.stderr


def test_grafana_variables_are_replaced_by_valid_values():
    expr = 'rate(x{pod=~"$pod",namespace=~"${namespace}"}[$__rate_interval]) offset $__interval'
    assert substitute_grafana_variables(expr) == 'rate(x{pod=~".*",namespace=~".*"}[1m]) offset 1m'
    assert not [e for e in promql_expressions() if "$" in e.promql or "<<" in e.promql]


# --- alert rules ----------------------------------------------------------------------------


def test_every_rule_file_passes_promtool_check(promtool):
    assert ALERTS in rule_files()
    for path in rule_files():
        result = run_promtool(promtool, "check", "rules", path.name, cwd=OBSERVABILITY)
        assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass(promtool):
    result = run_promtool(promtool, "test", "rules", ALERTS_TEST.name, cwd=OBSERVABILITY)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alerts_cover_the_required_conditions_across_pods():
    by_name = {rule["alert"]: rule for rule in alerts()}
    assert set(REQUIRED_ALERTS) <= set(by_name)
    for name, metric in REQUIRED_ALERTS.items():
        assert metric in metric_names(by_name[name]["expr"]), name
    for rule in alerts():
        # aggregated per namespace, so any number of pods gives one alert per deployment
        assert re.search(r"\b(sum|avg|max) by \(namespace\b", rule["expr"]), rule["alert"]


def test_every_alert_has_a_severity_a_summary_and_a_description():
    for rule in alerts():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["description"].strip(), rule["alert"]


def alert_cases() -> dict[str, dict[str, list]]:
    """alert -> {"firing": [evals], "silent": [evals]} of alerts_test.yaml."""
    cases: dict[str, dict[str, list]] = {}
    for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"]:
        for check in test["alert_rule_test"]:
            kind = "firing" if check.get("exp_alerts") else "silent"
            cases.setdefault(check["alertname"], {"firing": [], "silent": []})[kind].append(check)
    return cases


def minutes(duration: str) -> float:
    """A Prometheus duration ("1d1h", "90m", "30s") in minutes."""
    units = {"s": 1 / 60, "m": 1, "h": 60, "d": 1440}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smhd])", duration))


def test_every_alert_has_a_firing_case_and_a_silent_one_after_it():
    cases = alert_cases()
    assert set(cases) == {rule["alert"] for rule in alerts()}
    for name, kinds in cases.items():
        assert kinds["firing"] and kinds["silent"], name
        # the alert resolves: it is checked silent again after it fired
        fired = min(minutes(c["eval_time"]) for c in kinds["firing"])
        assert max(minutes(c["eval_time"]) for c in kinds["silent"]) > fired, name


def test_a_broken_alert_expression_fails_its_unit_tests(promtool, tmp_path):
    """Each alert alone: its tests pass; an expression that never fires fails its firing
    cases, and one that always fires fails its silent cases."""
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    expected = {}
    for n, rule in enumerate(alerts()):
        name = rule["alert"]
        for variant, expr, keep in (
            ("intact", rule["expr"], ("firing", "silent")),
            ("never", "vector(1) < 0", ("firing",)),
            ("always", "vector(1)", ("silent",)),
        ):
            stem = f"{n:02d}-{variant}"
            mutated = {**rule, "expr": expr}
            (tmp_path / f"{stem}.rules.yaml").write_text(
                yaml.safe_dump({"groups": [{"name": name, "rules": [mutated]}]})
            )
            cases = []
            for test in tests:
                checks = [
                    c
                    for c in test["alert_rule_test"]
                    if c["alertname"] == name
                    and ("firing" if c.get("exp_alerts") else "silent") in keep
                ]
                if checks:
                    cases.append({**test, "alert_rule_test": checks})
            unit = {"rule_files": [f"{stem}.rules.yaml"], "evaluation_interval": "1m"}
            (tmp_path / f"{stem}.test.yaml").write_text(yaml.safe_dump({**unit, "tests": cases}))
            expected[f"{stem}.test.yaml"] = "SUCCESS" if variant == "intact" else "FAILED"
    result = run_promtool(promtool, "test", "rules", *sorted(expected), cwd=tmp_path)
    # stdout names each file, then SUCCESS; a failure's details go to stderr
    outcomes = {
        chunk.split()[0]: "SUCCESS" if "SUCCESS" in chunk else "FAILED"
        for chunk in result.stdout.split("Unit Testing:")[1:]
    }
    assert outcomes == expected, result.stderr


# --- dashboards -----------------------------------------------------------------------------


def dashboards() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in dashboard_files()}


def test_the_four_dashboards_exist():
    assert set(dashboards()) == DASHBOARD_NAMES
    assert DASHBOARDS.parent == OBSERVABILITY


def test_dashboards_are_grafana_json_on_a_prometheus_datasource_variable():
    for name, board in dashboards().items():
        assert board["schemaVersion"] >= 36, name
        assert board["uid"] == name
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in board["panels"]:
            where = f"{name}: {panel['title']}"
            assert panel["type"] in ("timeseries", "stat"), where
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
            assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), where
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), where


def board_metrics(board: dict) -> set[str]:
    return {
        m
        for panel in board["panels"]
        for target in panel["targets"]
        for m in metric_names(substitute_grafana_variables(target["expr"]))
    }


def test_overview_dashboard_shows_throughput_latency_and_speculation():
    shown = board_metrics(dashboards()["specdec-overview"])
    assert {
        "specdec_generated_tokens_total",
        "specdec_requests_total",
        "specdec_time_to_first_token_seconds_bucket",
        "specdec_time_per_output_token_seconds_bucket",
        "specdec_spec_decode_num_accepted_tokens_total",
        "specdec_spec_decode_num_draft_tokens_total",
        "specdec_spec_decode_num_accepted_tokens_per_pos_total",
        "specdec_spec_decode_num_drafts_total",
        "specdec_num_speculative_tokens_sum",
        "specdec_failovers_total",
        "specdec_takeovers_total",
        "specdec_resyncs_total",
        "specdec_redis_seconds_bucket",
    } <= shown


@pytest.mark.parametrize("role", ["draft", "target"])
def test_worker_dashboards_show_their_own_tier_only(role):
    board = dashboards()[f"specdec-{role}"]
    assert {
        "specdec_worker_batch_size_bucket",
        "specdec_worker_queue_seconds_bucket",
        "specdec_worker_forward_seconds_bucket",
        "specdec_worker_in_flight",
        "specdec_worker_kv_bytes",
        "specdec_worker_kv_capacity_bytes",
        "specdec_worker_sessions",
        "specdec_worker_kv_evictions_total",
        "specdec_worker_resyncs_total",
        "specdec_worker_requests_total",
    } <= board_metrics(board)
    for panel in board["panels"]:
        for target in panel["targets"]:
            selectors = re.findall(r"specdec_\w+(\{[^}]*\})?", target["expr"])
            assert all(f'role="{role}"' in s for s in selectors), (panel["title"], target)


# --- prometheus-adapter rules ---------------------------------------------------------------


def test_adapter_rules_serve_one_in_flight_metric_per_worker_role():
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    served = {}
    for rule in rules:
        (role,) = re.findall(r'role="(\w+)"', rule["seriesQuery"])
        assert rule["seriesQuery"].startswith("specdec_worker_in_flight{")
        assert rule["name"]["matches"] == "^specdec_worker_in_flight$"
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        query = rule["metricsQuery"]
        assert "<<.LabelMatchers>>" in query and "<<.GroupBy>>" in query
        assert f'role="{role}"' in query  # the label matchers carry namespace and pod only
        served[role] = rule["name"]["as"]
    assert served == {"target": "specdec_target_in_flight", "draft": "specdec_draft_in_flight"}


def test_rule_expressions_come_from_every_alert():
    assert {e.origin.split(": ")[1] for e in rule_expressions()} == {r["alert"] for r in alerts()}
