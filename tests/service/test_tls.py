"""TLS, mTLS, rotation, reflection and API keys on real gRPC servers; the embedded Redis's
password; a least-privilege Redis ACL user; rediss:// through a TLS terminator."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import threading
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from loop_thread import LoopThread

from specdec.launcher.certs import CertificateAuthority
from specdec.serving.redis_embedded import EmbeddedRedis
from specdec.serving.registry import REDIS_ACL, redis_client
from specdec.serving.security import APIKeys, ClientTLS, ServerTLS
from specdec.serving.server import Server
from specdec.v1 import common_pb2, target_pb2_grpc


@pytest.fixture(scope="module")
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def cas(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    return {name: CertificateAuthority.create(root / name, name) for name in ("a", "b")}


class Serving:
    """A real aio server (health only, or with a service) on 127.0.0.1, in the loop thread."""

    def __init__(self, loop, tls=None, reflection=False, service=None, api_keys=None):
        self.loop = loop

        async def start():
            names = [service[1]] if service else []
            self.server = Server(names, reflection=reflection)
            if service:
                self.server.add(service[0], service[1], api_keys)
            self.port = self.server.bind("127.0.0.1", 0, tls)
            await self.server.start()
            await self.server.set_serving(True)

        loop.run(start())
        self.address = f"127.0.0.1:{self.port}"

    def stop(self):
        self.loop.run(self.server.server.stop(0))


def health(address, tls: ClientTLS | None = None, timeout=5.0):
    """SERVING, or the status code of the failed call."""
    if tls is None:
        ch = grpc.insecure_channel(address)
    else:
        ch = grpc.secure_channel(address, tls.credentials(), tls.options())
    with ch:
        try:
            stub = health_pb2_grpc.HealthStub(ch)
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError as exc:
            return exc.code()


SERVING = health_pb2.HealthCheckResponse.SERVING


def test_tls_server_refuses_plaintext_and_other_cas(loop, cas):
    cert, key = cas["a"].issue("server")
    server = Serving(loop, ServerTLS(cert, key))
    try:
        assert health(server.address, ClientTLS(ca=cas["a"].cert_path)) == SERVING
        assert health(server.address) == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert health(server.address, ClientTLS(ca=cas["b"].cert_path)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        # the certificate names 127.0.0.1 and localhost; another name is refused
        wrong_name = ClientTLS(ca=cas["a"].cert_path, server_name="specdec-worker")
        assert health(server.address, wrong_name) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_mtls_server_needs_a_client_certificate_from_its_ca(loop, cas):
    cert, key = cas["a"].issue("worker")
    server = Serving(loop, ServerTLS(cert, key, client_ca=cas["a"].cert_path))
    ca = cas["a"].cert_path
    try:
        good_cert, good_key = cas["a"].issue("coordinator")
        assert health(server.address, ClientTLS(ca, good_cert, good_key)) == SERVING
        assert health(server.address, ClientTLS(ca)) == grpc.StatusCode.UNAVAILABLE
        other_cert, other_key = cas["b"].issue("intruder")
        assert health(server.address, ClientTLS(ca, other_cert, other_key)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        assert health(server.address) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_rotated_certificate_files_are_used_without_a_restart(loop, cas, tmp_path):
    """The files are replaced by a certificate of a new CA: new handshakes present it."""
    cert, key = cas["a"].issue("rotating")
    live_cert, live_key = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")
    os.link(cert, live_cert)
    os.link(key, live_key)
    server = Serving(loop, ServerTLS(live_cert, live_key))
    try:
        assert health(server.address, ClientTLS(ca=cas["a"].cert_path)) == SERVING
        new_cert, new_key = cas["b"].issue("rotated")
        for src, dst in ((new_key, live_key), (new_cert, live_cert)):  # atomic, as kubelet
            tmp = dst + ".tmp"
            with open(src, "rb") as f, open(tmp, "wb") as g:
                g.write(f.read())
            os.replace(tmp, dst)
        assert health(server.address, ClientTLS(ca=cas["b"].cert_path)) == SERVING
        assert health(server.address, ClientTLS(ca=cas["a"].cert_path)) == (
            grpc.StatusCode.UNAVAILABLE
        ), "the old certificate is still served"
    finally:
        server.stop()


def list_services(address) -> list[str] | grpc.StatusCode:
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        try:
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            return [s.name for r in replies for s in r.list_services_response.service]
        except grpc.RpcError as exc:
            return exc.code()


def test_reflection_only_when_asked(loop):
    off, on = Serving(loop), Serving(loop, reflection=True)
    try:
        assert list_services(off.address) == grpc.StatusCode.UNIMPLEMENTED
        assert "grpc.health.v1.Health" in list_services(on.address)
    finally:
        off.stop()
        on.stop()


class Echo(target_pb2_grpc.TargetWorkerServicer):
    """A service of the project's API (TargetWorker.Info answers) for the API-key wrapper."""

    async def Info(self, request, context):
        return common_pb2.WorkerInfo(role="target")


def test_api_keys_guard_every_method_but_health(loop, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("right-key\n")
    server = Serving(loop, service=(Echo(), "specdec.v1.TargetWorker"), api_keys=APIKeys(str(keys)))
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = target_pb2_grpc.TargetWorkerStub(ch)

            def info(metadata):
                try:
                    return stub.Info(common_pb2.InfoRequest(), timeout=5, metadata=metadata).role
                except grpc.RpcError as exc:
                    return exc.code(), exc.details()

            assert info((("authorization", "Bearer right-key"),)) == "target"
            assert info(()) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "missing API key: send metadata 'authorization: Bearer <key>'",
            )
            assert info((("authorization", "Bearer wrong"),)) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "invalid API key",
            )
            assert health(server.address) == SERVING  # health stays open
    finally:
        server.stop()


