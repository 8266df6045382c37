"""--discovery redis (the workers' registry, kept across a failed read) and static, and the
discovery flags that cannot work failing the coordinator's start with the flag named
(--discovery kubernetes itself: tests/unit/test_k8s_discovery.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from coordinator import discovery as discovery_module
from coordinator.__main__ import main as coordinator_main
from coordinator.discovery import (
    DiscoveryConfigError,
    RedisDiscovery,
    StaticDiscovery,
    build_discovery,
    check_discovery,
    pod_namespace,
)
from coordinator.settings import CoordinatorSettings

DRAFT_SELECTOR = "kubernetes.io/service-name=specdec-draft-worker"
TARGET_SELECTOR = "kubernetes.io/service-name=specdec-target-worker"


class Registry:
    """Just enough of redis.asyncio for `list_workers`: entries by key, and each role's set
    of addresses derived from them."""

    def __init__(self, entries: dict[str, dict] | None):
        self.entries = entries

    async def smembers(self, index: str):
        if self.entries is None:
            raise ConnectionError("redis is down")
        role = index.removeprefix("specdec:workers:")
        return {key.split(":", 3)[3].encode() for key in self.entries if f":{role}:" in key}

    async def mget(self, keys: list[str]):
        return [json.dumps(self.entries[k]) if k in self.entries else None for k in keys]

    async def srem(self, index: str, *members):
        pass


def test_redis_and_static_discovery():
    entries = {
        "specdec:worker:{draft}:d1:1": {"address": "d1:1", "load": 2.5},
        "specdec:worker:{target}:t1:1": {"address": "t1:1"},
    }
    found = RedisDiscovery(Registry(entries))
    assert asyncio.run(found.addresses("draft")) == {"d1:1": 2.5}
    assert asyncio.run(found.addresses("target")) == {"t1:1": 0.0}
    assert asyncio.run(RedisDiscovery(Registry(None)).addresses("draft")) == {}
    # a registry that cannot be read keeps the workers of the last good read
    registry = Registry(entries)
    kept = RedisDiscovery(registry)
    assert asyncio.run(kept.addresses("draft")) == {"d1:1": 2.5}
    registry.entries = None
    assert asyncio.run(kept.addresses("draft")) == {"d1:1": 2.5}
    registry.entries = {}
    assert asyncio.run(kept.addresses("draft")) == {}  # a good read that finds none drops it
    assert asyncio.run(StaticDiscovery().addresses("draft")) == {}
    assert isinstance(build_discovery(CoordinatorSettings(), redis=object()), RedisDiscovery)
    static = CoordinatorSettings(discovery="static")
    assert isinstance(build_discovery(static, redis=object()), StaticDiscovery)


def test_discovery_flags_that_cannot_work_fail_the_start(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit):
        coordinator_main(["--discovery", "consul"])
    assert "--discovery" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_DISCOVERY", "consul")  # the environment skips argparse
    with pytest.raises(SystemExit):
        coordinator_main([])
    expected = "argument --discovery: expected one of redis | kubernetes | static, got 'consul'"
    assert f"{expected} (from SPECDEC_DISCOVERY)" in capsys.readouterr().err
    monkeypatch.delenv("SPECDEC_DISCOVERY")

    def refused(**values) -> str:
        with pytest.raises(DiscoveryConfigError) as exc:
            check_discovery(CoordinatorSettings(discovery="kubernetes", **values))
        return str(exc.value)

    assert "--k8s-draft-selector" in refused(k8s_target_selector=TARGET_SELECTOR)
    assert "--k8s-target-selector" in refused(k8s_draft_selector=DRAFT_SELECTOR)
    both = {"k8s_draft_selector": DRAFT_SELECTOR, "k8s_target_selector": TARGET_SELECTOR}
    assert refused(kubeconfig=str(tmp_path / "nope"), **both).startswith("--kubeconfig")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    assert "needs --kubeconfig" in refused(**both)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    check_discovery(CoordinatorSettings(discovery="kubernetes", **both))  # in a pod: fine


def test_the_namespace_defaults_to_the_pods_own(monkeypatch, tmp_path):
    monkeypatch.setattr(discovery_module, "NAMESPACE_FILE", str(tmp_path / "absent"))
    assert pod_namespace() == "default"
    (tmp_path / "namespace").write_text("serving\n")
    monkeypatch.setattr(discovery_module, "NAMESPACE_FILE", str(tmp_path / "namespace"))
    assert pod_namespace() == "serving"
