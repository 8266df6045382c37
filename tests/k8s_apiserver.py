"""A protocol-level stand-in for the Kubernetes API server's EndpointSlice endpoints.

Serves `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices` as a real API server
does: a list (EndpointSliceList with metadata.resourceVersion) or, with `watch=1`, a chunked
stream of one JSON watch event per line from the requested resourceVersion. The test drives
it: apply and delete slices (each bumps one global resourceVersion), send bookmarks, drop
open watches, expire old resourceVersions (410 Gone, as an ERROR event or an HTTP status),
stop and restart on the same port; every request is recorded.
"""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"


@dataclass(frozen=True)
class Request:
    path: str
    query: dict[str, str]
    authorized: bool

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("1", "true")

    @property
    def resource_version(self) -> str | None:
        return self.query.get("resourceVersion")


@dataclass(frozen=True)
class Event:
    resource_version: int
    namespace: str
    type: str  # ADDED | MODIFIED | DELETED
    object: dict


def endpoint_slice(
    name: str,
    labels: dict[str, str],
    endpoints: list[tuple[str, bool | None, bool | None]],
    ports: dict[str, int],
    address_type: str = "IPv4",
) -> dict:
    """An EndpointSlice object; each endpoint is (address, ready, terminating), None = unset."""
    items = []
    for address, ready, terminating in endpoints:
        conditions = {}
        if ready is not None:
            conditions["ready"] = ready
        if terminating is not None:
            conditions["terminating"] = terminating
        items.append({"addresses": [address], "conditions": conditions})
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": dict(labels)},
        "addressType": address_type,
        "endpoints": items,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
    }


