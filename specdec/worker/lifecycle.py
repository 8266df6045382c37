"""Process lifecycle shared by the workers: load, warm up, serve, register, drain on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from google.protobuf.json_format import MessageToDict

from specdec.engine.kv import KVSession
from specdec.serving import telemetry
from specdec.serving.metrics import WorkerMetrics
from specdec.serving.registry import RedisConfigError, Registration, check_redis_url
from specdec.serving.security import SecurityConfigError
from specdec.serving.server import Server, install_signal_handlers, setup_logging
from specdec.serving.settings import add_flags, from_args
from specdec.serving.trace_export import TracingConfigError, trace_exporters
from specdec.worker.threads import (
    allowed_cpus,
    bind_plan,
    format_cpus,
    on_a_passing_thread,
    pin_pool,
)

log = logging.getLogger(__name__)


def sampling_graphs_of(service):
    """The worker's `specdec.core.graphs.SamplingGraphs` (its engine's or proposer's), or None."""
    owner = getattr(service, "engine", None) or getattr(service, "proposer", None)
    return getattr(owner, "graphs", None)


async def serve_worker(settings, role: str, service, service_name: str, warmup) -> None:
    """Serve one worker until SIGTERM/SIGINT, then drain within settings.grace_s.

    Health is NOT_SERVING until `warmup()` has run a real forward pass.
    """
    telemetry.setup(f"specdec-{role}-worker", settings.metrics_port, settings.host)
    if settings.metrics_port > 0:
        service.metrics = WorkerMetrics(
            role,
            lambda: len(service.table),
            lambda: service.table.kv_bytes,
            lambda: service.batcher.in_flight,
            lambda: service.table.evictions,
            settings.max_kv_mb * 2**20,
            sampling_graphs_of(service),
        )
    server = Server([service_name], settings.max_message_mb, reflection=settings.reflection)
    server.add(service, service_name)
    port = server.bind(settings.host, settings.port, settings.server_tls())
    address = settings.advertise_addr or f"{settings.host}:{port}"
    service.address = address
    stop = asyncio.Event()
    install_signal_handlers(stop)  # before READY: a SIGTERM from then on always drains
    await server.start()
    service.batcher.start()
    started = time.perf_counter()
    await warmup()
    await bind_model_threads(settings, service)
    log.info("%s worker warm in %.2fs, serving on %s", role, time.perf_counter() - started, address)
    await server.set_serving(True)
    registration = None
    if settings.redis_url:
        registration = Registration(
            settings.redis_url,
            role,
            address,
            lambda: {**_info_dict(service.info()), "load": service.load()},
            settings.heartbeat_s,
            settings.redis_ca,
        )
        await registration.start()
    print(f"READY {role} {address}", flush=True)  # serving, and registered when asked to
    await stop.wait()
    log.info("%s worker draining (grace %.1fs)", role, settings.grace_s)
    service.closing.set()  # call streams answer what they took, then end
    if registration:
        await registration.stop()
    await server.drain_and_stop(settings.grace_s)
    await service.batcher.stop()


async def bind_model_threads(settings, service) -> None:
    """`--cpu-bind`: the model thread and its OpenMP pool, one CPU each (where it applies)."""
    cpus = bind_plan(settings.cpu_bind, settings.threads, str(service.model.device), allowed_cpus())
    if not cpus:
        return
    pinned = await asyncio.wrap_future(service.batcher.occupy(pin_pool, cpus))
    log.info(
        "model threads pinned (--cpu-bind %s): %d threads on CPUs %s",
        settings.cpu_bind,
        len(pinned),
        format_cpus(sorted(set(pinned.values()))),
    )
    if len(pinned) != settings.threads:
        log.warning(
            "--cpu-bind: the model thread has %d pool threads for --threads %d",
            len(pinned) - 1,
            settings.threads,
        )


def _info_dict(info) -> dict:
    return MessageToDict(info, preserving_proto_field_name=True)


async def warm_up(service) -> None:
    """One real forward pass of the worker's model (none for a model-free proposer)."""
    runtime = getattr(service.model, "runtime", service.model)
    if not hasattr(runtime, "forward"):
        return
    session = KVSession("__warmup__")
    session.sync([0, 0, 0, 0])
    await asyncio.wrap_future(
        service.batcher.occupy(runtime.forward, [session], [session.pending()])
    )


def worker_main(
    argv, prog: str, doc: str, settings_cls, build, role: str, service_name: str
) -> None:
    """Entry point of a worker process: flags (and SPECDEC_* env), logging, serve until SIGTERM."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    add_flags(parser, settings_cls)
    settings = from_args(settings_cls, parser.parse_args(argv))
    try:
        settings.validate_tls()
        trace_exporters()
        check_redis_url(settings.redis_url)
    except (SecurityConfigError, TracingConfigError, RedisConfigError) as exc:
        parser.error(str(exc))
    if settings.tls_ca and not settings.tls_cert:
        parser.error("--tls-ca (mTLS) needs the worker's own --tls-cert and --tls-key")
    try:  # a CPU list is checked before the model loads (auto waits for the model's device)
        bind_plan(settings.cpu_bind, settings.threads, "cpu", allowed_cpus())
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    if settings.tls_cert and not settings.tls_ca:
        log.warning("TLS without --tls-ca: any caller that reaches this port may use the worker")

    async def run() -> None:
        try:
            # loaded on a thread that is gone before serving: every pass then runs on the
            # model thread, the one OpenMP pool of the process (specdec.worker.threads)
            service = on_a_passing_thread(build, settings)
        except ValueError as exc:  # a setting the model cannot take: say which, exit 1
            raise SystemExit(f"{prog}: {exc}") from None
        await serve_worker(settings, role, service, service_name, lambda: warm_up(service))

    asyncio.run(run())
