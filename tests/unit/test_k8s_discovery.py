"""--discovery kubernetes against a protocol-level stand-in of the API server
(tests/k8s_apiserver.py): list-then-watch, resume, bookmarks, 410 Gone, outages, and a real
WorkerPool joining a real gRPC worker published through an EndpointSlice."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
import pytest
from k8s_apiserver import FakeAPIServer, endpoint_slice
from kubernetes import client

from coordinator.discovery import build_discovery
from coordinator.endpointslices import KubernetesDiscovery, SliceWatch, api_client, ready_addresses
from coordinator.pool import WorkerPool
from coordinator.service import CoordinatorService
from coordinator.settings import CoordinatorSettings
from specdec.serving.registry import redis_client
from specdec.text.tokenizer import load_tokenizer, vocab_fingerprint
from specdec.v1 import common_pb2, target_pb2_grpc

NS = "specdec"
TOKEN = "stand-in-token"
DRAFT = {"kubernetes.io/service-name": "specdec-draft-worker"}
TARGET = {"kubernetes.io/service-name": "specdec-target-worker"}
DRAFT_SELECTOR = "kubernetes.io/service-name=specdec-draft-worker"
TARGET_SELECTOR = "kubernetes.io/service-name=specdec-target-worker"


def draft_slice(name: str, *endpoints, ports=None, labels=DRAFT) -> dict:
    """A draft-tier slice; endpoints are addresses (ready) or (address, ready, terminating)."""
    rows = [(e, None, None) if isinstance(e, str) else e for e in endpoints]
    return endpoint_slice(name, labels, rows, ports or {"grpc": 50061})


def eventually(read, expected, timeout_s: float = 10.0):
    """Poll read() until it equals expected; the last value is asserted (a readable failure)."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while value != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        value = read()
    assert value == expected
    return value


@pytest.fixture
def api():
    server = FakeAPIServer(token=TOKEN)
    yield server
    server.stop()