# --- Redis ------------------------------------------------------------------------------


def raw(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(command)
        return sock.recv(256)


def test_embedded_redis_needs_its_password_and_binds_loopback():
    with EmbeddedRedis() as server:
        assert server.password and len(server.password) >= 24
        assert raw(server.port, b"SET specdec:x 1\r\n").startswith(b"-NOAUTH")
        assert raw(server.port, f"AUTH {server.password}\r\nPING\r\n".encode()).endswith(
            b"+PONG\r\n"
        )
        assert redis.from_url(server.url).ping()
        config = redis.from_url(server.url).config_get("bind")
        assert config["bind"] == "127.0.0.1"
        with open(f"/proc/{server.process.pid}/cmdline", "rb") as f:
            assert server.password.encode() not in f.read(), "password on the command line"


def test_the_documented_acl_is_enough_for_specdec_and_nothing_else():
    """A Redis user with exactly REDIS_ACL runs sessions and the registry; other keys and
    commands are refused (the negative control)."""
    from store_sessions import exercise_store  # every store and registry operation

    with EmbeddedRedis() as server:
        admin = redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "specdec", "on", ">acl-password", *REDIS_ACL)
        url = f"redis://specdec:acl-password@127.0.0.1:{server.port}/0"
        asyncio.run(exercise_store(url))
        limited = redis.from_url(url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            limited.set("other:key", "x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            limited.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            limited.config_get("*")


class TLSTerminator:
    """rediss:// in front of the real redis-server (which is built without TLS here): a TLS
    listener that forwards bytes to Redis's port, like stunnel or a cloud endpoint."""

    def __init__(self, cert: str, key: str, upstream_port: int):
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.upstream = upstream_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            conn.close()
            return
        up = socket.create_connection(("127.0.0.1", self.upstream))

        def pump(src, dst):
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.close()

        threading.Thread(target=pump, args=(up, tls), daemon=True).start()
        pump(tls, up)

    def close(self):
        self.sock.close()


def test_rediss_with_a_ca_and_the_password_from_the_environment(cas, monkeypatch):
    cert, key = cas["a"].issue("redis")
    with EmbeddedRedis() as server:
        proxy = TLSTerminator(cert, key, server.port)
        try:
            url = f"rediss://127.0.0.1:{proxy.port}/0"
            monkeypatch.setenv("SPECDEC_REDIS_PASSWORD", server.password)

            async def ping(ca: str):
                client = redis_client(url, timeout_s=2.0, ca=ca)
                try:
                    return await client.ping()
                finally:
                    await client.aclose()

            assert asyncio.run(ping(cas["a"].cert_path)) is True
            with pytest.raises(redis.exceptions.ConnectionError):
                asyncio.run(ping(cas["b"].cert_path))  # a server the CA did not sign
            monkeypatch.setenv("SPECDEC_REDIS_PASSWORD", "wrong")
            with pytest.raises(redis.exceptions.AuthenticationError):
                asyncio.run(ping(cas["a"].cert_path))
        finally:
            proxy.close()


def test_the_coordinator_rebuilds_worker_channels_when_its_certificate_rotates(loop, cas, tmp_path):
    """The worker moves to a new CA (server files and required client CA); once the
    coordinator's own files change too, its pool gives the worker a new channel whose
    handshake presents the new certificate — without a restart."""
    from coordinator.pool import WorkerPool

    def files(ca, name):
        cert, key = ca.issue(name)
        return cert, key, ca.cert_path

    def install(paths, live):
        for src, dst in zip(paths, live):
            tmp = dst + ".tmp"
            with open(src, "rb") as f, open(tmp, "wb") as g:
                g.write(f.read())
            os.replace(tmp, dst)
            os.utime(dst, ns=(time.time_ns() + 10**9,) * 2)

    async def role(stub) -> str:
        return (await stub.Info(common_pb2.InfoRequest(), timeout=5)).role

    worker_live = [str(tmp_path / n) for n in ("w.crt", "w.key", "w-ca.crt")]
    coord_live = [str(tmp_path / n) for n in ("c.crt", "c.key", "c-ca.crt")]
    install(files(cas["a"], "worker-1"), worker_live)
    install(files(cas["a"], "coordinator-1"), coord_live)
    server = Serving(
        loop,
        ServerTLS(worker_live[0], worker_live[1], client_ca=worker_live[2]),
        service=(Echo(), "specdec.v1.TargetWorker"),
    )
    tls = ClientTLS(ca=coord_live[2], cert=coord_live[0], key=coord_live[1])
    pool = WorkerPool("target", [server.address], "", tls=tls)
    try:
        loop.run(pool.refresh())
        first = pool.workers[server.address]
        old_channel = first.channel
        assert loop.run(role(first.stub)) == "target"
        install(files(cas["b"], "worker-2"), worker_live)  # the worker rotates to CA b
        install(files(cas["b"], "coordinator-2"), coord_live)  # and so does the coordinator
        loop.run(pool.refresh())
        worker = pool.workers[server.address]
        assert worker.channel is not old_channel, "no new channel after the rotation"
        assert loop.run(role(worker.stub)) == "target"
        old_cert, old_key = cas["a"].issue("coordinator-old")
        assert health(server.address, ClientTLS(cas["a"].cert_path, old_cert, old_key)) == (
            grpc.StatusCode.UNAVAILABLE
        ), "the worker still accepts the old CA"
    finally:
        loop.run(pool.close())
        server.stop()
