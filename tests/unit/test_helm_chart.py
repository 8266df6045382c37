"""The Helm chart in deploy/helm/specdec, rendered by the real Helm engine (helm-python-sdk)."""

from __future__ import annotations

import importlib.util
import re
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
        assert ports == {"grpc": port, "metrics": metrics_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["grpc"] == {"port": port}
            assert "httpGet" not in main[probe] and "tcpSocket" not in main[probe]


def test_startup_probe_budget_covers_model_loading_and_is_configurable(chart):
    objects = render(chart)
    for comp in ("draft-worker", "target-worker"):
        startup = container(objects, comp)["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    probes = {"startup": {"periodSeconds": 15, "failureThreshold": 400}}
    startup = container(render(chart, {"targetWorker": {"probes": probes}}), "target-worker")[
        "startupProbe"
    ]
    assert (startup["periodSeconds"], startup["failureThreshold"]) == (15, 400)
    assert startup["grpc"] == {"port": 50071}


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
                "maxKvMb": 1048576,
                "dtype": "bfloat16",
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
    assert target["SPECDEC_MAX_KV_MB"] == "1048576"  # not "1.048576e+06"
    assert target["SPECDEC_DTYPE"] == "bfloat16"
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
    url = f"redis://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
    for comp in TIERS:
        assert env(objects, comp)["SPECDEC_REDIS_URL"] == url


def test_external_redis_replaces_the_in_cluster_one(chart):
    external = "rediss://cache.example:6380/2"
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
        {"targetWorker": {"replica": 2}},  # a typo is not silently ignored
        {"redis": {"externalUrl": "http://not-redis"}},
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
    assert spec["metrics"][0]["resource"]["name"] == "cpu"
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
    assert [p["name"] for p in main["ports"]] == ["grpc"]
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
        assert pod["automountServiceAccountToken"] is False
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
