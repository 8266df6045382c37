"""The Helm chart's NetworkPolicies allow exactly the documented flows (an evaluator that reads
selectors and ports as Kubernetes does, with negative controls)."""

from __future__ import annotations

import copy

import helm_python as helm  # pinned in the dev extras: a broken install must fail, not skip
from helm_render import (
    CHART_DIR,
    NAMESPACE,
    NS_NAME,
    OUTSIDER_NAMES,
    OUTSIDERS,
    TIERS,
    TLS_VALUES,
    Endpoint,
    allowed_flows,
    component,
    container,
    documented_flows,
    endpoints,
    env,
    find,
    peer_matches,
    port_matches,
    render,
    selects,
)


def policies_of(objects):
    return {component(o): o for o in objects if o["kind"] == "NetworkPolicy"}


def test_network_policies_allow_exactly_the_documented_flows(chart):
    flows = allowed_flows(render(chart))
    assert flows == documented_flows()
    # Spelled out: nothing reaches a worker but the coordinator (and Prometheus on metrics),
    # nothing but the tiers reaches Redis, and no pod reaches the internet.
    assert {(s, p) for s, t, p, _ in flows if t == "target-worker"} == {
        ("coordinator", 50071),
        ("prometheus", 9092),
    }
    assert {s for s, t, _, _ in flows if t == "redis"} == set(TIERS)
    assert not {f for f in flows if f[0] == "redis"}
    # Only the coordinator leaves the cluster, and only on the API server's ports while
    # networkPolicy.apiServerEgress is [] (test_api_server_egress_follows_its_values narrows it).
    assert {(s, p) for s, t, p, _ in flows if t == "internet"} == {("coordinator", 443)}


def test_network_policies_follow_clients_and_an_external_redis(chart):
    values = {
        "redis": {"enabled": False, "externalUrl": "rediss://:pw@cache.example:6380/0"},
        "networkPolicy": {
            "clients": [{"namespaceSelector": {"matchLabels": {NS_NAME: "apps"}}}],
            "redisEgress": [{"ipBlock": {"cidr": "10.20.0.0/24"}}],
        },
    }
    flows = allowed_flows(render(chart, values))
    assert flows == documented_flows(clients={"client"}, redis=("external-redis", 6380))

    values["networkPolicy"]["redisEgressPort"] = 6379  # an explicit port wins over the URL's
    flows = allowed_flows(render(chart, values))
    assert flows == documented_flows(clients={"client"}, redis=("external-redis", 6379))


def test_metrics_port_off_closes_its_ingress(chart):
    flows = allowed_flows(render(chart, {"coordinator": {"metricsPort": 0}}))
    assert flows == documented_flows() - {("prometheus", "coordinator", 9090, "TCP")}


def test_coordinator_http_api_is_exposed_to_clients_only(chart):
    objects = render(chart)
    assert env(objects, "coordinator")["SPECDEC_HTTP_PORT"] == "8000"
    ports = {p["name"]: p for p in container(objects, "coordinator")["ports"]}
    assert ports["http"] == {"name": "http", "containerPort": 8000, "protocol": "TCP"}
    service = {p["name"]: p for p in find(objects, "Service", "coordinator")["spec"]["ports"]}
    assert service["http"] == {
        "name": "http",
        "port": 8000,
        "targetPort": "http",
        "protocol": "TCP",
        "appProtocol": "http",
    }
    # Only the coordinator serves HTTP; the workers have neither the port nor the variable.
    for comp in ("draft-worker", "target-worker"):
        assert "SPECDEC_HTTP_PORT" not in env(objects, comp)
        assert "http" not in {p["name"] for p in container(objects, comp)["ports"]}
        assert "http" not in {p["name"] for p in find(objects, "Service", comp)["spec"]["ports"]}
    # The same peers as for gRPC, and no one else.
    apps = [{"namespaceSelector": {"matchLabels": {NS_NAME: "apps"}}}]
    flows = allowed_flows(render(chart, {"networkPolicy": {"clients": apps}}))
    assert {s for s, t, p, _ in flows if (t, p) == ("coordinator", 8000)} == {"client"}
    # Another port moves all four together.
    objects = render(chart, {"coordinator": {"httpPort": 8080}})
    assert env(objects, "coordinator")["SPECDEC_HTTP_PORT"] == "8080"
    assert {p["containerPort"] for p in container(objects, "coordinator")["ports"]} >= {8080}
    service = {p["name"]: p for p in find(objects, "Service", "coordinator")["spec"]["ports"]}
    assert service["http"]["port"] == 8080
    assert allowed_flows(objects) == documented_flows(http_port=8080)


