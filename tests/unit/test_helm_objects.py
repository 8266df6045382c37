"""The Helm chart's Redis wiring, Services, PodDisruptionBudgets, autoscalers, monitors, pod
security, scheduling and images, rendered by the real Helm engine."""

from __future__ import annotations

import helm_python as helm  # pinned in the dev extras: a broken install must fail, not skip
import pytest
import yaml
from helm_render import (
    GPU,
    NAMESPACE,
    REPO,
    TIERS,
    allowed_flows,
    component,
    container,
    env,
    find,
    render,
)


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