def status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def selects(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors: `a=b`, `a==b`, `a!=b`, comma-separated (AND)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
    return True


class FakeAPIServer:
    """The EndpointSlice API of one cluster on 127.0.0.1; see the module docstring."""

    def __init__(self, token: str = ""):
        self.token = token
        self.expired_as = "event"  # how an expired resourceVersion is refused: event | http
        self.requests: list[Request] = []
        self._cond = threading.Condition()
        self._rv = 1000
        self._slices: dict[tuple[str, str], dict] = {}
        self._history: list[Event] = []
        self._bookmarks: list[int] = []
        self._expired_below = 0
        self._drops = 0
        self._closing = False
        self._sockets: set[socket.socket] = set()
        self._httpd: ThreadingHTTPServer | None = None
        self.port = 0
        self.start()

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Listen (again, on the same port after `stop`)."""
        with self._cond:
            self._closing = False
        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        """Stop listening and cut every open connection (the state is kept)."""
        if self._httpd is None:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd = None
        with self._cond:
            for sock in list(self._sockets):
                _shut(sock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- what the test controls -------------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def apply(self, namespace: str, obj: dict) -> int:
        """Create or replace a slice (ADDED or MODIFIED); returns its new resourceVersion."""
        key = (namespace, obj["metadata"]["name"])
        with self._cond:
            kind = "MODIFIED" if key in self._slices else "ADDED"
            return self._record(key, kind, copy.deepcopy(obj))

    def delete(self, namespace: str, name: str) -> int:
        with self._cond:
            return self._record((namespace, name), "DELETED", self._slices[(namespace, name)])

    def bookmark(self) -> int:
        """A BOOKMARK with the current resourceVersion to every open watch."""
        with self._cond:
            self._bookmarks.append(self._rv)
            self._cond.notify_all()
            return self._rv

    def drop_watches(self) -> None:
        """Cut every open watch mid-stream, as a lost connection does."""
        with self._cond:
            self._drops += 1
            self._cond.notify_all()

    def expire(self, below: int) -> None:
        """resourceVersions older than `below` are compacted: watches from them get 410."""
        with self._cond:
            self._expired_below = below

    def watches(self) -> list[Request]:
        with self._cond:
            return [r for r in self.requests if r.watch]

    def lists(self) -> list[Request]:
        with self._cond:
            return [r for r in self.requests if not r.watch]

    def wait_for(self, predicate, timeout_s: float = 10.0):
        """Wait until predicate(self) is truthy (checked on every request and change)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (result := predicate(self)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the API server stand-in never saw the expected state")
                self._cond.wait(min(left, 0.05))
            return result

    # --- internals (under self._cond) -------------------------------------------------

    def _record(self, key: tuple[str, str], kind: str, obj: dict) -> int:
        self._rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["namespace"] = key[0]
        obj["metadata"]["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            del self._slices[key]
        else:
            self._slices[key] = obj
        self._history.append(Event(self._rv, key[0], kind, obj))
        self._cond.notify_all()
        return self._rv

    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                with api._cond:
                    api._sockets.add(self.connection)

            def finish(self):
                with api._cond:
                    api._sockets.discard(self.connection)
                with contextlib.suppress(OSError):  # a connection the stand-in cut
                    super().finish()

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                api._serve(self)

        return Handler

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(req.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        authorized = not self.token or req.headers.get("Authorization") == f"Bearer {self.token}"
        request = Request(url.path, query, authorized)
        with self._cond:
            self.requests.append(request)
            self._cond.notify_all()
        if not authorized:
            return _send_json(req, 401, status(401, "Unauthorized", "Unauthorized"))
        parts = url.path[len(PREFIX) :].split("/") if url.path.startswith(PREFIX) else []
        if len(parts) != 2 or parts[1] != "endpointslices":
            return _send_json(req, 404, status(404, "NotFound", f"no such path {url.path}"))
        namespace, selector = parts[0], query.get("labelSelector", "")
        if not request.watch:
            return _send_json(req, 200, self._list(namespace, selector))
        since = request.resource_version
        with self._cond:
            expired = since not in (None, "", "0") and int(since) < self._expired_below
        if expired:
            gone = status(410, "Expired", f"too old resource version: {since} ({self._rv})")
            if self.expired_as == "http":
                return _send_json(req, 410, gone)
            _start_chunked(req)
            _send_chunk(req, {"type": "ERROR", "object": gone})
            return _end_chunked(req)
        self._stream(req, namespace, selector, since, float(query.get("timeoutSeconds", 1800)))

    def _list(self, namespace: str, selector: str) -> dict:
        with self._cond:
            items = [
                copy.deepcopy(obj)
                for (ns, _), obj in sorted(self._slices.items())
                if ns == namespace and selects(selector, obj["metadata"].get("labels", {}))
            ]
            return {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }

    def _stream(self, req, namespace: str, selector: str, since, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if since in (None, "", "0"):  # "any": the current state as ADDED events first
                backlog = [
                    {"type": "ADDED", "object": copy.deepcopy(obj)}
                    for (ns, _), obj in sorted(self._slices.items())
                    if ns == namespace and selects(selector, obj["metadata"].get("labels", {}))
                ]
                position = len(self._history)
            else:
                backlog = []
                position = next(
                    (i for i, e in enumerate(self._history) if e.resource_version > int(since)),
                    len(self._history),
                )
            drops, bookmarks = self._drops, len(self._bookmarks)
        _start_chunked(req)
        try:
            for event in backlog:
                _send_chunk(req, event)
            while True:
                with self._cond:
                    while (
                        position == len(self._history)
                        and bookmarks == len(self._bookmarks)
                        and drops == self._drops
                        and not self._closing
                        and time.monotonic() < deadline
                    ):
                        self._cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))
                    if drops != self._drops or self._closing:
                        req.close_connection = True
                        _shut(req.connection)  # no terminating chunk: the stream is cut
                        return
                    if time.monotonic() >= deadline:
                        break
                    pending = [
                        {"type": e.type, "object": copy.deepcopy(e.object)}
                        for e in self._history[position:]
                        if e.namespace == namespace
                        and selects(selector, e.object["metadata"].get("labels", {}))
                    ]
                    pending += [
                        {"type": "BOOKMARK", "object": _bookmark(rv)}
                        for rv in self._bookmarks[bookmarks:]
                    ]
                    position, bookmarks = len(self._history), len(self._bookmarks)
                for event in pending:
                    _send_chunk(req, event)
            _end_chunked(req)  # timeoutSeconds passed: a clean end, as the API server does
        except OSError:
            req.close_connection = True


def _bookmark(rv: int) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"resourceVersion": str(rv)},
    }


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _send_json(req, code: int, body: dict) -> None:
    raw = json.dumps(body).encode()
    req.send_response(code)
    req.send_header("Content-Type", "application/json")
    req.send_header("Content-Length", str(len(raw)))
    req.end_headers()
    req.wfile.write(raw)


def _start_chunked(req) -> None:
    req.send_response(200)
    req.send_header("Content-Type", "application/json")
    req.send_header("Transfer-Encoding", "chunked")
    req.end_headers()
    req.wfile.flush()


def _send_chunk(req, event: dict) -> None:
    raw = json.dumps(event).encode() + b"\n"
    req.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
    req.wfile.flush()


def _end_chunked(req) -> None:
    req.wfile.write(b"0\r\n\r\n")
    req.wfile.flush()
