"""In-process gRPC workers on 127.0.0.1:0, served from an event loop in a background thread;
a real Redis for the session store's tests (test_store*.py; test_redis_topologies.py brings
its own)."""

from __future__ import annotations

import uuid

import pytest
import redis
from inproc_workers import Worker, start_draft, start_target
from loop_thread import LoopThread

from specdec.serving.redis_embedded import EmbeddedRedis


@pytest.fixture(scope="module")
def loop_thread():
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def target(loop_thread, model_dirs):
    worker = start_target(loop_thread, model_dirs["target"], max_wait_ms=20.0)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def draft(loop_thread, model_dirs):
    worker = start_draft(loop_thread, model_dirs["draft"], max_wait_ms=20.0)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def start_worker(loop_thread):
    """Start workers with their own settings, stopped at the end of the module:
    start_worker("target" | "draft", model_dir, **setting_overrides)."""
    started = []

    def start(role: str, model_dir: str, **overrides) -> Worker:
        worker = (start_target if role == "target" else start_draft)(
            loop_thread, model_dir, **overrides
        )
        started.append(worker)
        return worker

    yield start
    for worker in reversed(started):
        worker.stop()


@pytest.fixture(scope="module")
def url():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def db(url):
    client = redis.Redis.from_url(url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def sid() -> str:
    return f"test-{uuid.uuid4().hex}"
