"""TLS, mutual TLS and API keys of the three services.

Certificates and keys are PEM files, re-read when they change: a server checks their
modification times at every new TLS handshake (gRPC's dynamic server credentials), and
channel credentials are rebuilt for the next channel, so a certificate rotated by
cert-manager takes effect without a restart. API keys live in a file too (one key per line,
or `sha256:<hex>` of a key), re-read at most once a second when it changed, and are compared
in constant time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass

import grpc

from specdec.serving.settings import opt

log = logging.getLogger(__name__)

HASH_PREFIX = "sha256:"
# Settings fields that name a file (checked at start-up).
FILE_FLAG_SUFFIXES = ("_cert", "_key", "_ca", "_file")


class SecurityConfigError(ValueError):
    """A TLS or API-key setting that cannot work; the message names the flag."""


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SecurityConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from exc


def _mtimes(paths: list[str]) -> tuple:
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


def _pair(cert: str, key: str, what: str) -> None:
    if bool(cert) != bool(key):
        raise SecurityConfigError(f"{what}: give both the certificate and its key")


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate and, for mutual TLS, the CA its callers' certificates need."""

    cert: str
    key: str
    client_ca: str = ""  # set: every caller must present a certificate signed by this CA
    flag: str = "--tls-cert"

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that re-read the files at the next handshake after they change."""
        _pair(self.cert, self.key, f"{self.flag}/--tls-key")
        paths = [p for p in (self.cert, self.key, self.client_ca) if p]
        state = {"stamp": _mtimes(paths)}
        lock = threading.Lock()

        def load() -> grpc.ServerCertificateConfiguration:
            return grpc.ssl_server_certificate_configuration(
                [(_read(self.key, "--tls-key"), _read(self.cert, self.flag))],
                root_certificates=_read(self.client_ca, "--tls-ca") if self.client_ca else None,
            )

        initial = load()

        def fetch():  # called by gRPC core before each handshake; None keeps the current one
            stamp = _mtimes(paths)
            with lock:
                if stamp == state["stamp"]:
                    return None
                try:
                    config = load()
                except SecurityConfigError as exc:  # half-written rotation: keep the old one
                    log.warning("TLS files changed but cannot be read yet: %s", exc)
                    return None
                state["stamp"] = stamp
            log.info("TLS certificate files changed; using the new ones")
            return config

        return grpc.dynamic_ssl_server_credentials(
            initial, fetch, require_client_authentication=bool(self.client_ca)
        )


@dataclass(frozen=True)
class ClientTLS:
    """How a client verifies a server (its CA) and, for mutual TLS, its own certificate."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""  # the name the server certificate must carry (default: the host)

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)

    def credentials(self) -> grpc.ChannelCredentials:
        """Credentials built from the files as they are now (rotation: the next channel)."""
        _pair(self.cert, self.key, "client certificate")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--tls-ca") if self.ca else None,
            private_key=_read(self.key, "--tls-key") if self.key else None,
            certificate_chain=_read(self.cert, "--tls-cert") if self.cert else None,
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def stamp(self) -> tuple:
        """Changes when one of the files changes (then channels should be rebuilt)."""
        return _mtimes([p for p in (self.ca, self.cert, self.key) if p])


def hash_key(key: str) -> str:
    """The form a key may be stored in: `sha256:<hex>`."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def _parse_keys(text: str, path: str) -> list[bytes]:
    """SHA-256 digests of every key in an API-key file (blank lines and # comments skipped)."""
    digests = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(HASH_PREFIX):
            hexdigest = line[len(HASH_PREFIX) :]
            try:
                digest = bytes.fromhex(hexdigest)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise SecurityConfigError(
                    f"--api-keys-file: {path} line {number}: {HASH_PREFIX} needs 64 hex digits"
                )
            digests.append(digest)
        else:
            digests.append(hashlib.sha256(line.encode()).digest())
    return digests


class APIKeys:
    """The keys of an --api-keys-file; `check()` tells whether a presented key is one of them."""

    RELOAD_EVERY_S = 1.0

    def __init__(self, path: str):
        self.path = path
        self._stamp = None
        self._digests: list[bytes] = []
        self._checked = 0.0
        self._load(initial=True)

    def _load(self, initial: bool = False) -> None:
        stamp = _mtimes([self.path])
        if stamp == self._stamp:
            return
        try:
            digests = _parse_keys(_read(self.path, "--api-keys-file").decode(), self.path)
        except (SecurityConfigError, UnicodeDecodeError) as exc:
            if initial:
                raise SecurityConfigError(str(exc)) from exc
            log.warning("API key file changed but was not reloaded: %s", exc)
            return
        if not digests and initial:
            raise SecurityConfigError(f"--api-keys-file: {self.path} holds no key")
        if not initial:
            log.info("API key file changed: %d key(s)", len(digests))
        self._digests, self._stamp = digests, stamp

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked >= self.RELOAD_EVERY_S:
            self._checked = now
            self._load()

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, presented: str) -> bool:
        """Constant time in the key: every stored digest is compared, no early exit."""
        self._maybe_reload()
        digest = hashlib.sha256(presented.encode()).digest()
        found = False
        for stored in self._digests:
            found |= hmac.compare_digest(digest, stored)
        return found

    def authorize(self, metadata) -> str | None:
        """None when the call carries a valid `authorization: Bearer <key>`, else the reason."""
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return "missing API key: send metadata 'authorization: Bearer <key>'"
        scheme, _, key = values[0].partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "malformed authorization metadata: expected 'Bearer <key>'"
        if not self.check(key.strip()):
            return "invalid API key"
        return None


@dataclass(frozen=True)
class SecurityFlags:
    """Flags every service takes (each also SPECDEC_<FLAG>); the services subclass it."""

    tls_cert: str = opt("", "PEM certificate this server presents (re-read when it changes)")
    tls_key: str = opt("", "PEM private key of --tls-cert")
    tls_ca: str = opt(
        "",
        "cluster CA for mTLS between tiers: a worker then requires callers' certificates signed "
        "by it; the coordinator verifies worker certificates with it and presents its own",
    )
    reflection: bool = opt(False, "serve gRPC reflection (off: it lists the API to any caller)")
    redis_ca: str = opt(
        "", "CA file that verifies a rediss:// server (password: URL or SPECDEC_REDIS_PASSWORD)"
    )

    def validate_tls(self) -> None:
        """Refuse, naming the flag, a certificate without its key or a file that is missing."""
        _pair(self.tls_cert, self.tls_key, "--tls-cert/--tls-key")
        for field in dataclasses.fields(self):
            path = getattr(self, field.name)
            if field.name.endswith(FILE_FLAG_SUFFIXES) and path and not os.path.isfile(path):
                raise SecurityConfigError(f"--{field.name.replace('_', '-')}: no such file {path}")
