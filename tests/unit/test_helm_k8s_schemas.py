"""Every object the Helm chart renders is valid against Kubernetes' own OpenAPI schemas.

The schemas come with the pinned kubernetes-validate wheel (offline, strict mode: unknown
fields are errors). The chart is rendered with its defaults, with each example values file,
and with cert-manager's CA Issuer on, and validated against the chart's oldest supported
Kubernetes (Chart.yaml kubeVersion) and the two newest minor versions the wheel ships.
Objects of CRDs (cert-manager, Prometheus Operator) have no core schema: they are skipped by
kind, exactly those kinds, and checked structurally instead.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "deploy" / "helm" / "specdec"
EXAMPLES = sorted((REPO / "deploy" / "helm" / "examples").glob("*.yaml"))

# Kinds from CRDs, with the apiVersion and the spec fields their CRDs require.
CRD_KINDS = {
    "Certificate": ("cert-manager.io/v1", {"secretName", "issuerRef"}),
    "Issuer": ("cert-manager.io/v1", set()),  # one of ca, acme, vault, ... (checked below)
    "ServiceMonitor": ("monitoring.coreos.com/v1", {"selector", "endpoints"}),
}
VALUES_SETS = {
    "defaults": {},
    **{f"examples/{path.name}": yaml.safe_load(path.read_text()) for path in EXAMPLES},
    "cert-manager CA issuer": {
        "tls": {"enabled": True, "certManager": {"enabled": True, "caSecretName": "specdec-ca"}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
}


def minor_versions() -> list[str]:
    """The Kubernetes versions of the wheel's schemas, one per minor, oldest first."""
    return sorted({v for v in all_versions() if re.fullmatch(r"\d+\.\d+\.0", v)}, key=Version)


def chart_floor() -> str:
    """The oldest Kubernetes the chart supports (kubeVersion ">=1.27.0-0" -> "1.27.0")."""
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    return re.match(r">=\s*(\d+\.\d+\.\d+)", chart["kubeVersion"])[1]


KUBERNETES_VERSIONS = (chart_floor(), *minor_versions()[-2:])


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render(chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = chart.render(values=values, name="rel", namespace="serving")
    return [
        obj
        for path, text in manifests.items()
        if not path.endswith("NOTES.txt")
        for obj in yaml.safe_load_all(text)
        if obj
    ]


def schema_errors(obj: dict[str, Any], version: str) -> list[str]:
    """What Kubernetes' `version` schema (strict) says against `obj`; [] when it is valid.
    A kind without a schema raises SchemaNotFoundError: nothing is skipped silently."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        where = ".".join(str(p) for p in error.path)
        return [f"{obj['kind']}/{obj['metadata']['name']} @ {version}: {where}: {error.message}"]
    return []


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """The structure the CRD's schema would require: apiVersion, name, namespace, spec."""
    api_version, required = CRD_KINDS[obj["kind"]]
    name = f"{obj['kind']}/{obj.get('metadata', {}).get('name')}"
    errors = []
    if obj.get("apiVersion") != api_version:
        errors.append(f"{name}: apiVersion {obj.get('apiVersion')} is not {api_version}")
    if not obj.get("metadata", {}).get("name") or not obj["metadata"].get("namespace"):
        errors.append(f"{name}: metadata.name and metadata.namespace are required")
    spec = obj.get("spec") or {}
    if missing := required - set(spec):
        errors.append(f"{name}: spec lacks {sorted(missing)}")
    if obj["kind"] == "Certificate" and not spec.get("issuerRef", {}).get("name"):
        errors.append(f"{name}: spec.issuerRef.name is required")
    if obj["kind"] == "Issuer" and len(set(spec) & {"ca", "acme", "vault", "selfSigned"}) != 1:
        errors.append(f"{name}: spec needs exactly one issuer type")
    if obj["kind"] == "ServiceMonitor" and not all("port" in e for e in spec.get("endpoints", [])):
        errors.append(f"{name}: every endpoint needs a port")
    return errors


def test_versions_are_the_chart_floor_and_the_two_newest():
    assert len(set(KUBERNETES_VERSIONS)) == 3
    assert Version(KUBERNETES_VERSIONS[-1]) >= Version("1.37.0")  # the pinned wheel's newest
    assert KUBERNETES_VERSIONS[0] == "1.27.0"


@pytest.mark.parametrize("name", list(VALUES_SETS))
def test_every_rendered_object_is_valid_against_kubernetes_schemas(chart, name):
    objects = render(chart, VALUES_SETS[name])
    errors = []
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            errors += crd_errors(obj)
            continue
        for version in KUBERNETES_VERSIONS:
            errors += schema_errors(obj, version)
    assert errors == []


def test_the_values_sets_cover_every_kind_the_chart_renders(chart):
    kinds = {obj["kind"] for values in VALUES_SETS.values() for obj in render(chart, values)}
    assert {
        "Deployment",
        "Service",
        "ServiceAccount",
        "Secret",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "Role",
        "RoleBinding",
    } <= kinds
    assert set(CRD_KINDS) <= kinds  # every skipped kind is rendered (the list is not stale)


def deployment(chart) -> dict[str, Any]:
    return next(o for o in render(chart, {}) if o["kind"] == "Deployment")


def test_the_validator_rejects_a_wrong_type(chart):
    broken = copy.deepcopy(deployment(chart))
    broken["spec"]["replicas"] = "two"
    for version in KUBERNETES_VERSIONS:
        (error,) = schema_errors(broken, version)
        assert "spec.replicas" in error and "'two'" in error


def test_the_validator_rejects_an_unknown_field_in_strict_mode(chart):
    broken = copy.deepcopy(deployment(chart))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    for version in KUBERNETES_VERSIONS:
        (error,) = schema_errors(broken, version)
        assert "imagePullPolicyy" in error


def test_the_validator_knows_no_crd_kind(chart):
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "x", "namespace": "serving"},
    }
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        schema_errors(monitor, KUBERNETES_VERSIONS[-1])


def test_the_crd_check_rejects_a_malformed_certificate(chart):
    values = VALUES_SETS["cert-manager CA issuer"]
    certificate = next(o for o in render(chart, values) if o["kind"] == "Certificate")
    assert crd_errors(certificate) == []
    broken = copy.deepcopy(certificate)
    del broken["spec"]["issuerRef"]
    broken["apiVersion"] = "cert-manager.io/v1alpha2"
    assert len(crd_errors(broken)) == 3