def test_http_port_zero_removes_the_port_env_service_port_and_flow(chart):
    objects = render(chart, {"coordinator": {"httpPort": 0}})
    assert "SPECDEC_HTTP_PORT" not in env(objects, "coordinator")
    assert [p["name"] for p in container(objects, "coordinator")["ports"]] == ["grpc", "metrics"]
    service = find(objects, "Service", "coordinator")["spec"]["ports"]
    assert [p["name"] for p in service] == ["grpc", "metrics"]
    flows = allowed_flows(objects)
    assert flows == documented_flows(http_port=0)
    assert documented_flows() - flows == {(c, "coordinator", 8000, "TCP") for c in OUTSIDER_NAMES}


def test_the_evaluator_notices_a_missing_policy_or_an_extra_flow(chart):
    objects = render(chart)
    expected = documented_flows()
    assert allowed_flows(objects) == expected
    named = policies_of(objects)
    # Removing any tier's policy leaves its pods under the default deny: its flows vanish.
    for comp in (*TIERS, "redis"):
        without = [o for o in objects if o is not named[comp]]
        lost = expected - allowed_flows(without)
        assert lost and all(comp in (f[0], f[1]) for f in lost), comp
    # Without the default deny as well, a tier is wide open (e.g. to the internet).
    open_ = [o for o in objects if o not in (named[None], named["coordinator"])]
    assert ("coordinator", "internet", 443, "TCP") in allowed_flows(open_)
    # An extra flow needs both ends: egress alone is not enough, egress + ingress is.
    extra = copy.deepcopy(objects)
    extra_named = policies_of(extra)
    to_target = {
        "to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "target-worker"}}}],
        "ports": [{"port": 50071, "protocol": "TCP"}],
    }
    extra_named["draft-worker"]["spec"]["egress"].append(to_target)
    assert allowed_flows(extra) == expected
    from_draft = {
        "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "draft-worker"}}}],
        "ports": [{"port": 50071, "protocol": "TCP"}],
    }
    extra_named["target-worker"]["spec"]["ingress"].append(from_draft)
    assert allowed_flows(extra) - expected == {("draft-worker", "target-worker", 50071, "TCP")}


def test_default_deny_selects_every_pod_of_the_release_both_ways(chart):
    objects = render(chart)
    deny = policies_of(objects)[None]
    assert deny["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in deny["spec"] and "egress" not in deny["spec"]
    pods = [e for e in endpoints(objects) if e.release]
    assert {p.name for p in pods} == {*TIERS, "redis"}
    assert all(selects(deny["spec"]["podSelector"], p.labels) for p in pods)
    # ... and nothing outside the release, not even another release of the chart.
    assert not any(selects(deny["spec"]["podSelector"], o.labels) for o in OUTSIDERS)
    # Every tier policy also covers both directions (Redis: no egress rule at all).
    for comp, policy in policies_of(objects).items():
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"], comp
    assert policies_of(objects)["redis"]["spec"]["egress"] == []


def test_the_evaluator_reads_selectors_and_ip_blocks_like_kubernetes():
    pod = Endpoint("p", "apps", {"tier": "web"}, "10.244.9.9", ((80, "TCP"),))
    assert selects({}, pod.labels) and selects(None, pod.labels)
    assert selects(
        {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["web"]}]}, pod.labels
    )
    assert not selects(
        {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["web"]}]}, pod.labels
    )
    assert selects({"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}, pod.labels)
    assert not selects({"matchExpressions": [{"key": "x", "operator": "Exists"}]}, pod.labels)
    # A bare podSelector stays in the policy's namespace; a namespaceSelector leaves it.
    assert not peer_matches({"podSelector": {}}, NAMESPACE, pod)
    assert peer_matches({"namespaceSelector": {"matchLabels": {NS_NAME: "apps"}}}, NAMESPACE, pod)
    assert peer_matches({"ipBlock": {"cidr": "10.244.0.0/16"}}, NAMESPACE, pod)
    assert not peer_matches(
        {"ipBlock": {"cidr": "10.244.0.0/16", "except": ["10.244.9.0/24"]}}, NAMESPACE, pod
    )
    assert port_matches([{"port": 50, "endPort": 90}], 80, "TCP")
    assert not port_matches([{"port": 80, "protocol": "UDP"}], 80, "TCP")


def test_lint_is_clean_with_every_security_feature_on():
    values = copy.deepcopy(TLS_VALUES)
    values["redis"] = {"auth": {"existingSecret": "corp-redis"}}
    report = helm.lint(CHART_DIR, values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_network_policies_can_be_turned_off(chart):
    objects = render(chart, {"networkPolicy": {"enabled": False}})
    assert not [o for o in objects if o["kind"] == "NetworkPolicy"]
