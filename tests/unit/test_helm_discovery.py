"""The Helm chart's Kubernetes discovery (EndpointSlices, RBAC), autoscaling on custom metrics
and tracing."""

from __future__ import annotations

import re

import helm_python as helm  # pinned in the dev extras: a broken install must fail, not skip
import pytest
import yaml
from helm_render import (
    CHART_DIR,
    NAMESPACE,
    NS_NAME,
    REPO,
    TIERS,
    TLS_DIR,
    allowed_flows,
    component,
    container,
    documented_flows,
    env,
    find,
    pod_spec,
    probe_budget,
    render,
)

ADAPTER_RULES = REPO / "deploy" / "observability" / "prometheus-adapter-rules.yaml"


PRODUCTION_VALUES = REPO / "deploy" / "helm" / "examples" / "production-values.yaml"


OTEL = "http://otel-collector.observability:4317"


COLLECTOR_PEERS = [
    {
        "namespaceSelector": {"matchLabels": {NS_NAME: "observability"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "opentelemetry-collector"}},
    }
]


API_SERVER = {("kube-apiserver", 443), ("kube-apiserver", 6443)}


def test_coordinator_discovers_workers_through_their_services_endpointslices(chart):
    objects = render(chart)
    draft = find(objects, "Service", "draft-worker")["metadata"]["name"]
    target = find(objects, "Service", "target-worker")["metadata"]["name"]
    assert container(objects, "coordinator")["args"] == [
        "--discovery",
        "kubernetes",
        "--k8s-draft-selector",
        f"kubernetes.io/service-name={draft}",
        "--k8s-target-selector",
        f"kubernetes.io/service-name={target}",
        "--k8s-port-name",
        "grpc",
    ]
    # EndpointSlices carry the Service's port names: each worker's gRPC port is "grpc".
    for comp in ("draft-worker", "target-worker"):
        ports = find(objects, "Service", comp)["spec"]["ports"]
        assert [p["port"] for p in ports if p["name"] == "grpc"] == [TIERS[comp][1]]


def test_coordinator_role_only_reads_endpointslices_in_the_release_namespace(chart):
    objects = render(chart)
    role = find(objects, "Role", "coordinator")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    rbac = [o["kind"] for o in objects if o["apiVersion"].startswith("rbac.authorization.k8s.io")]
    assert sorted(rbac) == ["Role", "RoleBinding"]  # nothing cluster-wide


def test_role_binding_grants_the_role_to_the_coordinators_own_account(chart):
    objects = render(chart)
    binding = find(objects, "RoleBinding", "coordinator")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": find(objects, "Role", "coordinator")["metadata"]["name"],
    }
    coordinator = pod_spec(objects, "coordinator")
    account = coordinator["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
    ]
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    assert accounts[account]["automountServiceAccountToken"] is True
    assert coordinator["automountServiceAccountToken"] is True
    for comp in ("draft-worker", "target-worker"):  # the workers keep a tokenless account
        worker = pod_spec(objects, comp)
        assert worker["serviceAccountName"] != account
        assert worker["automountServiceAccountToken"] is False
        assert accounts[worker["serviceAccountName"]]["automountServiceAccountToken"] is False


def test_redis_discovery_needs_no_api_access(chart):
    objects = render(chart, {"coordinator": {"discovery": "redis"}})
    assert container(objects, "coordinator")["args"] == ["--discovery", "redis"]
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding")]
    accounts = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"]
    assert accounts == [pod_spec(objects, "coordinator")["serviceAccountName"]]
    assert pod_spec(objects, "coordinator")["automountServiceAccountToken"] is False
    assert allowed_flows(objects) == documented_flows(api_server=set())


