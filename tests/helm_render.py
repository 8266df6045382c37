"""The Helm chart's test helpers (tests/unit/test_helm_*.py): rendering through the real Helm
engine (helm-python-sdk), finding a tier's objects, and a small NetworkPolicy evaluator."""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
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


def probe_budget(probe: dict[str, Any]) -> int:
    """Seconds a probe tolerates failing before it acts."""
    return probe["periodSeconds"] * probe["failureThreshold"]


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
