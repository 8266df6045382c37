"""Where the coordinator finds workers besides --draft-addr/--target-addr (`--discovery`):
the Redis registry that workers heartbeat into (redis), the ready endpoints of Kubernetes
EndpointSlices (kubernetes, in coordinator/endpointslices.py), or nowhere (static)."""

from __future__ import annotations

import logging
import os
from typing import Protocol

from specdec.serving.registry import list_workers

log = logging.getLogger(__name__)

MODES = ("redis", "kubernetes", "static")
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class DiscoveryConfigError(ValueError):
    """Discovery flags that cannot work; the message names the flag."""


class Discovery(Protocol):
    """A source of worker addresses that `WorkerPool.refresh` reads, shared by both pools."""

    async def start(self) -> None: ...

    async def addresses(self, role: str) -> dict[str, float]:
        """The discovered workers of `role` now: address → load hint (0.0 when unknown)."""
        ...

    async def close(self) -> None: ...


class StaticDiscovery:
    """--discovery static: no workers beyond the static addresses. Also the base of the
    discoveries that have nothing to start or close (no thread, no client of their own)."""

    async def start(self) -> None:
        return None

    async def addresses(self, role: str) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


class RedisDiscovery(StaticDiscovery):
    """--discovery redis: the workers whose registry entry (heartbeat TTL) is alive, with the
    load they report (the Redis client is the caller's, which closes it)."""

    def __init__(self, redis):
        self.redis = redis
        self._last: dict[str, dict[str, float]] = {}  # role → the last registry read

    async def addresses(self, role: str) -> dict[str, float]:
        """The registered workers; while the registry cannot be read (Redis down, paused,
        failing over), the ones of the last good read — a Redis blip drops no worker."""
        try:
            entries = await list_workers(self.redis, role)
        except Exception as exc:  # noqa: BLE001 - keep the workers we know
            log.warning("registry read failed, keeping the last known workers: %s", exc)
            return dict(self._last.get(role, {}))
        found = {entry["address"]: float(entry.get("load", 0.0)) for entry in entries}
        self._last[role] = found
        return dict(found)


def pod_namespace() -> str:
    """The namespace of the pod this runs in, or `default` outside a pod."""
    try:
        with open(NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def check_discovery(settings) -> None:
    """Refuse, naming the flag, discovery settings that cannot work (before any work)."""
    if settings.discovery not in MODES:
        raise DiscoveryConfigError(
            f"--discovery must be one of {', '.join(MODES)}, not {settings.discovery!r}"
        )
    if settings.discovery != "kubernetes":
        return
    for flag, selector in (
        ("--k8s-draft-selector", settings.k8s_draft_selector),
        ("--k8s-target-selector", settings.k8s_target_selector),
    ):
        if not selector.strip():
            raise DiscoveryConfigError(
                f"--discovery kubernetes needs {flag}: the label selector of that tier's "
                "EndpointSlices, e.g. kubernetes.io/service-name=specdec-draft-worker"
            )
    if settings.kubeconfig and not os.path.isfile(settings.kubeconfig):
        raise DiscoveryConfigError(f"--kubeconfig {settings.kubeconfig}: no such file")
    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    kubeconfig = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if not (settings.kubeconfig or in_pod or os.path.exists(kubeconfig.split(os.pathsep)[0])):
        raise DiscoveryConfigError(
            "--discovery kubernetes outside a pod needs --kubeconfig (or $KUBECONFIG)"
        )


def build_discovery(settings, redis) -> Discovery:
    """The discovery `settings.discovery` names; Kubernetes' client loads only for it."""
    check_discovery(settings)
    if settings.discovery == "static":
        return StaticDiscovery()
    if settings.discovery == "redis":
        return RedisDiscovery(redis)
    from coordinator.endpointslices import KubernetesDiscovery  # a second of imports

    return KubernetesDiscovery(
        selectors={"draft": settings.k8s_draft_selector, "target": settings.k8s_target_selector},
        namespace=settings.k8s_namespace or pod_namespace(),
        port_name=settings.k8s_port_name,
        kubeconfig=settings.kubeconfig,
    )
