"""`specdec coordinator`: the public API. Holds no model; sessions live in Redis."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from coordinator.discovery import DiscoveryConfigError, check_discovery
from coordinator.gateway import Gateway
from coordinator.http_server import HTTPServer
from coordinator.service import CoordinatorService
from coordinator.settings import CoordinatorSettings
from specdec.catalog import resolve_dir
from specdec.serving import telemetry
from specdec.serving.redis_embedded import EmbeddedRedis
from specdec.serving.registry import RedisConfigError, check_redis_url, redact, redis_client
from specdec.serving.security import SecurityConfigError
from specdec.serving.server import Server, install_signal_handlers, setup_logging
from specdec.serving.settings import add_flags, from_args
from specdec.serving.trace_export import TracingConfigError, trace_exporters
from specdec.text.tokenizer import load_tokenizer

__all__ = ["CoordinatorSettings", "main", "main_async"]

log = logging.getLogger(__name__)


async def main_async(settings: CoordinatorSettings) -> None:
    embedded = None
    redis_url = settings.redis_url
    if not redis_url:
        embedded = EmbeddedRedis().start()
        redis_url = embedded.url
        log.info("embedded redis-server on %s", redact(redis_url))
    redis = redis_client(
        redis_url, min(settings.redis_timeout_s, settings.lease_s / 2), settings.redis_ca
    )
    telemetry.setup("specdec-coordinator", settings.metrics_port, settings.host)
    service = CoordinatorService(settings, load_tokenizer(resolve_dir(settings.tokenizer)), redis)
    server = Server(
        ["specdec.v1.Coordinator"], settings.max_message_mb, reflection=settings.reflection
    )
    server.add(service, "specdec.v1.Coordinator", settings.api_keys())
    port = server.bind(settings.host, settings.port, settings.public_tls())
    await server.start()
    await service.start()
    http, http_line = None, ""
    if settings.http_port >= 0:
        gateway = Gateway(service, served_model_name(settings), settings.api_keys())
        http = HTTPServer(gateway, settings.host, settings.http_port, settings.public_tls())
        http_line = f" http={settings.host}:{await http.start()}"
    stop = asyncio.Event()
    install_signal_handlers(stop)
    announced = False
    try:
        while not stop.is_set():
            ready = service.ready()
            await server.set_serving(ready)
            if ready and not announced:
                announced = True
                print(
                    f"READY coordinator {settings.host}:{port} redis={redact(redis_url)}"
                    + http_line,
                    flush=True,
                )
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                if not ready:
                    await service.refresh_workers()
    finally:
        service.draining = True  # streams cut by the grace period hand their sessions over
        if http is not None:
            await http.stop()
        await server.drain_and_stop(settings.grace_s)
        await service.stop()
        await redis.aclose()
        if embedded:
            embedded.stop()


def served_model_name(settings: CoordinatorSettings) -> str:
    """The HTTP API's model id: --served-model-name, else the tokenizer's name."""
    if settings.served_model_name:
        return settings.served_model_name
    return os.path.basename(os.path.normpath(settings.tokenizer))


def check_security(settings: CoordinatorSettings) -> None:
    """Refuse, naming the flag, security settings that cannot work (before any work)."""
    settings.validate_tls()
    if settings.tls_client_ca and not settings.tls_cert:
        raise SecurityConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    if bool(settings.worker_tls_cert) != bool(settings.worker_tls_key):
        raise SecurityConfigError("--worker-tls-cert/--worker-tls-key: give both")
    if settings.tls_ca and not (settings.worker_tls_cert or settings.tls_cert):
        raise SecurityConfigError(
            "--tls-ca (mTLS to the workers) needs a client certificate: --worker-tls-cert or "
            "--tls-cert"
        )
    if settings.api_keys_file:
        settings.api_keys()  # reads and parses it now: a bad file fails the start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="specdec coordinator", description=__doc__)
    add_flags(parser, CoordinatorSettings)
    settings = from_args(CoordinatorSettings, parser.parse_args(argv))
    if not settings.redis_timeout_s > 0:
        parser.error("--redis-timeout-s must be positive")
    if not 0.0 <= settings.draft_confidence < 1.0:
        parser.error("--draft-confidence must be in [0, 1)")
    if settings.max_starting < 1:
        parser.error("--max-starting must be at least 1")
    try:
        check_security(settings)
        check_discovery(settings)
        trace_exporters()
        check_redis_url(settings.redis_url)
    except (
        SecurityConfigError,
        DiscoveryConfigError,
        TracingConfigError,
        RedisConfigError,
    ) as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    asyncio.run(main_async(settings))


if __name__ == "__main__":
    main()
