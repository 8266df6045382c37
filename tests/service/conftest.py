"""In-process gRPC workers on 127.0.0.1:0, served from an event loop in a background thread."""

from __future__ import annotations

import pytest
from inproc_workers import Worker, start_draft, start_target
from loop_thread import LoopThread


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
