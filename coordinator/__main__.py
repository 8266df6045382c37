"""`specdec coordinator`: the public API. Holds no model; sessions live in Redis."""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

from specdec.grpc_util import Server, install_signal_handlers
from specdec.redis_embedded import EmbeddedRedis
from specdec.runtime import load_tokenizer
from specdec.serve import setup_logging
from specdec.settings import add_flags, from_args, opt
from specdec.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorSettings:
    tokenizer: str = opt("models/target", "directory of the target model's tokenizer")
    host: str = opt("127.0.0.1", "address to bind (0.0.0.0 in a container)")
    port: int = opt(50051, "gRPC port of the public API (0 = pick a free one)")
    redis_url: str = opt(
        "", "Redis for sessions and the worker registry (empty = embedded redis-server)"
    )
    draft_addr: str = opt(
        "", "comma-separated static draft worker addresses (besides the registry)"
    )
    target_addr: str = opt(
        "", "comma-separated static target worker addresses (besides the registry)"
    )
    max_sessions: int = opt(
        256, "concurrent sessions this coordinator runs (RESOURCE_EXHAUSTED beyond)"
    )
    max_prompt_tokens: int = opt(4096, "longest prompt accepted (INVALID_ARGUMENT beyond)")
    max_new_tokens: int = opt(4096, "largest sampling.max_new_tokens accepted")
    default_max_new_tokens: int = opt(256, "max_new_tokens when a request leaves it 0")
    max_speculative_tokens: int = opt(
        8, "largest γ: the adaptive policy's bound and the request limit"
    )
    lease_s: float = opt(
        3.0, "session lease TTL; another coordinator may take over after it expires"
    )
    session_ttl_s: int = opt(3600, "how long a finished session stays readable in Redis")
    worker_timeout_s: float = opt(
        30.0, "deadline of a Verify call and of finding another target worker"
    )
    draft_timeout_s: float = opt(5.0, "deadline of a Propose call; past it the session fails over")
    prefill_threshold: int = opt(
        256, "a target that lacks more committed tokens than this gets a chunked Prefill first"
    )
    coordinator_id: str = opt("", "owner id in session leases (default: random)")
    grace_s: float = opt(10.0, "on SIGTERM, how long in-flight streams may finish")
    metrics_port: int = opt(0, "Prometheus metrics port (0 = off)")
    log_level: str = opt("info", "debug | info | warning | error")


async def main_async(settings: CoordinatorSettings) -> None:
    from coordinator.service import CoordinatorService

    embedded = None
    redis_url = settings.redis_url
    if not redis_url:
        embedded = EmbeddedRedis().start()
        redis_url = embedded.url
        log.info("embedded redis-server on %s", redis_url)
    redis = aioredis.from_url(redis_url)
    from specdec import telemetry

    telemetry.setup("specdec-coordinator", settings.metrics_port, settings.host)
    service = CoordinatorService(settings, load_tokenizer(settings.tokenizer), redis)
    if settings.metrics_port > 0:
        service.metrics = telemetry.CoordinatorMetrics(lambda: len(service.runs))
    server = Server(["specdec.v1.Coordinator"])
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server.server)
    port = server.bind(settings.host, settings.port)
    await server.start()
    await service.start()
    stop = asyncio.Event()
    install_signal_handlers(stop)
    announced = False
    try:
        while not stop.is_set():
            ready = service.ready()
            await server.set_serving(ready)
            if ready and not announced:
                announced = True
                print(f"READY coordinator {settings.host}:{port} redis={redis_url}", flush=True)
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                if not ready:
                    await service.refresh_workers()
    finally:
        await server.drain_and_stop(settings.grace_s)
        await service.stop()
        await redis.aclose()
        if embedded:
            embedded.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec coordinator", description=__doc__)
    add_flags(parser, CoordinatorSettings)
    settings = from_args(CoordinatorSettings, parser.parse_args(argv))
    setup_logging(settings.log_level)
    asyncio.run(main_async(settings))


if __name__ == "__main__":
    main()