def test_static_discovery_uses_the_configured_addresses_alone(chart):
    """--discovery static: the workers are the configured addresses (both required, checked
    when the chart renders); no Role, no token, no API server egress — as with redis."""
    addresses = {"draftAddr": "10.1.0.5:50061", "targetAddr": "10.1.0.6:50071,10.1.0.7:50071"}
    objects = render(chart, {"coordinator": {"discovery": "static", "config": addresses}})
    assert container(objects, "coordinator")["args"] == ["--discovery", "static"]
    variables = env(objects, "coordinator")
    assert variables["SPECDEC_DRAFT_ADDR"] == addresses["draftAddr"]
    assert variables["SPECDEC_TARGET_ADDR"] == addresses["targetAddr"]
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding")]
    assert pod_spec(objects, "coordinator")["automountServiceAccountToken"] is False
    assert allowed_flows(objects) == documented_flows(api_server=set())
    for missing in ("draftAddr", "targetAddr"):  # negative controls: one list left empty
        config = {**addresses, missing: ""}
        with pytest.raises(helm.HelmError, match="discovery static: set coordinator.config"):
            render(chart, {"coordinator": {"discovery": "static", "config": config}})


def test_pipeline_is_a_coordinator_value(chart):
    """coordinator.config.pipeline reaches the coordinator as SPECDEC_PIPELINE; unset, the
    program's default (auto) holds; the schema refuses any other word."""
    assert "SPECDEC_PIPELINE" not in env(render(chart), "coordinator")
    for value in ("auto", "on", "off"):
        objects = render(chart, {"coordinator": {"config": {"pipeline": value}}})
        assert env(objects, "coordinator")["SPECDEC_PIPELINE"] == value
    with pytest.raises(helm.HelmError, match="pipeline"):
        render(chart, {"coordinator": {"config": {"pipeline": "sometimes"}}})


def test_discovery_with_an_existing_account_binds_that_account(chart):
    objects = render(chart, {"serviceAccount": {"create": False, "name": "specdec-runner"}})
    assert not [o for o in objects if o["kind"] == "ServiceAccount"]
    assert find(objects, "RoleBinding", "coordinator")["subjects"][0]["name"] == "specdec-runner"
    assert pod_spec(objects, "coordinator")["serviceAccountName"] == "specdec-runner"
    assert pod_spec(objects, "coordinator")["automountServiceAccountToken"] is True
    # Never the namespace's default account, which every other pod there may use.
    with pytest.raises(helm.HelmError, match="serviceAccount.name"):
        render(chart, {"serviceAccount": {"create": False}})


def test_api_server_egress_follows_its_values(chart):
    values = {"networkPolicy": {"apiServerEgress": [{"ipBlock": {"cidr": "10.0.0.10/32"}}]}}
    flows = allowed_flows(render(chart, values))
    assert flows == documented_flows(api_server=API_SERVER)
    assert not [f for f in flows if f[1] == "internet"]
    values["networkPolicy"]["apiServerEgressPorts"] = [6443]
    flows = allowed_flows(render(chart, values))
    assert flows == documented_flows(api_server={("kube-apiserver", 6443)})


def adapter_metric_names() -> dict[str, str]:
    """role -> the custom metric the prometheus-adapter rules serve for that worker role."""
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]
    return {re.search(r'role="(\w+)"', r["seriesQuery"])[1]: r["name"]["as"] for r in rules}


def test_worker_hpas_scale_on_the_metrics_the_adapter_rules_serve(chart):
    tiers = ("coordinator", "draftWorker", "targetWorker")
    objects = render(chart, {key: {"autoscaling": {"enabled": True}} for key in tiers})
    served = adapter_metric_names()
    assert set(served) == {"draft", "target"}
    for comp, role, window in (("draft-worker", "draft", 300), ("target-worker", "target", 900)):
        spec = find(objects, "HorizontalPodAutoscaler", comp)["spec"]
        assert spec["metrics"] == [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": served[role]},
                    "target": {"type": "AverageValue", "averageValue": "24"},
                },
            }
        ]
        # A new pod loads a model: scale down only after a stable stretch of lower load.
        assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == window
    coordinator = find(objects, "HorizontalPodAutoscaler", "coordinator")["spec"]["metrics"]
    assert [m["type"] for m in coordinator] == ["Resource"]


