"""The Helm chart in deploy/helm/specdec, rendered by the real Helm engine (helm-python-sdk)."""

from __future__ import annotations

import base64
import copy
import dataclasses
import datetime
import importlib.util
import ipaddress
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import helm_python as helm  # pinned in the dev extras: a broken install must fail, not skip
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "specdec"
RELEASE = "rel"
NAMESPACE = "serving"

TIERS = {
    # component: (values key, gRPC port, metrics port, subcommand)
    "coordinator": ("coordinator", 50051, 9090, "coordinator"),
    "draft-worker": ("draftWorker", 50061, 9091, "draft-worker"),
    "target-worker": ("targetWorker", 50071, 9092, "target-worker"),
}
GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render(chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders for `values`."""
    manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def component(obj: dict[str, Any]) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def find(objects: list[dict[str, Any]], kind: str, comp: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and component(o) == comp]
    assert len(matches) == 1, f"expected one {kind} for {comp}, got {len(matches)}"
    return matches[0]


def container(objects: list[dict[str, Any]], comp: str) -> dict[str, Any]:
    (only,) = find(objects, "Deployment", comp)["spec"]["template"]["spec"]["containers"]
    return only


def env(objects: list[dict[str, Any]], comp: str) -> dict[str, Any]:
    """name -> value (or valueFrom) of a tier's container environment."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(objects, comp)["env"]}


def test_lint_reports_no_warnings_or_errors():
    report = helm.lint(CHART_DIR, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_committed_schema_matches_generator():
    spec = importlib.util.spec_from_file_location("gen_schema", REPO / "deploy/helm/gen_schema.py")
    gen_schema = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_schema)
    assert (CHART_DIR / "values.schema.json").read_text() == gen_schema.render()


def test_every_values_key_has_a_comment():
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    undocumented = []
    for number, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w.-]*:", line) and not lines[number - 1].lstrip().startswith(
            "#"
        ):
            undocumented.append(f"{number + 1}: {line.strip()}")
    assert undocumented == []


def test_default_render_has_exactly_the_expected_kinds_per_tier(chart):
    kinds = Counter((component(o), o["kind"]) for o in render(chart))
    expected = Counter(
        {
            (tier, kind): 1
            for tier in TIERS
            for kind in ("Deployment", "Service", "PodDisruptionBudget")
        }
    )
    expected[("redis", "Deployment")] = 1
    expected[("redis", "Service")] = 1
    expected[(None, "ServiceAccount")] = 1
    # Kubernetes discovery (the default): the coordinator's own account, Role and binding.
    for kind in ("ServiceAccount", "Role", "RoleBinding"):
        expected[("coordinator", kind)] = 1
    # Secure defaults: the generated Redis password, one NetworkPolicy per tier and Redis,
    # and the release-wide default deny.
    expected[("redis", "Secret")] = 1
    for comp in (*TIERS, "redis"):
        expected[(comp, "NetworkPolicy")] = 1
    expected[(None, "NetworkPolicy")] = 1
    assert kinds == expected


