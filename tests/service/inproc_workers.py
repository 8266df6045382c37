"""In-process gRPC workers on 127.0.0.1:0 for the service tests (imported by conftest.py and by
tests that start workers with their own settings: a module of its own, since `conftest` names
two modules in a run of tests/service and tests/e2e together)."""

from __future__ import annotations

from dataclasses import replace

import grpc
from loop_thread import LoopThread

from draft_worker.__main__ import DraftSettings
from draft_worker.__main__ import build as build_draft
from specdec.serving.server import Server
from specdec.v1 import draft_pb2_grpc, target_pb2_grpc
from target_worker.__main__ import TargetSettings
from target_worker.__main__ import build as build_target


class Worker:
    """A started worker: its service object, address and a sync channel."""

    def __init__(self, loop: LoopThread, service, name: str):
        self.loop, self.service = loop, service

        async def start():  # the aio server must be created on the loop that serves it
            self.server = Server([name], service.settings.max_message_mb)
            self.server.add(service, name)
            self.address = f"127.0.0.1:{self.server.bind('127.0.0.1', 0)}"
            service.address = self.address
            await self.server.start()
            service.batcher.start()
            await self.server.set_serving(True)

        loop.run(start())
        self.channel = grpc.insecure_channel(self.address)

    def stop(self):
        self.channel.close()

        async def stop():
            await self.server.server.stop(0)
            await self.service.batcher.stop()

        self.loop.run(stop())


TIERS = {  # role: (settings, build, gRPC service, stub)
    "target": (
        TargetSettings,
        build_target,
        "specdec.v1.TargetWorker",
        target_pb2_grpc.TargetWorkerStub,
    ),
    "draft": (DraftSettings, build_draft, "specdec.v1.DraftWorker", draft_pb2_grpc.DraftWorkerStub),
}


def start_tier(role: str, loop_thread, model_dir: str, **overrides) -> Worker:
    """A worker of `role` on 127.0.0.1:0, CPU, 1 thread, with its settings overridden."""
    settings_cls, build, service_name, stub = TIERS[role]
    settings = settings_cls(model=model_dir, device="cpu", threads=1, port=0)
    worker = Worker(loop_thread, build(replace(settings, **overrides)), service_name)
    worker.stub = stub(worker.channel)
    return worker


def start_target(loop_thread, model_dir: str, **overrides) -> Worker:
    return start_tier("target", loop_thread, model_dir, **overrides)


def start_draft(loop_thread, model_dir: str, **overrides) -> Worker:
    return start_tier("draft", loop_thread, model_dir, **overrides)
