"""Every PromQL expression of deploy/observability, ready to evaluate.

The alert rules, the Grafana dashboards and the prometheus-adapter rules are read as they are
committed; Grafana variables and adapter placeholders are replaced by values that keep each
expression valid PromQL (`$__rate_interval` -> `1m`, `$pod` -> `.*`, ...), so a test can parse
every expression with promtool or evaluate it against a real Prometheus.

    from observability_exprs import promql_expressions
    for expression in promql_expressions():
        print(expression.origin, expression.promql)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import yaml

OBSERVABILITY = Path(__file__).resolve().parents[1] / "deploy" / "observability"
DASHBOARDS = OBSERVABILITY / "dashboards"
ADAPTER_RULES = OBSERVABILITY / "prometheus-adapter-rules.yaml"

# Grafana's built-in interval variables; every other variable ($pod, ${namespace}, ...) is
# used inside a regex matcher (=~"$pod") and becomes the match-all regex.
GRAFANA_INTERVALS = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
    "__range_s": "3600",
    "__interval_ms": "60000",
}
MATCH_ALL = ".*"
GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
# The adapter's template placeholders, as it expands them for one pod of a namespace.
ADAPTER_PLACEHOLDERS = {
    "<<.Series>>": None,  # the metric name of the rule's seriesQuery
    "<<.LabelMatchers>>": 'namespace="default",pod=~".*"',
    "<<.GroupBy>>": "namespace, pod",
}


class Expression(NamedTuple):
    origin: str  # "<file>: <alert or panel title>"
    promql: str


def rule_files() -> list[Path]:
    """The Prometheus rule files (a top-level `groups`) in deploy/observability."""
    return sorted(
        path
        for path in OBSERVABILITY.glob("*.yaml")
        if "groups" in (yaml.safe_load(path.read_text()) or {})
    )


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def substitute_grafana_variables(expr: str) -> str:
    """`expr` with Grafana's variables replaced by concrete values."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return GRAFANA_INTERVALS.get(name, MATCH_ALL)

    return GRAFANA_VARIABLE.sub(value, expr)


def rule_expressions() -> list[Expression]:
    """The `expr` of every alerting and recording rule."""
    found = []
    for path in rule_files():
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule.get("record")
                found.append(Expression(f"{path.name}: {name}", rule["expr"].strip()))
    return found


def dashboard_expressions() -> list[Expression]:
    """The `expr` of every panel target, with Grafana variables substituted."""
    found = []
    for path in dashboard_files():
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                origin = f"{path.name}: {panel['title']} [{target['refId']}]"
                found.append(Expression(origin, substitute_grafana_variables(target["expr"])))
    return found


def adapter_expressions() -> list[Expression]:
    """The seriesQuery and the expanded metricsQuery of every prometheus-adapter rule."""
    found = []
    for rule in yaml.safe_load(ADAPTER_RULES.read_text())["rules"]:
        name = rule["name"]["as"]
        series = rule["seriesQuery"]
        metric = series.split("{", 1)[0]
        query = rule["metricsQuery"]
        for placeholder, value in ADAPTER_PLACEHOLDERS.items():
            query = query.replace(placeholder, metric if value is None else value)
        found.append(Expression(f"{ADAPTER_RULES.name}: {name} seriesQuery", series))
        found.append(Expression(f"{ADAPTER_RULES.name}: {name} metricsQuery", query))
    return found


def promql_expressions() -> list[Expression]:
    """Every PromQL expression of the rule files, the dashboards and the adapter rules."""
    return rule_expressions() + dashboard_expressions() + adapter_expressions()