def test_every_object_is_named_after_release_and_in_the_release_namespace(chart):
    for obj in render(chart):
        assert obj["metadata"]["name"].startswith(f"{RELEASE}-specdec")
        assert obj["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("replicas", [(3, 5, 2), (0, 1, 7)])
def test_each_tier_follows_its_own_replicas(chart, replicas):
    values = {key: {"replicas": n} for (key, *_), n in zip(TIERS.values(), replicas, strict=True)}
    objects = render(chart, values)
    for comp, n in zip(TIERS, replicas, strict=True):
        assert find(objects, "Deployment", comp)["spec"]["replicas"] == n


def test_tiers_use_the_single_console_script_with_their_subcommand(chart):
    objects = render(chart)
    for comp, (*_, subcommand) in TIERS.items():
        assert container(objects, comp)["command"] == ["specdec", subcommand]


def test_no_gpus_are_requested_by_default(chart):
    objects = render(chart)
    for comp in TIERS:
        resources = container(objects, comp)["resources"]
        assert GPU not in resources.get("limits", {})
        assert GPU not in resources.get("requests", {})


def test_gpus_appear_only_on_the_tier_that_requests_them(chart):
    objects = render(chart, {"targetWorker": {"gpu": {"count": 2}}})
    target = container(objects, "target-worker")["resources"]
    assert target["limits"][GPU] == 2
    assert target["requests"][GPU] == 2
    assert target["limits"]["memory"] == "16Gi"  # GPU entries are added, not substituted
    for comp in ("coordinator", "draft-worker"):
        assert GPU not in container(objects, comp)["resources"].get("limits", {})

    objects = render(chart, {"draftWorker": {"gpu": {"count": 1, "resourceName": "amd.com/gpu"}}})
    assert container(objects, "draft-worker")["resources"]["limits"]["amd.com/gpu"] == 1
    assert GPU not in container(objects, "target-worker")["resources"].get("limits", {})


def test_probes_are_grpc_on_each_tiers_port(chart):
    objects = render(chart)
    for comp, (_, port, metrics_port, _) in TIERS.items():
        main = container(objects, comp)
        ports = {p["name"]: p["containerPort"] for p in main["ports"]}
        http = {"http": 8000} if comp == "coordinator" else {}
        assert ports == {"grpc": port, **http, "metrics": metrics_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["grpc"] == {"port": port}
            assert "httpGet" not in main[probe] and "tcpSocket" not in main[probe]


def probe_budget(probe: dict[str, Any]) -> int:
    """Seconds a probe tolerates failing before it acts."""
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_startup_probe_budget_covers_model_loading_and_is_configurable(chart):
    objects = render(chart)
    # Converting and loading a model takes minutes: 15 for the target, 10 for the draft.
    for comp, minimum in (("draft-worker", 600), ("target-worker", 900)):
        main = container(objects, comp)
        startup = main["startupProbe"]
        assert probe_budget(startup) >= minimum, comp
        # ... which readiness and liveness, checked only after startup passed, do not inherit:
        # a wedged worker is restarted within a minute, not after the loading budget.
        assert probe_budget(main["livenessProbe"]) <= 60 < probe_budget(startup), comp
        assert probe_budget(main["readinessProbe"]) <= 15, comp
    probes = {"startup": {"periodSeconds": 15, "failureThreshold": 400}}
    main = container(render(chart, {"targetWorker": {"probes": probes}}), "target-worker")
    startup = main["startupProbe"]
    assert (startup["periodSeconds"], startup["failureThreshold"]) == (15, 400)
    assert startup["grpc"] == {"port": 50071}
    liveness = main["livenessProbe"]
    assert (liveness["periodSeconds"], liveness["failureThreshold"]) == (10, 6)


def test_termination_grace_exceeds_worker_drain_time(chart):
    objects = render(chart)
    for comp in ("draft-worker", "target-worker"):
        pod = find(objects, "Deployment", comp)["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > float(env(objects, comp)["SPECDEC_GRACE_S"])


def test_grace_period_not_above_drain_time_fails_rendering(chart):
    with pytest.raises(helm.HelmRenderError, match="terminationGracePeriodSeconds"):
        render(
            chart, {"targetWorker": {"terminationGracePeriodSeconds": 30, "config": {"graceS": 30}}}
        )


def test_coordinator_gamma_above_worker_limit_fails_rendering(chart):
    with pytest.raises(helm.HelmRenderError, match="maxSpeculativeTokens"):
        render(chart, {"coordinator": {"config": {"maxSpeculativeTokens": 24}}})


def test_env_carries_common_settings(chart):
    objects = render(chart, {"draftWorker": {"logLevel": "debug"}})
    for comp, (_, port, metrics_port, _) in TIERS.items():
        variables = env(objects, comp)
        assert variables["SPECDEC_HOST"] == "0.0.0.0"
        assert variables["SPECDEC_PORT"] == str(port)
        assert variables["SPECDEC_METRICS_PORT"] == str(metrics_port)
    assert env(objects, "draft-worker")["SPECDEC_LOG_LEVEL"] == "debug"
    assert env(objects, "target-worker")["SPECDEC_LOG_LEVEL"] == "info"


def test_env_carries_configured_flags(chart):
    values = {
        "coordinator": {
            "tokenizerPath": "/models/big",
            "config": {"maxNewTokens": 777, "leaseS": 2.5, "draftAddr": "d0:50061,d1:50061"},
        },
        "draftWorker": {
            "model": {"path": "/models/small"},
            "config": {"wireTopK": 7, "proposer": "ngram", "maxBatchSize": 3},
        },
        "targetWorker": {
            "config": {
                "maxBatchSize": 24,
                "maxInFlight": 96,
                "maxKvMb": 1048576,
                "dtype": "bfloat16",
                "linearKernel": "default",
                "batchAttention": "padded",
                "device": "cuda:1",
            }
        },
    }
    objects = render(chart, values)
    coordinator = env(objects, "coordinator")
    assert coordinator["SPECDEC_TOKENIZER"] == "/models/big"
    assert coordinator["SPECDEC_MAX_NEW_TOKENS"] == "777"
    assert coordinator["SPECDEC_LEASE_S"] == "2.5"
    assert coordinator["SPECDEC_DRAFT_ADDR"] == "d0:50061,d1:50061"
    assert "SPECDEC_TARGET_ADDR" not in coordinator  # "" = use the Redis registry
    draft = env(objects, "draft-worker")
    assert draft["SPECDEC_MODEL"] == "/models/small"
    assert draft["SPECDEC_WIRE_TOP_K"] == "7"
    assert draft["SPECDEC_PROPOSER"] == "ngram"
    assert draft["SPECDEC_MAX_BATCH_SIZE"] == "3"
    target = env(objects, "target-worker")
    assert target["SPECDEC_MAX_BATCH_SIZE"] == "24"
    assert target["SPECDEC_MAX_IN_FLIGHT"] == "96"
    assert draft["SPECDEC_MAX_IN_FLIGHT"] == "256"  # the chart's default, the program's too
    assert target["SPECDEC_MAX_KV_MB"] == "1048576"  # not "1.048576e+06"
    assert target["SPECDEC_DTYPE"] == "bfloat16"
    assert target["SPECDEC_LINEAR_KERNEL"] == "default"
    assert target["SPECDEC_BATCH_ATTENTION"] == "padded"
    assert draft["SPECDEC_BATCH_ATTENTION"] == "auto"
    assert draft["SPECDEC_LINEAR_KERNEL"] == "auto"  # the chart's default, the program's too
    assert target["SPECDEC_DEVICE"] == "cuda:1"
    assert target["SPECDEC_MODEL"] == "/models/target"


def test_every_config_key_becomes_its_specdec_variable(chart):
    objects = render(chart)
    for comp, (key, *_) in TIERS.items():
        variables = env(objects, comp)
        for flag in chart.values[key]["config"]:
            name = "SPECDEC_" + re.sub(r"(?<!^)(?=[A-Z])", "_", flag).upper()
            if chart.values[key]["config"][flag] not in ("", None):
                assert name in variables, f"{key}.config.{flag} does not reach {name}"


def test_null_config_value_leaves_the_program_default(chart):
    objects = render(chart, {"targetWorker": {"config": {"prefillChunk": None}}})
    assert "SPECDEC_PREFILL_CHUNK" not in env(objects, "target-worker")
    assert "SPECDEC_MAX_BATCH_TOKENS" in env(objects, "target-worker")


def test_workers_advertise_their_pod_ip(chart):
    objects = render(chart)
    for comp, (_, port, *_) in TIERS.items():
        if comp == "coordinator":
            continue
        names = [e["name"] for e in container(objects, comp)["env"]]
        variables = env(objects, comp)
        assert variables["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert variables["SPECDEC_ADVERTISE_ADDR"] == f"$(POD_IP):{port}"
        # Kubernetes only expands $(POD_IP) when it is declared earlier in the list.
        assert names.index("POD_IP") < names.index("SPECDEC_ADVERTISE_ADDR")


def test_extra_env_is_appended_last(chart):
    extra = [{"name": "SPECDEC_THREADS", "value": "9"}, {"name": "OMP_NUM_THREADS", "value": "9"}]
    names = [
        e["name"]
        for e in container(render(chart, {"targetWorker": {"extraEnv": extra}}), "target-worker")[
            "env"
        ]
    ]
    assert names[-2:] == ["SPECDEC_THREADS", "OMP_NUM_THREADS"]


def test_in_cluster_redis_is_wired_by_default(chart):
    objects = render(chart)
    service = find(objects, "Service", "redis")
    redis = container(objects, "redis")
    assert redis["image"] == "redis:7"
    # The services log in as the least-privilege ACL user; the password comes separately.
    url = f"redis://specdec@{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
    for comp in TIERS:
        assert env(objects, comp)["SPECDEC_REDIS_URL"] == url


@pytest.mark.parametrize(
    "external",
    [
        "rediss://cache.example:6380/2",
        "redis+cluster://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379/",
        "rediss+sentinel://sentinel-0:26379,sentinel-1:26379/mymaster/0",
    ],
)
def test_external_redis_replaces_the_in_cluster_one(chart, external):
    objects = render(chart, {"redis": {"enabled": False, "externalUrl": external}})
    assert [o for o in objects if component(o) == "redis"] == []
    for comp in TIERS:
        assert env(objects, comp)["SPECDEC_REDIS_URL"] == external


def test_external_redis_url_can_come_from_a_secret(chart):
    values = {"redis": {"enabled": False, "externalUrlSecret": {"name": "redis-creds", "key": "u"}}}
    objects = render(chart, values)
    for comp in TIERS:
        ref = env(objects, comp)["SPECDEC_REDIS_URL"]
        assert ref == {"secretKeyRef": {"name": "redis-creds", "key": "u"}}


def test_external_redis_without_url_fails_rendering(chart):
    with pytest.raises(helm.HelmError, match="externalUrl"):
        render(chart, {"redis": {"enabled": False}})


@pytest.mark.parametrize(
    "values",
    [
        {"targetWorker": {"replicas": -1}},
        {"draftWorker": {"replicas": "3"}},
        {"coordinator": {"replicas": 1.5}},
        {"targetWorker": {"gpu": {"count": -2}}},
        {"targetWorker": {"config": {"device": "tpu"}}},
        {"draftWorker": {"config": {"proposer": "eagle"}}},
        {"coordinator": {"port": 70000}},
        {"coordinator": {"httpPort": -1}},  # 0 is off; the program's -1 is not a chart value
        {"draftWorker": {"httpPort": 8000}},  # only the coordinator serves HTTP
        {"targetWorker": {"replica": 2}},  # a typo is not silently ignored
        {"redis": {"externalUrl": "http://not-redis"}},
        {"coordinator": {"discovery": "consul"}},
        {"otel": {"endpoint": "otel-collector:4317"}},  # OTLP endpoints are URLs
        {"targetWorker": {"autoscaling": {"inFlightPerPod": 0}}},
        {"coordinator": {"autoscaling": {"inFlightPerPod": 8}}},  # workers only
        {"networkPolicy": {"apiServerEgressPorts": []}},
    ],
    ids=lambda v: str(v),
)
def test_schema_rejects_bad_values(chart, values):
    with pytest.raises(helm.HelmValuesError):
        render(chart, values)


def test_services_are_headless_for_workers_only(chart):
    objects = render(chart)
    assert find(objects, "Service", "coordinator")["spec"]["type"] == "ClusterIP"
    for comp, (_, port, *_) in TIERS.items():
        spec = find(objects, "Service", comp)["spec"]
        assert (spec.get("clusterIP") == "None") == (comp != "coordinator")
        grpc = next(p for p in spec["ports"] if p["name"] == "grpc")
        assert (grpc["port"], grpc["targetPort"]) == (port, "grpc")
        assert spec["selector"]["app.kubernetes.io/component"] == comp


def test_selectors_match_pod_labels_and_tiers_do_not_overlap(chart):
    objects = render(chart)
    selectors = []
    for comp in (*TIERS, "redis"):
        deployment = find(objects, "Deployment", comp)
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
        # No chart-version label on pods: a chart-only upgrade must not reload every model.
        assert "helm.sh/chart" not in deployment["spec"]["template"]["metadata"]["labels"]
        assert find(objects, "Service", comp)["spec"]["selector"] == selector
        selectors.append(tuple(sorted(selector.items())))
    assert len(set(selectors)) == len(selectors)


def test_pdb_per_tier_follows_its_flag(chart):
    objects = render(chart, {"draftWorker": {"pdb": {"enabled": False}}})
    pdbs = {component(o): o for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert set(pdbs) == {"coordinator", "target-worker"}
    assert pdbs["target-worker"]["spec"]["maxUnavailable"] == 1
    selector = find(objects, "Deployment", "target-worker")["spec"]["selector"]
    assert pdbs["target-worker"]["spec"]["selector"] == selector

    objects = render(chart, {"coordinator": {"pdb": {"minAvailable": "50%"}}})
    spec = find(objects, "PodDisruptionBudget", "coordinator")["spec"]
    assert spec["minAvailable"] == "50%" and "maxUnavailable" not in spec


def test_hpa_is_per_tier_and_takes_over_replicas(chart):
    autoscaling = {"enabled": True, "minReplicas": 2, "maxReplicas": 6}
    objects = render(chart, {"draftWorker": {"autoscaling": autoscaling}})
    hpas = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert [component(h) for h in hpas] == ["draft-worker"]
    spec = hpas[0]["spec"]
    assert (
        spec["scaleTargetRef"]["name"]
        == find(objects, "Deployment", "draft-worker")["metadata"]["name"]
    )
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    assert [m["type"] for m in spec["metrics"]] == ["Pods"]  # CPU is optional on workers
    assert "replicas" not in find(objects, "Deployment", "draft-worker")["spec"]
    assert find(objects, "Deployment", "target-worker")["spec"]["replicas"] == 1


def test_service_monitors_are_optional(chart):
    objects = render(chart, {"metrics": {"serviceMonitor": {"enabled": True}}})
    monitors = {component(o): o for o in objects if o["kind"] == "ServiceMonitor"}
    assert set(monitors) == set(TIERS)
    assert monitors["target-worker"]["spec"]["endpoints"][0]["port"] == "metrics"

    objects = render(
        chart, {"metrics": {"serviceMonitor": {"enabled": True}}, "coordinator": {"metricsPort": 0}}
    )
    assert "coordinator" not in {component(o) for o in objects if o["kind"] == "ServiceMonitor"}
    main = container(objects, "coordinator")
    assert [p["name"] for p in main["ports"]] == ["grpc", "http"]
    assert "prometheus.io/scrape" not in find(objects, "Deployment", "coordinator")["spec"][
        "template"
    ]["metadata"].get("annotations", {})


def test_pods_carry_prometheus_scrape_annotations(chart):
    objects = render(chart)
    for comp, (_, _, metrics_port, _) in TIERS.items():
        annotations = find(objects, "Deployment", comp)["spec"]["template"]["metadata"][
            "annotations"
        ]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(metrics_port)


def test_containers_run_non_root_on_a_read_only_root_filesystem(chart):
    objects = render(chart)
    for comp in (*TIERS, "redis"):
        pod = find(objects, "Deployment", comp)["spec"]["template"]["spec"]
        main = container(objects, comp)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert main["securityContext"]["readOnlyRootFilesystem"] is True
        assert main["securityContext"]["allowPrivilegeEscalation"] is False
        # Only the coordinator holds an API token, for its EndpointSlice discovery.
        assert pod["automountServiceAccountToken"] is (comp == "coordinator")
        writable = {m["mountPath"] for m in main["volumeMounts"] if not m.get("readOnly")}
        assert writable == ({"/data"} if comp == "redis" else {"/tmp"})


def test_model_volume_is_mounted_read_only(chart):
    claim = {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    objects = render(chart, {"model": {"volume": claim, "mountPath": "/weights"}})
    for comp in TIERS:
        pod = find(objects, "Deployment", comp)["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "models")
        assert volume == {"name": "models", **claim}
        mount = next(m for m in container(objects, comp)["volumeMounts"] if m["name"] == "models")
        assert mount == {"name": "models", "mountPath": "/weights", "readOnly": True}


def test_scheduling_settings_are_per_tier(chart):
    toleration = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
    values = {
        "targetWorker": {"nodeSelector": {"pool": "h100"}, "tolerations": [toleration]},
        "draftWorker": {"nodeSelector": {"pool": "cpu"}},
    }
    objects = render(chart, values)
    target = find(objects, "Deployment", "target-worker")["spec"]["template"]["spec"]
    draft = find(objects, "Deployment", "draft-worker")["spec"]["template"]["spec"]
    coordinator = find(objects, "Deployment", "coordinator")["spec"]["template"]["spec"]
    assert target["nodeSelector"] == {"pool": "h100"} and target["tolerations"] == [toleration]
    assert draft["nodeSelector"] == {"pool": "cpu"} and "tolerations" not in draft
    assert "nodeSelector" not in coordinator


def test_image_defaults_to_app_version_and_tiers_can_override(chart):
    values = {
        "image": {"repository": "reg.example/specdec", "tag": "1.2.3"},
        "targetWorker": {"image": {"tag": "1.2.3-cuda"}},
    }
    objects = render(chart, values)
    assert container(objects, "coordinator")["image"] == "reg.example/specdec:1.2.3"
    assert container(objects, "target-worker")["image"] == "reg.example/specdec:1.2.3-cuda"
    default = render(chart)
    assert container(default, "draft-worker")["image"] == f"specdec:{chart.metadata['appVersion']}"


def test_worked_gpu_example_renders_as_documented(chart):
    values = yaml.safe_load((REPO / "deploy/helm/examples/gpu-values.yaml").read_text())
    objects = render(chart, values)
    assert find(objects, "Deployment", "target-worker")["spec"]["replicas"] == 4
    assert container(objects, "target-worker")["resources"]["limits"][GPU] == 1
    assert container(objects, "draft-worker")["resources"]["limits"][GPU] == 1
    assert GPU not in container(objects, "coordinator")["resources"].get("limits", {})
    assert env(objects, "target-worker")["SPECDEC_DEVICE"] == "cuda"
    assert env(objects, "coordinator")["SPECDEC_REDIS_URL"] == {
        "secretKeyRef": {"name": "specdec-redis", "key": "url"}
    }
    assert [o for o in objects if component(o) == "redis"] == []
    # The URL Secret carries the password; the policies open the external Redis's port.
    assert "SPECDEC_REDIS_PASSWORD" not in env(objects, "coordinator")
    assert ("coordinator", "external-redis", 6380, "TCP") in allowed_flows(objects)


def test_long_release_names_keep_resource_names_within_dns_limits(chart):
    manifests = chart.render(name="r" * 53, namespace=NAMESPACE)
    objects = [
        obj
        for path, text in manifests.items()
        if not path.endswith("NOTES.txt")
        for obj in yaml.safe_load_all(text)
        if obj
    ]
    assert max(len(o["metadata"]["name"]) for o in objects) <= 63
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert len(deployments) == 4  # truncation keeps the tiers apart


# --- Security: NetworkPolicies -----------------------------------------------------------
#
# A small NetworkPolicy evaluator: which (from, to, port, protocol) flows do the rendered
# policies allow between the release's pods and a few stand-ins for the rest of the world?
# A flow needs both an egress allowance at its source and an ingress allowance at its
# destination; a pod that no policy of a direction selects is open in that direction.

NS_NAME = "kubernetes.io/metadata.name"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    name: str
    namespace: str | None  # None: outside the cluster (reached by ipBlock only)
    labels: dict[str, str]
    ip: str
    ports: tuple[tuple[int, str], ...]  # what it listens on: (port, protocol)
    release: bool = False

    def __hash__(self) -> int:
        return hash(self.name)


# Stand-ins for everything that is not a pod of the release.
OUTSIDERS = (
    Endpoint("client", "apps", {"app": "web"}, "10.244.9.1", ((443, "TCP"),)),
    Endpoint("same-namespace-pod", NAMESPACE, {"app": "other"}, "10.244.9.2", ((443, "TCP"),)),
    Endpoint(
        "other-release-pod",
        NAMESPACE,
        {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/instance": "other"},
        "10.244.9.3",
        ((443, "TCP"),),
    ),
    Endpoint(
        "prometheus",
        "monitoring",
        {"app.kubernetes.io/name": "prometheus"},
        "10.244.9.4",
        ((9090, "TCP"),),
    ),
    Endpoint(
        "kube-dns", "kube-system", {"k8s-app": "kube-dns"}, "10.96.0.10", ((53, "UDP"), (53, "TCP"))
    ),
    Endpoint("internet", None, {}, "203.0.113.7", ((443, "TCP"),)),
    Endpoint("external-redis", None, {}, "10.20.0.5", ((6379, "TCP"), (6380, "TCP"))),
    # The API server's endpoint (host network) as a policy sees it after Service NAT.
    Endpoint("kube-apiserver", None, {}, "10.0.0.10", ((443, "TCP"), (6443, "TCP"))),
    Endpoint(
        "otel-collector",
        "observability",
        {"app.kubernetes.io/name": "opentelemetry-collector"},
        "10.244.9.5",
        ((4317, "TCP"), (4318, "TCP")),
    ),
)
OUTSIDER_NAMES = {o.name for o in OUTSIDERS}
API_PORTS = (443, 6443)
# apiServerEgress [] (the default): the coordinator may reach any address on the API ports.
ANY_API_SERVER = {(o.name, p) for o in OUTSIDERS for p, _ in o.ports if p in API_PORTS}


def endpoints(objects: list[dict[str, Any]]) -> list[Endpoint]:
    """The release's pods (one per Deployment, listening on its container ports) and OUTSIDERS."""
    pods = []
    for n, deployment in enumerate(o for o in objects if o["kind"] == "Deployment"):
        template = deployment["spec"]["template"]
        ports = tuple(
            (p["containerPort"], p.get("protocol", "TCP"))
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
        )
        pods.append(
            Endpoint(
                component(deployment),
                deployment["metadata"]["namespace"],
                template["metadata"]["labels"],
                f"10.244.0.{n + 1}",
                ports,
                release=True,
            )
        )
    return pods + list(OUTSIDERS)


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector: matchLabels and matchExpressions; {} selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        if operator in ("In", "NotIn"):
            ok = (labels.get(key) in expression["values"]) == (operator == "In")
        else:
            ok = (key in labels) == (operator == "Exists")
        if not ok:
            return False
    return True


def peer_matches(peer: dict[str, Any], policy_namespace: str, other: Endpoint) -> bool:
    """A NetworkPolicyPeer. ipBlock matches by address (pods included: an over-approximation);
    pod/namespace selectors match pods only, in the policy's namespace unless a
    namespaceSelector says otherwise."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(other.ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", [])
        )
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], {NS_NAME: other.namespace}):
            return False
    elif other.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector"), other.labels)


def port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True  # no ports listed: every port
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        if "port" not in entry:
            return True
        assert isinstance(entry["port"], int), "the evaluator takes numeric ports only"
        if entry["port"] <= port <= entry.get("endPort", entry["port"]):
            return True
    return False


def policy_types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in spec else [])


def direction_allows(
    policies, pod: Endpoint, direction: str, other: Endpoint, port: int, protocol: str
) -> bool:
    """Whether `pod` may send to (Egress) or receive from (Ingress) `other` on port/protocol."""
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and selects(p["spec"]["podSelector"], pod.labels)
        and direction in policy_types(p)
    ]
    if not selecting:
        return True
    rules, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return any(
        (
            not rule.get(peers)
            or any(peer_matches(x, p["metadata"]["namespace"], other) for x in rule[peers])
        )
        and port_matches(rule.get("ports"), port, protocol)
        for p in selecting
        for rule in p["spec"].get(rules) or []
    )


def allowed_flows(objects: list[dict[str, Any]]) -> set[tuple[str, str, int, str]]:
    """Every (from, to, port, protocol) the NetworkPolicies allow that involves a release pod."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    everyone = endpoints(objects)
    flows = set()
    for source in everyone:
        for target in everyone:
            if not (source.release or target.release):
                continue
            for port, protocol in target.ports:
                if direction_allows(
                    policies, source, "Egress", target, port, protocol
                ) and direction_allows(policies, target, "Ingress", source, port, protocol):
                    flows.add((source.name, target.name, port, protocol))
    return flows


def documented_flows(
    clients=OUTSIDER_NAMES,
    redis: tuple[str, int] = ("redis", 6379),
    http_port: int = 8000,
    api_server: set[tuple[str, int]] = ANY_API_SERVER,
    otel: set[tuple[str, int]] = frozenset(),
) -> set[tuple[str, str, int, str]]:
    """The flow table of deploy/README.md ("Security"): clients -> coordinator gRPC and
    (unless httpPort is 0) HTTP; coordinator -> worker gRPC; the three tiers -> Redis and
    DNS; Prometheus -> metrics; coordinator -> the API server's `(name, port)`s (Kubernetes
    discovery); the three tiers -> the OTLP collector's `(name, port)`s (otel.endpoint)."""
    flows = {(c, "coordinator", 50051, "TCP") for c in clients}
    flows |= {("coordinator", name, port, "TCP") for name, port in api_server}
    flows |= {(comp, name, port, "TCP") for comp in TIERS for name, port in otel}
    if http_port:
        flows |= {(c, "coordinator", http_port, "TCP") for c in clients}
    flows |= {("coordinator", "draft-worker", 50061, "TCP")}
    flows |= {("coordinator", "target-worker", 50071, "TCP")}
    for comp, (_, _, metrics_port, _) in TIERS.items():
        flows.add((comp, redis[0], redis[1], "TCP"))
        flows.add(("prometheus", comp, metrics_port, "TCP"))
        flows |= {(comp, "kube-dns", 53, "UDP"), (comp, "kube-dns", 53, "TCP")}
    return flows


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


# --- Security: TLS, cert-manager, API keys, reflection -----------------------------------

TLS_DIR = "/etc/specdec/tls"
TLS_VALUES = {
    "tls": {
        "enabled": True,
        "serverName": "workers.specdec.internal",
        "clientCA": {"enabled": True},
        "certManager": {"enabled": True, "caSecretName": "specdec-ca"},
    },
    "apiKeys": {"enabled": True, "existingSecret": "specdec-api-keys"},
}


def pod_spec(objects, comp: str) -> dict[str, Any]:
    return find(objects, "Deployment", comp)["spec"]["template"]["spec"]


def mounted_secret(objects, comp: str, path: str) -> str:
    """The Secret behind the file `path` of a tier's container: it must sit directly in a
    read-only mount of a whole Secret volume (no subPath, or rotation would not reach it)."""
    mounts = [
        m for m in container(objects, comp)["volumeMounts"] if path.startswith(m["mountPath"] + "/")
    ]
    assert len(mounts) == 1, f"{comp}: {path} is in no mount"
    mount = mounts[0]
    assert "subPath" not in mount and "subPathExpr" not in mount
    assert mount["readOnly"] is True
    assert "/" not in path[len(mount["mountPath"]) + 1 :]  # a key of the Secret itself
    volume = next(v for v in pod_spec(objects, comp)["volumes"] if v["name"] == mount["name"])
    return volume["secret"]["secretName"]


def test_tls_is_off_by_default(chart):
    objects = render(chart)
    for comp in TIERS:
        assert not [n for n in env(objects, comp) if "TLS" in n or n == "SPECDEC_API_KEYS_FILE"]
        assert not [v for v in pod_spec(objects, comp)["volumes"] if "secret" in v]
    assert not [o for o in objects if o["kind"] in ("Certificate", "Issuer")]


def test_tls_env_points_at_the_mounted_secret_files(chart):
    objects = render(chart, TLS_VALUES)
    for comp in TIERS:
        variables = env(objects, comp)
        assert variables["SPECDEC_TLS_CERT"] == f"{TLS_DIR}/tls.crt"
        assert variables["SPECDEC_TLS_KEY"] == f"{TLS_DIR}/tls.key"
        assert variables["SPECDEC_TLS_CA"] == f"{TLS_DIR}/ca.crt"
        for name in ("SPECDEC_TLS_CERT", "SPECDEC_TLS_KEY", "SPECDEC_TLS_CA"):
            assert mounted_secret(objects, comp, variables[name]) == f"{RELEASE}-specdec-{comp}-tls"
        # Every mounted file the services read comes from a whole-Secret mount.
        for value in variables.values():
            if isinstance(value, str) and value.startswith("/etc/specdec/"):
                mounted_secret(objects, comp, value)
        if comp != "coordinator":
            assert not {
                "SPECDEC_WORKER_TLS_CERT",
                "SPECDEC_TLS_SERVER_NAME",
                "SPECDEC_API_KEYS_FILE",
            } & set(variables)
    coordinator = env(objects, "coordinator")
    assert coordinator["SPECDEC_WORKER_TLS_CERT"] == f"{TLS_DIR}/tls.crt"
    assert coordinator["SPECDEC_WORKER_TLS_KEY"] == f"{TLS_DIR}/tls.key"
    assert coordinator["SPECDEC_TLS_SERVER_NAME"] == "workers.specdec.internal"
    assert coordinator["SPECDEC_TLS_CLIENT_CA"] == f"{TLS_DIR}/ca.crt"  # default: the cluster CA


def test_tls_separate_secrets_for_the_worker_client_cert_and_the_cas(chart):
    values = {
        "tls": {
            "enabled": True,
            "coordinator": {"secretName": "coord-cert", "workerClientSecretName": "coord-client"},
            "targetWorker": {"secretName": "target-cert"},
            "caSecret": {"name": "trust-bundle", "key": "bundle.pem"},
            "clientCA": {"enabled": True, "secretName": "partner-ca", "key": "ca.pem"},
        }
    }
    objects = render(chart, values)
    coordinator = env(objects, "coordinator")
    expected = {
        "SPECDEC_TLS_CERT": "coord-cert",
        "SPECDEC_WORKER_TLS_CERT": "coord-client",
        "SPECDEC_WORKER_TLS_KEY": "coord-client",
        "SPECDEC_TLS_CA": "trust-bundle",
        "SPECDEC_TLS_CLIENT_CA": "partner-ca",
    }
    for name, secret in expected.items():
        assert mounted_secret(objects, "coordinator", coordinator[name]) == secret, name
    assert coordinator["SPECDEC_TLS_CA"].endswith("/bundle.pem")
    assert coordinator["SPECDEC_TLS_CLIENT_CA"].endswith("/ca.pem")
    assert coordinator["SPECDEC_TLS_SERVER_NAME"] == f"{RELEASE}-specdec-worker"  # the default
    target = env(objects, "target-worker")
    assert mounted_secret(objects, "target-worker", target["SPECDEC_TLS_CERT"]) == "target-cert"
    assert mounted_secret(objects, "target-worker", target["SPECDEC_TLS_CA"]) == "trust-bundle"
    draft = env(objects, "draft-worker")
    assert (
        mounted_secret(objects, "draft-worker", draft["SPECDEC_TLS_KEY"])
        == f"{RELEASE}-specdec-draft-worker-tls"
    )


def test_tls_probes_check_grpc_health_over_tls_inside_the_container(chart):
    """The kubelet's gRPC probe cannot speak TLS, so with TLS on each probe execs a health
    check that presents the pod's own certificate and expects the tier's certificate name."""
    objects = render(chart, TLS_VALUES)
    for comp, (_, port, *_) in TIERS.items():
        main = container(objects, comp)
        variables = env(objects, comp)
        name = (
            "workers.specdec.internal"
            if comp != "coordinator"
            else f"{RELEASE}-specdec-coordinator"
        )
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = main[probe]["exec"]["command"]
            assert command[:2] == ["python", "-c"] and "grpc" not in main[probe]
            assert command[3:8] == [
                str(port),
                variables["SPECDEC_TLS_CA"],
                variables["SPECDEC_TLS_CERT"],
                variables["SPECDEC_TLS_KEY"],
                name,
            ]
            assert float(command[8]) < main[probe]["timeoutSeconds"]


def _issue(directory: Path, name: str, ca=None, hosts=("localhost",)):
    """A P-256 certificate for `hosts` (server and client use), self-signed CA when ca is None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca[1].subject if ca else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(h) for h in hosts]), critical=False
        ).add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    cert = builder.sign(ca[0] if ca else key, hashes.SHA256())
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return key, cert


def test_rendered_tls_probe_passes_only_against_a_serving_mutual_tls_port(chart, tmp_path):
    """Run the rendered probe command against a real mutual-TLS gRPC health server."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    ca = _issue(tmp_path, "ca")
    _issue(tmp_path, "tls", ca, hosts=["workers.specdec.internal"])
    (tmp_path / "ca.crt").rename(tmp_path / "cluster-ca.crt")
    read = lambda name: (tmp_path / name).read_bytes()  # noqa: E731
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [(read("tls.key"), read("tls.crt"))],
        root_certificates=read("cluster-ca.crt"),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        command = container(render(chart, TLS_VALUES), "target-worker")["readinessProbe"]["exec"][
            "command"
        ]
        files = {"ca.crt": "cluster-ca.crt", "tls.crt": "tls.crt", "tls.key": "tls.key"}
        local = (
            [sys.executable, command[1], command[2], str(port)]
            + [str(tmp_path / files[Path(arg).name]) for arg in command[4:7]]
            + command[7:]
        )

        def probe(args=local) -> int:
            return subprocess.run(args, capture_output=True, timeout=60).returncode

        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe() != 0
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe() == 0
        assert probe([*local[:7], "someone-else", local[8]]) != 0  # name checked
    finally:
        server.stop(None)


def test_cert_manager_certificates_carry_the_server_name_and_service_names(chart):
    objects = render(chart, TLS_VALUES)
    issuer = next(o for o in objects if o["kind"] == "Issuer")
    assert issuer["spec"] == {"ca": {"secretName": "specdec-ca"}}
    certificates = {component(o): o for o in objects if o["kind"] == "Certificate"}
    assert set(certificates) == set(TIERS)
    for comp, certificate in certificates.items():
        spec = certificate["spec"]
        service = find(objects, "Service", comp)["metadata"]["name"]
        service_names = [
            service,
            f"{service}.{NAMESPACE}",
            f"{service}.{NAMESPACE}.svc",
            f"{service}.{NAMESPACE}.svc.cluster.local",
        ]
        assert set(service_names) <= set(spec["dnsNames"])
        # Worker certificates carry the name the coordinator checks; the coordinator's does
        # not (it would let the coordinator's key impersonate a worker).
        assert ("workers.specdec.internal" in spec["dnsNames"]) == (comp != "coordinator")
        assert spec["secretName"] == mounted_secret(
            objects, comp, env(objects, comp)["SPECDEC_TLS_CERT"]
        )
        assert {"server auth", "client auth"} <= set(spec["usages"])
        assert (spec["duration"], spec["renewBefore"]) == ("2160h", "360h")
        assert spec["issuerRef"] == {
            "name": issuer["metadata"]["name"],
            "kind": "Issuer",
            "group": "cert-manager.io",
        }
        assert spec["privateKey"]["rotationPolicy"] == "Always"

    values = copy.deepcopy(TLS_VALUES)
    values["tls"]["certManager"] = {
        "enabled": True,
        "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"},
        "duration": "720h",
        "renewBefore": "240h",
        "coordinatorDnsNames": ["api.example.com"],
    }
    objects = render(chart, values)
    assert not [o for o in objects if o["kind"] == "Issuer"]
    coordinator = find(objects, "Certificate", "coordinator")["spec"]
    assert coordinator["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert "api.example.com" in coordinator["dnsNames"]
    assert (coordinator["duration"], coordinator["renewBefore"]) == ("720h", "240h")


def test_cert_manager_needs_an_issuer_or_a_ca(chart):
    with pytest.raises(helm.HelmRenderError, match="caSecretName"):
        render(chart, {"tls": {"enabled": True, "certManager": {"enabled": True}}})


def test_api_keys_file_is_mounted_and_passed_to_the_coordinator_only(chart):
    objects = render(chart, {"apiKeys": {"enabled": True, "existingSecret": "keys", "key": "k"}})
    path = env(objects, "coordinator")["SPECDEC_API_KEYS_FILE"]
    assert path == "/etc/specdec/api-keys/k"
    assert mounted_secret(objects, "coordinator", path) == "keys"
    for comp in ("draft-worker", "target-worker"):
        assert "SPECDEC_API_KEYS_FILE" not in env(objects, comp)
    assert "SPECDEC_API_KEYS_FILE" not in env(render(chart), "coordinator")
    with pytest.raises(helm.HelmError, match="existingSecret"):
        render(chart, {"apiKeys": {"enabled": True}})


def test_reflection_is_off_unless_asked_for(chart):
    for comp in TIERS:
        assert env(render(chart), comp).get("SPECDEC_REFLECTION", "false") == "false"
        assert env(render(chart, {"reflection": True}), comp)["SPECDEC_REFLECTION"] == "true"


# --- Security: Redis authentication ------------------------------------------------------


def redis_secret(objects) -> dict[str, Any]:
    return find(objects, "Secret", "redis")


def test_bundled_redis_takes_its_password_from_the_generated_secret(chart):
    objects = render(chart)
    secret = redis_secret(objects)
    name = secret["metadata"]["name"]
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    redis = container(objects, "redis")
    ref = {"secretKeyRef": {"name": name, "key": "password"}}
    assert env(objects, "redis") == {"REDIS_PASSWORD": ref, "REDISCLI_AUTH": ref}
    # The password never appears in the pod spec: only $(REDIS_PASSWORD), expanded by Kubernetes.
    deployment = yaml.safe_dump(find(objects, "Deployment", "redis"))
    assert password not in deployment
    args = redis["args"]
    assert [a for a in args if "REDIS_PASSWORD" in a] == [">$(REDIS_PASSWORD)"]
    assert "--requirepass" not in args
    # The specdec ACL user; the default user (all commands) is off.
    assert args[args.index("--user") : args.index("--user") + 3] == ["--user", "default", "off"]
    user = args[len(args) - args[::-1].index("--user") :]
    assert user[:3] == ["specdec", "on", ">$(REDIS_PASSWORD)"]
    assert user[3:] == chart.values["redis"]["auth"]["aclRules"].split()
    assert "redis-cli -p 6379 --user specdec" in " ".join(
        redis["readinessProbe"]["exec"]["command"]
    )
    for comp in TIERS:
        assert env(objects, comp)["SPECDEC_REDIS_PASSWORD"] == ref
        assert env(objects, comp)["SPECDEC_REDIS_URL"].startswith("redis://specdec@")
    for obj in objects:
        if obj is not secret:
            assert password not in yaml.safe_dump(obj)


def test_redis_password_from_an_existing_secret(chart):
    objects = render(chart, {"redis": {"auth": {"existingSecret": "corp-redis", "key": "pw"}}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    ref = {"secretKeyRef": {"name": "corp-redis", "key": "pw"}}
    assert env(objects, "redis")["REDIS_PASSWORD"] == ref
    for comp in TIERS:
        assert env(objects, comp)["SPECDEC_REDIS_PASSWORD"] == ref


def test_redis_without_acl_user_uses_requirepass(chart):
    objects = render(chart, {"redis": {"auth": {"username": ""}}})
    args = container(objects, "redis")["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert "--user" not in args
    assert (
        env(objects, "coordinator")["SPECDEC_REDIS_URL"]
        == f"redis://{RELEASE}-specdec-redis:6379/0"
    )


def test_redis_auth_can_be_turned_off(chart):
    objects = render(chart, {"redis": {"auth": {"enabled": False}}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    assert "env" not in container(objects, "redis")
    assert not {"--requirepass", "--user"} & set(container(objects, "redis")["args"])
    for comp in TIERS:
        assert "SPECDEC_REDIS_PASSWORD" not in env(objects, comp)


def test_external_redis_gets_the_password_secret_and_its_ca(chart):
    values = {
        "redis": {
            "enabled": False,
            "externalUrl": "rediss://specdec@cache.example:6380/0",
            "auth": {"existingSecret": "cache-pw"},
            "caSecret": {"name": "cache-ca"},
        }
    }
    objects = render(chart, values)
    assert not [o for o in objects if o["kind"] == "Secret"]
    for comp in TIERS:
        variables = env(objects, comp)
        assert variables["SPECDEC_REDIS_PASSWORD"] == {
            "secretKeyRef": {"name": "cache-pw", "key": "password"}
        }
        assert variables["SPECDEC_REDIS_CA"] == "/etc/specdec/redis-ca/ca.crt"
        assert mounted_secret(objects, comp, variables["SPECDEC_REDIS_CA"]) == "cache-ca"
    # Without a password Secret the URL (e.g. externalUrlSecret) carries the credentials.
    values["redis"]["auth"] = {"existingSecret": ""}
    assert "SPECDEC_REDIS_PASSWORD" not in env(render(chart, values), "coordinator")


LUA_CALL = re.compile(r"redis\.call\('(\w+)'")
# Commands redis-py sends for the client-side calls of coordinator/store.py and
# specdec/serving/registry.py: register_script -> EVALSHA (SCRIPT LOAD on NOSCRIPT, SCRIPT
# EXISTS + LOAD in pipelines; never EVAL; no MULTI/EXEC: a session is read by a script);
# hgetall, lrange, get, set (cancel, heartbeat), delete -> DEL; the registry's index set:
# sadd, srem, smembers, and mget of the entries it names.
CLIENT_COMMANDS = {
    "evalsha", "script|load", "script|exists",
    "hgetall", "lrange", "get", "set", "del", "sadd", "srem", "smembers", "mget",
}  # fmt: skip
# On connect: AUTH (HELLO with RESP3), SELECT for a database other than 0; PING: the probe.
CONNECTION_COMMANDS = {"hello", "auth", "ping", "select"}


def test_redis_acl_grants_exactly_the_commands_specdec_issues(chart):
    from specdec.serving.registry import REDIS_ACL

    store = (REPO / "coordinator" / "store.py").read_text()
    lua = {name.lower() for name in LUA_CALL.findall(store)}
    assert {"hset", "rpush", "hincrby", "pexpire"} <= lua  # the scripts were found
    rules = chart.values["redis"]["auth"]["aclRules"].split()
    assert rules[:4] == ["resetkeys", "~specdec:*", "resetchannels", "-@all"]
    assert all(r.startswith("+") and "@" not in r for r in rules[4:])  # commands, no categories
    assert {r[1:] for r in rules[4:]} == lua | CLIENT_COMMANDS | CONNECTION_COMMANDS
    # Never more than the project's documented user (specdec/serving/registry.py), which the
    # service tests run every store and registry operation as.
    assert set(rules) <= set(REDIS_ACL)
    assert 'PREFIX = "specdec:' in store  # every key is under the ACL's key pattern
    registry = (REPO / "specdec" / "serving" / "registry.py").read_text()
    assert 'PREFIX = "specdec:' in registry


# --- Kubernetes discovery, autoscaling on custom metrics, tracing --------------------------

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