def test_worker_hpa_target_bounds_behavior_and_cpu_are_values(chart):
    autoscaling = {
        "enabled": True,
        "minReplicas": 2,
        "maxReplicas": 9,
        "inFlightPerPod": 12.5,
        "targetCPUUtilizationPercentage": 60,
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 1200}},
    }
    objects = render(chart, {"targetWorker": {"autoscaling": autoscaling}})
    spec = find(objects, "HorizontalPodAutoscaler", "target-worker")["spec"]
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 9)
    pods, cpu = spec["metrics"]
    assert pods["pods"]["target"]["averageValue"] == "12.5"
    assert cpu["resource"] == {
        "name": "cpu",
        "target": {"type": "Utilization", "averageUtilization": 60},
    }
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 1200
    with pytest.raises(helm.HelmError, match="at least one metric"):
        render(chart, {"draftWorker": {"autoscaling": {"enabled": True, "inFlightPerPod": None}}})


def test_otel_endpoint_reaches_all_three_tiers(chart):
    default = render(chart)
    assert not [c for c in TIERS if any(name.startswith("OTEL_") for name in env(default, c))]
    sampler = {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"}
    values = {
        "otel": {"endpoint": OTEL, "extraEnv": [sampler]},
        "targetWorker": {"extraEnv": [{"name": "OTEL_TRACES_SAMPLER", "value": "always_on"}]},
    }
    objects = render(chart, values)
    for comp in TIERS:
        assert env(objects, comp)["OTEL_EXPORTER_OTLP_ENDPOINT"] == OTEL
    assert env(objects, "draft-worker")["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    # A tier's own extraEnv comes after otel.extraEnv, so it wins.
    assert env(objects, "target-worker")["OTEL_TRACES_SAMPLER"] == "always_on"


def test_otel_collector_egress_opens_only_with_an_endpoint(chart):
    peers = {"networkPolicy": {"otelEgress": COLLECTOR_PEERS}}
    assert allowed_flows(render(chart, peers)) == documented_flows()
    values = {"otel": {"endpoint": OTEL}, **peers}
    assert allowed_flows(render(chart, values)) == documented_flows(otel={("otel-collector", 4317)})
    # The port comes from the endpoint, else from otelEgressPort, else 4317.
    values["otel"]["endpoint"] = "http://otel-collector.observability:4318/"
    assert allowed_flows(render(chart, values)) == documented_flows(otel={("otel-collector", 4318)})
    values["networkPolicy"] = {"otelEgress": COLLECTOR_PEERS, "otelEgressPort": 4317}
    assert allowed_flows(render(chart, values)) == documented_flows(otel={("otel-collector", 4317)})
    # otelEgress [] (the default) allows any destination, on that port only.
    objects = render(chart, {"otel": {"endpoint": "https://collector.example"}})
    assert allowed_flows(objects) == documented_flows(otel={("otel-collector", 4317)})


def test_worked_production_example_renders_as_documented(chart):
    values = yaml.safe_load(PRODUCTION_VALUES.read_text())
    report = helm.lint(CHART_DIR, values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
    objects = render(chart, values)
    assert container(objects, "coordinator")["args"][:2] == ["--discovery", "kubernetes"]
    for comp in TIERS:
        assert env(objects, comp)["SPECDEC_TLS_CERT"] == f"{TLS_DIR}/tls.crt"
        assert env(objects, comp)["OTEL_EXPORTER_OTLP_ENDPOINT"] == OTEL
        assert "replicas" not in find(objects, "Deployment", comp)["spec"]  # HPAs own them
    served = adapter_metric_names()
    for comp, role in (("draft-worker", "draft"), ("target-worker", "target")):
        (metric,) = find(objects, "HorizontalPodAutoscaler", comp)["spec"]["metrics"]
        assert metric["pods"] == {
            "metric": {"name": served[role]},
            "target": {"type": "AverageValue", "averageValue": "48"},
        }
    assert probe_budget(container(objects, "target-worker")["startupProbe"]) == 2400
    assert {component(o) for o in objects if o["kind"] == "Certificate"} == set(TIERS)
    assert {component(o) for o in objects if o["kind"] == "ServiceMonitor"} == set(TIERS)
    # Every flow pinned: apps clients, the API server, the collector, the external Redis.
    assert allowed_flows(objects) == documented_flows(
        clients={"client"},
        redis=("external-redis", 6380),
        api_server=API_SERVER,
        otel={("otel-collector", 4317)},
    )
