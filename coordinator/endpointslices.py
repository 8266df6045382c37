"""--discovery kubernetes: workers are the ready endpoints of the EndpointSlices
(discovery.k8s.io/v1) that a label selector picks per tier, in one namespace.

Each tier is listed, then watched from the list's resourceVersion, in a daemon thread (the
Kubernetes client is synchronous); the async pool reads a snapshot. A watch that ends or is
cut resumes from the last resourceVersion seen (list, event or BOOKMARK); 410 Gone means
that version was compacted away, so the tier is listed again and its state replaced. While
the API server is unreachable the last known endpoints stay in use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
LIST_TIMEOUT_S = 30.0
READ_SLACK_S = 15.0  # a watch's socket gives up this long after the server should have ended it
GONE = 410


def ready_addresses(endpoint_slice: dict, port_name: str) -> frozenset[str]:
    """`host:port` of the slice's ready, non-terminating endpoints (conditions left unset
    count as ready and not terminating), on the port named `port_name`; IPv6 bracketed."""
    port = next(
        (
            p["port"]
            for p in endpoint_slice.get("ports") or []
            if (p.get("name") or "") == port_name and p.get("port")
        ),
        None,
    )
    if port is None:
        return frozenset()
    found = set()
    for endpoint in endpoint_slice.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        addresses = endpoint.get("addresses") or []
        if addresses:  # only the first one has defined semantics
            host = addresses[0]
            found.add(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return frozenset(found)


def api_client(kubeconfig: str = "") -> client.ApiClient:
    """A client of `kubeconfig`, else of the pod's service account in a pod, else of
    $KUBECONFIG (or ~/.kube/config)."""
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))


class SliceWatch:
    """One tier's EndpointSlices, listed then watched in a daemon thread; `endpoints()` is a
    thread-safe snapshot of their ready addresses."""

    def __init__(
        self,
        api: client.DiscoveryV1Api,
        namespace: str,
        selector: str,
        port_name: str,
        watch_timeout_s: int = 300,
        backoff_s: tuple[float, float] = (0.5, 10.0),
    ):
        self.api, self.namespace, self.selector = api, namespace, selector
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        self.backoff_s = backoff_s
        self.resource_version: str | None = None  # where the next watch starts; None = list
        self.listed = threading.Event()  # set once the first list has landed
        self._slices: dict[str, frozenset[str]] = {}  # slice name → its ready addresses
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._delay = backoff_s[0]
        self._listed_for_nothing = False  # a 410 re-listed and no event has come since
        self._thread = threading.Thread(
            target=self._run, name=f"endpointslices {selector}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread: cut its open watch (again, until it notices)."""
        self._stop.set()
        for _ in range(max(1, int(timeout_s / 0.1))):
            if self._watch is not None:
                self._watch.stop()
            self._thread.join(0.1)
            if not self._thread.is_alive():
                return
        log.warning("endpointslices %s: watch thread still running", self.selector)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def endpoints(self) -> frozenset[str]:
        with self._lock:
            return frozenset().union(*self._slices.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self._list()
                started = time.monotonic()
                if self._follow() or time.monotonic() - started >= 1.0:
                    self._delay = self.backoff_s[0]
                else:
                    self._back_off("the watch ended at once")  # never spin on the server
            except ApiException as exc:
                if exc.status == GONE and self.resource_version is not None:
                    log.info(
                        "endpointslices %s: resourceVersion %s expired, listing again",
                        self.selector,
                        self.resource_version,
                    )
                    if self._listed_for_nothing:  # gone again with no event between
                        self._back_off("410 Gone right after a list")
                    self._listed_for_nothing = True
                    self.resource_version = None
                    continue
                self._back_off(f"{exc.status} {exc.reason}")
            except (urllib3.exceptions.HTTPError, OSError) as exc:  # refused, cut, timed out
                self._back_off(f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 - an answer we cannot read: start over
                self.resource_version = None
                self._back_off(f"{type(exc).__name__}: {exc}")

    def _back_off(self, why: str) -> None:
        if self._stop.is_set():
            return
        log.warning(
            "endpointslices %s: %s; keeping %d known endpoint(s), retrying in %.1f s",
            self.selector,
            why,
            len(self.endpoints()),
            self._delay,
        )
        self._stop.wait(self._delay)
        self._delay = min(self._delay * 2, self.backoff_s[1])

    def _list(self) -> None:
        """Replace the state with the server's current one."""
        response = self.api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT_S, LIST_TIMEOUT_S),
        )
        listing = json.loads(response.data)
        slices = {
            item["metadata"]["name"]: ready_addresses(item, self.port_name)
            for item in listing.get("items") or []
        }
        with self._lock:
            self._slices = slices
        self.resource_version = listing["metadata"]["resourceVersion"]
        self.listed.set()

    def _follow(self) -> int:
        """Apply watch events from `resource_version` until the server ends the watch;
        returns how many arrived."""
        self._watch = watch.Watch()
        if self._stop.is_set():
            return 0
        events = 0
        stream = self._watch.stream(
            self.api.list_namespaced_endpoint_slice,
            self.namespace,
            label_selector=self.selector,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            _request_timeout=(CONNECT_TIMEOUT_S, self.watch_timeout_s + READ_SLACK_S),
        )
        for event in stream:
            kind, obj = event["type"], event["raw_object"]
            if kind == "ERROR":  # the client raises these itself; in case one slips through
                raise ApiException(status=obj.get("code"), reason=obj.get("reason"))
            name = (obj.get("metadata") or {}).get("name")
            if kind in ("ADDED", "MODIFIED"):
                addresses = ready_addresses(obj, self.port_name)
                with self._lock:
                    self._slices[name] = addresses
            elif kind == "DELETED":
                with self._lock:
                    self._slices.pop(name, None)
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if version:
                self.resource_version = version
            self._delay, self._listed_for_nothing = self.backoff_s[0], False
            events += 1
            if self._stop.is_set():
                break
        return events


class KubernetesDiscovery:
    """Both tiers' EndpointSlice watches, behind the `Discovery` interface."""

    def __init__(
        self,
        selectors: dict[str, str],
        namespace: str,
        port_name: str = "grpc",
        kubeconfig: str = "",
        watch_timeout_s: int = 300,
        first_list_s: float = 2.0,
    ):
        self.selectors, self.namespace, self.port_name = selectors, namespace, port_name
        self.kubeconfig = kubeconfig
        self.watch_timeout_s = watch_timeout_s
        self.first_list_s = first_list_s
        self.watches: dict[str, SliceWatch] = {}
        self._client: client.ApiClient | None = None

    async def start(self) -> None:
        """Start the watches; wait up to `first_list_s` for their first lists (an API
        server that is down only delays the workers, it does not fail the start)."""
        self._client = await asyncio.to_thread(api_client, self.kubeconfig)
        api = client.DiscoveryV1Api(self._client)
        for role, selector in self.selectors.items():
            self.watches[role] = SliceWatch(
                api, self.namespace, selector, self.port_name, self.watch_timeout_s
            )
            self.watches[role].start()
        await asyncio.gather(
            *(asyncio.to_thread(s.listed.wait, self.first_list_s) for s in self.watches.values())
        )

    async def addresses(self, role: str) -> dict[str, float]:
        slices = self.watches.get(role)
        return dict.fromkeys(sorted(slices.endpoints()), 0.0) if slices else {}

    async def close(self) -> None:
        for slices in self.watches.values():
            await asyncio.to_thread(slices.stop)
        if self._client is not None:
            self._client.close()