@pytest.fixture
def kubeconfig(api, tmp_path) -> str:
    """A kubeconfig of the stand-in, with a bearer token (JSON is YAML)."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "stand-in", "cluster": {"server": api.url}}],
                "users": [{"name": "coordinator", "user": {"token": TOKEN}}],
                "contexts": [
                    {"name": "test", "context": {"cluster": "stand-in", "user": "coordinator"}}
                ],
                "current-context": "test",
            }
        )
    )
    return str(path)


@pytest.fixture
def watch_of(kubeconfig):
    """Start a SliceWatch of a selector in NS (fast backoff); stopped and joined after."""
    started: list[tuple[SliceWatch, client.ApiClient]] = []

    def start(selector: str = DRAFT_SELECTOR, **options) -> SliceWatch:
        http = api_client(kubeconfig)
        options.setdefault("backoff_s", (0.05, 0.2))
        slices = SliceWatch(client.DiscoveryV1Api(http), NS, selector, "grpc", **options)
        slices.start()
        started.append((slices, http))
        assert slices.listed.wait(5), "no first list"
        return slices

    yield start
    for slices, http in started:
        slices.stop()
        http.close()
        assert not slices.running, "the watch thread outlived stop()"


def test_ready_addresses_follow_the_kubernetes_conventions():
    obj = draft_slice(
        "s",
        "10.0.0.1",  # conditions unset: ready, not terminating
        ("10.0.0.2", True, False),
        ("10.0.0.3", False, None),  # not ready
        ("10.0.0.4", True, True),  # ready but terminating
        ("10.0.0.5", None, False),
        ports={"metrics": 9100, "grpc": 50061},
    )
    obj["endpoints"][0]["addresses"].append("10.9.9.9")  # only the first address counts
    ready = ("10.0.0.1", "10.0.0.2", "10.0.0.5")
    assert ready_addresses(obj, "grpc") == {f"{a}:50061" for a in ready}
    assert ready_addresses(obj, "metrics") == {f"{a}:9100" for a in ready}
    assert ready_addresses(obj, "http") == frozenset()
    six = endpoint_slice("v6", DRAFT, [("fd00::7", True, None)], {"grpc": 50061}, "IPv6")
    assert ready_addresses(six, "grpc") == {"[fd00::7]:50061"}
    assert ready_addresses({**obj, "endpoints": None}, "grpc") == frozenset()


def test_events_add_change_and_remove_endpoints_of_the_selected_slices(api, watch_of):
    api.apply(NS, draft_slice("other-tier", "10.1.0.1", labels=TARGET))
    api.apply("elsewhere", draft_slice("draft-x", "10.2.0.1"))
    slices = watch_of()
    assert slices.endpoints() == frozenset()
    first_list, first_watch = api.requests[0], api.wait_for(lambda s: s.watches())[0]
    assert first_list.query == {"labelSelector": DRAFT_SELECTOR} and first_list.authorized
    assert first_watch.resource_version == "1002" and first_watch.authorized
    assert first_watch.query["allowWatchBookmarks"] == "true"

    api.apply(NS, draft_slice("draft-a", "10.0.0.1", ("10.0.0.2", False, None), "10.0.0.3"))
    eventually(slices.endpoints, {"10.0.0.1:50061", "10.0.0.3:50061"})
    api.apply(NS, draft_slice("draft-a", ("10.0.0.1", False, None), ("10.0.0.3", True, True)))
    eventually(slices.endpoints, frozenset())
    api.apply(NS, draft_slice("draft-a", "10.0.0.1"))
    api.apply(NS, draft_slice("draft-b", "10.0.0.7", ports={"grpc": 50071}))
    api.apply(NS, draft_slice("other-tier", "10.1.0.2", labels=TARGET))
    eventually(slices.endpoints, {"10.0.0.1:50061", "10.0.0.7:50071"})
    api.delete(NS, "draft-a")
    eventually(slices.endpoints, {"10.0.0.7:50071"})
    eventually(lambda: slices.resource_version, str(api.resource_version))  # the DELETED's
    assert len(api.lists()) == 1 and len(api.watches()) == 1  # one list, one unbroken watch


def test_a_cut_watch_resumes_from_the_last_resource_version(api, watch_of):
    slices = watch_of()
    api.apply(NS, draft_slice("draft-a", "10.0.0.1"))
    eventually(slices.endpoints, {"10.0.0.1:50061"})
    last = api.resource_version
    api.drop_watches()
    resumed = api.wait_for(lambda s: s.watches()[1:])[0]
    assert resumed.resource_version == str(last)
    api.apply(NS, draft_slice("draft-b", "10.0.0.2"))
    eventually(slices.endpoints, {"10.0.0.1:50061", "10.0.0.2:50061"})
    assert len(api.lists()) == 1  # resumed, never listed again


def test_a_bookmark_moves_the_resource_version_the_next_watch_starts_from(api, watch_of):
    slices = watch_of()
    api.wait_for(lambda s: s.watches())
    for i in range(3):  # changes the selector hides: the watcher sees no event for them
        api.apply(NS, draft_slice(f"t{i}", "10.1.0.1", labels=TARGET))
    assert slices.resource_version == "1000"
    marked = api.bookmark()
    assert marked == 1003
    eventually(lambda: slices.resource_version, "1003")
    api.drop_watches()
    assert api.wait_for(lambda s: s.watches()[1:])[0].resource_version == "1003"


@pytest.mark.slow
def test_a_watch_the_server_ends_on_time_is_resumed_from_the_last_version(api, watch_of):
    slices = watch_of(watch_timeout_s=1)
    api.apply(NS, draft_slice("draft-a", "10.0.0.1"))
    eventually(slices.endpoints, {"10.0.0.1:50061"})
    watches = api.wait_for(lambda s: s.watches()[1:] and s.watches(), timeout_s=5)
    assert [w.query["timeoutSeconds"] for w in watches[:2]] == ["1", "1"]
    assert [w.resource_version for w in watches[:2]] == ["1000", "1001"]
    assert len(api.lists()) == 1


@pytest.mark.parametrize("expired_as", ["event", "http"])
def test_410_gone_lists_again_and_replaces_the_state(api, watch_of, expired_as):
    api.expired_as = expired_as
    api.apply(NS, draft_slice("draft-a", "10.0.0.1"))
    api.apply(NS, draft_slice("draft-b", "10.0.0.2"))
    slices = watch_of()
    assert slices.endpoints() == {"10.0.0.1:50061", "10.0.0.2:50061"}
    seen = slices.resource_version
    assert seen == "1002"
    api.stop()  # the watcher misses what follows; then its version is compacted away
    api.delete(NS, "draft-a")
    api.apply(NS, draft_slice("draft-c", "10.0.0.3"))
    api.expire(below=api.resource_version)
    api.start()
    eventually(slices.endpoints, {"10.0.0.2:50061", "10.0.0.3:50061"})  # draft-a is gone
    api.wait_for(lambda s: s.watches()[-1].resource_version == "1004")
    assert [(r.watch, r.resource_version) for r in api.requests] == [
        (False, None),  # the first list
        (True, "1002"),  # its watch, cut by the outage
        (True, "1002"),  # refused: 410 Gone
        (False, None),  # listed again
        (True, "1004"),  # watching from the new list's version
    ]


@pytest.mark.slow
def test_a_version_gone_again_right_after_a_list_backs_off(api, watch_of):
    slices = watch_of()
    api.wait_for(lambda s: s.watches())
    api.expire(below=10**9)  # every version is gone at once: a broken server
    api.drop_watches()
    time.sleep(1.0)
    refused = len(api.watches()) - 1
    assert 2 <= refused <= 8, f"{refused} watches in a second: no backoff"
    assert slices.endpoints() == frozenset() and slices.running


@pytest.mark.slow
def test_an_unreachable_api_server_keeps_the_last_endpoints_until_it_returns(api, watch_of, caplog):
    slices = watch_of()
    api.apply(NS, draft_slice("draft-a", "10.0.0.1"))
    eventually(slices.endpoints, {"10.0.0.1:50061"})
    with caplog.at_level(logging.WARNING, logger="coordinator.endpointslices"):
        api.stop()
        api.apply(NS, draft_slice("draft-b", "10.0.0.2"))
        time.sleep(1.0)  # several failed reconnects
        assert slices.endpoints() == {"10.0.0.1:50061"}
        assert any("keeping 1 known endpoint" in r.getMessage() for r in caplog.records)
        api.start()
        eventually(slices.endpoints, {"10.0.0.1:50061", "10.0.0.2:50061"})
    assert len(api.lists()) == 1  # resumed from the version it had, no list needed
    assert api.watches()[-1].resource_version == "1001"


class TargetInfo(target_pb2_grpc.TargetWorkerServicer):
    """A target worker that answers Info only: all a pool needs to admit it."""

    async def Info(self, request, context):
        return common_pb2.WorkerInfo(role="target", model_name="stand-in", vocab_fingerprint="fp")


def test_a_worker_pool_joins_and_drops_a_real_worker_published_in_a_slice(api, kubeconfig):
    settings = CoordinatorSettings(
        discovery="kubernetes",
        kubeconfig=kubeconfig,
        k8s_namespace=NS,
        k8s_draft_selector=DRAFT_SELECTOR,
        k8s_target_selector=TARGET_SELECTOR,
    )

    async def until(read, expected):
        for _ in range(500):
            if await read() == expected:
                return
            await asyncio.sleep(0.02)
        assert await read() == expected

    async def scenario():
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetWorkerServicer_to_server(TargetInfo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        found = build_discovery(settings, redis=None)
        assert isinstance(found, KubernetesDiscovery)
        pool = WorkerPool("target", [], "fp", discovery=found)
        address = f"127.0.0.1:{port}"
        try:
            await found.start()
            await pool.refresh()
            assert pool.workers == {}
            api.apply(NS, endpoint_slice("t", TARGET, [("127.0.0.1", True, None)], {"grpc": port}))
            await until(lambda: found.addresses("target"), {address: 0.0})
            assert await found.addresses("draft") == {}
            await pool.refresh()
            assert [w.address for w in pool.alive()] == [address]
            assert pool.workers[address].info.model_name == "stand-in"
            api.delete(NS, "t")
            await until(lambda: found.addresses("target"), {})
            await pool.refresh()
            assert pool.workers == {}
        finally:
            await pool.close()
            await found.close()
            await server.stop(0)
        return found

    found = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert not any(w.running for w in found.watches.values())
    assert {w.query["labelSelector"] for w in api.lists()} == {DRAFT_SELECTOR, TARGET_SELECTOR}


def test_the_coordinator_service_is_ready_once_a_target_slice_appears(api, kubeconfig, model_dirs):
    tokenizer = load_tokenizer(model_dirs["target"])
    settings = CoordinatorSettings(
        discovery="kubernetes",
        kubeconfig=kubeconfig,
        k8s_namespace=NS,
        k8s_draft_selector=DRAFT_SELECTOR,
        k8s_target_selector=TARGET_SELECTOR,
    )

    class Target(TargetInfo):
        async def Info(self, request, context):
            return common_pb2.WorkerInfo(
                role="target", vocab_fingerprint=vocab_fingerprint(tokenizer)
            )

    async def scenario():
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetWorkerServicer_to_server(Target(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        redis = redis_client("redis://127.0.0.1:1")  # never reached: no session is created
        service = CoordinatorService(settings, tokenizer, redis)
        try:
            await service.start()
            assert not service.ready()
            api.apply(NS, endpoint_slice("t", TARGET, [("127.0.0.1", True, None)], {"grpc": port}))
            for _ in range(500):
                await service.refresh_workers()
                if service.ready():
                    break
                await asyncio.sleep(0.02)
            assert [w.address for w in service.ctx.targets.alive()] == [f"127.0.0.1:{port}"]
        finally:
            await service.stop()
            await redis.aclose()
            await server.stop(0)
        return service.discovery

    found = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert isinstance(found, KubernetesDiscovery)
    assert not any(w.running for w in found.watches.values())
