"""The Kubernetes lease store: one coordination.k8s.io/v1 Lease per shard, in one namespace.

The API server gives compare-and-swap for free: a patch carrying
metadata.resourceVersion fails with 409 Conflict if the Lease changed since it was read.

Reads come from a watch, not from requests. Every replica looks at its shard's lease ten
times a second and every router at every lease five times a second; as GETs that is
hundreds of requests per second from a small cluster. One list, then one watch per
store (resumed from the last resourceVersion it saw, relisted on 410 Gone), keeps a copy
of every Lease carrying the store's labels; `get` and `list` answer from it. Writes are
requests, as before, and what they return goes into the copy at once, so a store always
reads its own writes; what other writers did is seen one watch event later. A read that
is stale costs nothing but a conflict: every write is a compare-and-swap, and a write
refused with 409 refreshes that lease with a direct read. While no watch is established
(starting, or reconnecting after an error) reads fall back to requests.
"""

from __future__ import annotations

import builtins
import collections
import datetime
import json
import logging
import math
import pathlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.watch.watch import iter_resp_lines

from shardq.coordination.leases import LeaseConflict, LeaseRecord

log = logging.getLogger(__name__)

# leaseDurationSeconds is whole seconds; the exact duration in ms is kept beside it so a
# record reads back as it was written. The annotation is ours: callers never see it.
DURATION_MS_ANNOTATION = "shardq.io/lease-duration-ms"
# Leases this store creates carry these labels, and list() selects on them, so Leases that
# other controllers keep in the same namespace are never mistaken for shards.
DEFAULT_LABELS: Mapping[str, str] = {"app.kubernetes.io/managed-by": "shardq"}

# A renewal that outlives the lease is worthless, and a caller stuck in a hung request
# cannot act on the answer; fencing itself never depends on a request returning.
DEFAULT_REQUEST_TIMEOUT_SECONDS = 5.0
# The API server ends each watch after this long and the store resumes it: a connection
# that died silently is noticed within this bound (plus the request timeout).
DEFAULT_WATCH_TIMEOUT_SECONDS = 60
_FIRST_RETRY_S = 0.1
_LAST_RETRY_S = 5.0

_UNIX_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_HTTP_NOT_FOUND = 404
_HTTP_CONFLICT = 409
_HTTP_GONE = 410


def connect(*, kubeconfig: pathlib.Path | None = None) -> client.ApiClient:
    """An API client from `kubeconfig`, or from the pod's service account when None.
    Raises ValueError saying what is missing (outside a pod, without a kubeconfig, the
    client's own exception ended `shardq serve` in a traceback)."""
    configuration = client.Configuration()
    try:
        if kubeconfig is None:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig), client_configuration=configuration
            )
    except ConfigException as error:
        where = "outside a pod: give --kubeconfig" if kubeconfig is None else f"kubeconfig {kubeconfig}"
        raise ValueError(f"no Kubernetes API client {where} ({error})") from None
    return client.ApiClient(configuration)


class _WatchGone(Exception):
    """The API server no longer has the version the watch was to resume from (410 Gone)."""


class KubernetesLeaseStore:
    """A LeaseStore over Lease objects in `namespace`, through the official client.

    Needs get, list, watch, create and patch on leases.coordination.k8s.io in that
    namespace. With `watch=True` (the default) call `close()` when done: it stops the
    watch thread. `requests` counts the API requests this store made, by verb.
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        namespace: str,
        labels: Mapping[str, str] = DEFAULT_LABELS,
        request_timeout_seconds: float = DEFAULT_REQUEST_TIMEOUT_SECONDS,
        watch: bool = True,
        watch_timeout_seconds: int = DEFAULT_WATCH_TIMEOUT_SECONDS,
    ) -> None:
        self._api_client = api_client
        self._leases = client.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.labels = dict(labels)
        self.request_timeout_seconds = request_timeout_seconds
        self.watch_timeout_seconds = watch_timeout_seconds
        self.requests: collections.Counter[str] = collections.Counter()
        # The watched copy: name -> record, and whether a watch currently keeps it fresh.
        self._lock = threading.Lock()
        self._records: dict[str, LeaseRecord] = {}
        self._current = False
        self._resume_version: str | None = None
        self._forced_version: str | None = None
        self._stopping = threading.Event()
        self._response: Any = None
        self.relists = 0
        self.watches_started = 0
        self._thread: threading.Thread | None = None
        if watch:
            self._thread = threading.Thread(target=self._watch_forever, name=f"lease-watch-{namespace}", daemon=True)
            self._thread.start()

    # -- reads -------------------------------------------------------------------------
    def get(self, name: str) -> LeaseRecord | None:
        with self._lock:
            if self._current:
                return self._records.get(name)
        return self._read(name)

    def list(self, prefix: str) -> builtins.list[LeaseRecord]:
        with self._lock:
            if self._current:
                return sorted(
                    (record for name, record in self._records.items() if name.startswith(prefix)),
                    key=lambda record: record.name,
                )
        return [record for record in self._list_all() if record.name.startswith(prefix)]

    def wait_until_watching(self, timeout_seconds: float) -> bool:
        """True once a watch keeps the copy fresh (reads no longer send requests)."""
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            with self._lock:
                if self._current:
                    return True
            time.sleep(0.01)
        return False

    def _read(self, name: str) -> LeaseRecord | None:
        self.requests["get"] += 1
        try:
            lease = self._leases.read_namespaced_lease(
                name, self.namespace, _request_timeout=self.request_timeout_seconds
            )
        except ApiException as error:
            if error.status == _HTTP_NOT_FOUND:
                return None
            raise
        record = record_from_lease(lease)
        self._remember(record)
        return record

    # -- writes ------------------------------------------------------------------------
    def create(self, record: LeaseRecord) -> LeaseRecord:
        lease = lease_from_record(record, labels=self.labels)
        self.requests["create"] += 1
        try:
            created = self._leases.create_namespaced_lease(
                self.namespace, lease, _request_timeout=self.request_timeout_seconds
            )
        except ApiException as error:
            if error.status == _HTTP_CONFLICT:
                raise LeaseConflict(f"lease {record.name!r} already exists") from error
            raise
        stored = record_from_lease(created)
        self._remember(stored)
        return stored

    def update(self, record: LeaseRecord) -> LeaseRecord:
        # Without a resourceVersion the write would be unconditional: a blind overwrite.
        if not record.version:
            raise ValueError(f"lease {record.name!r}: an update needs the version it was read at")
        # A JSON Patch, not a replace: a PUT to a Lease that was deleted recreates it (Leases
        # allow create-on-update), which would resurrect an old epoch without the owner
        # references that let the garbage collector remove it; a PUT would also drop the
        # labels and owner references the operator set. A patch of a missing object is 404,
        # and the resourceVersion it carries makes the server answer 409 if the Lease moved on.
        patch: builtins.list[dict[str, Any]] = [
            {"op": "replace", "path": "/metadata/resourceVersion", "value": record.version},
            {"op": "add", "path": "/metadata/annotations", "value": _annotations_of(record)},
            {"op": "add", "path": "/spec", "value": _spec_json(record)},
        ]
        self.requests["patch"] += 1
        try:
            patched = self._leases.patch_namespaced_lease(
                record.name,
                self.namespace,
                patch,
                _content_type="application/json-patch+json",
                _request_timeout=self.request_timeout_seconds,
            )
        except ApiException as error:
            if error.status == _HTTP_CONFLICT:
                # Our copy was behind: bring this lease up to date so the caller's next
                # read (its retry) sees what beat it, not the watch's lag.
                self._refresh_after_conflict(record.name)
                raise LeaseConflict(f"lease {record.name!r} changed since version {record.version}") from error
            if error.status == _HTTP_NOT_FOUND:
                self._forget(record.name)
                raise LeaseConflict(f"lease {record.name!r} does not exist") from error
            raise
        stored = record_from_lease(patched)
        self._remember(stored)
        return stored

    def _refresh_after_conflict(self, name: str) -> None:
        try:
            if self._read(name) is None:
                self._forget(name)
        except Exception:  # the conflict is the answer; a failed refresh only leaves the copy as it was
            log.debug("could not refresh lease %s after a conflict", name, exc_info=True)

    # -- the watched copy ----------------------------------------------------------------
    def _remember(self, record: LeaseRecord) -> None:
        with self._lock:
            known = self._records.get(record.name)
            if known is None or _is_newer(record.version, known.version):
                self._records[record.name] = record

    def _forget(self, name: str) -> None:
        with self._lock:
            self._records.pop(name, None)

    def close(self) -> None:
        self._stopping.set()
        self._close_response()
        if self._thread is not None:
            self._thread.join(timeout=self.request_timeout_seconds + 1)
        with self._lock:
            self._current = False

    def _close_response(self) -> None:
        response = self._response
        if response is not None:
            try:
                # urllib3 2.3+: unblocks a read in progress in the watch thread.
                response.shutdown()
            except Exception:
                log.debug("closing the lease watch", exc_info=True)

    def _resume_from(self, version: str) -> None:
        """Make the watch resume from `version`, as after a long disconnection (for tests:
        the API server's answer to a version it no longer has is the real 410 Gone)."""
        self._forced_version = version
        self._close_response()

    def _watch_forever(self) -> None:
        retry_s = _FIRST_RETRY_S
        while not self._stopping.is_set():
            if self._forced_version is not None:
                self._resume_version, self._forced_version = self._forced_version, None
            try:
                if self._resume_version is None:
                    self._relist()
                self._watch_once()
                retry_s = _FIRST_RETRY_S
            except _WatchGone:
                log.info("lease watch in %s: version gone (410), listing again", self.namespace)
                self._resume_version = None
            except Exception as error:
                if self._stopping.is_set():
                    break
                with self._lock:
                    self._current = False
                log.warning("lease watch in %s failed (%s); reads use requests until it resumes", self.namespace, error)
                self._stopping.wait(retry_s)
                retry_s = min(retry_s * 2, _LAST_RETRY_S)

    def _list_all(self) -> builtins.list[LeaseRecord]:
        records, _ = self._list_with_version()
        return records

    def _list_with_version(self) -> tuple[builtins.list[LeaseRecord], str]:
        found: builtins.list[LeaseRecord] = []
        page: str | None = None
        version = ""
        while True:
            self.requests["list"] += 1
            leases = self._leases.list_namespaced_lease(
                self.namespace,
                label_selector=self._selector() or None,
                limit=500,
                _continue=page,
                _request_timeout=self.request_timeout_seconds,
            )
            found.extend(record_from_lease(lease) for lease in leases.items if lease.metadata is not None)
            metadata = leases.metadata
            version = (metadata.resource_version if metadata is not None else "") or version
            page = metadata.var_continue if metadata is not None else None
            if not page:
                break
        return sorted(found, key=lambda record: record.name), version

    def _relist(self) -> None:
        records, version = self._list_with_version()
        self.relists += 1
        with self._lock:
            self._records = {record.name: record for record in records}
        self._resume_version = version

    def _watch_once(self) -> None:
        self.requests["watch"] += 1
        try:
            # With _preload_content=False the client returns the raw urllib3 response.
            response: Any = self._leases.list_namespaced_lease(
                self.namespace,
                label_selector=self._selector() or None,
                watch=True,
                resource_version=self._resume_version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_timeout_seconds,
                _preload_content=False,
                _request_timeout=(
                    self.request_timeout_seconds,
                    self.watch_timeout_seconds + self.request_timeout_seconds,
                ),
            )
        except ApiException as error:
            if error.status == _HTTP_GONE:
                raise _WatchGone(str(error.reason)) from error
            raise
        self._response = response
        self.watches_started += 1
        try:
            # The stream is established: from here on the copy misses nothing.
            with self._lock:
                self._current = True
            for line in _lines(response, self._stopping):
                self._apply(json.loads(line))
        finally:
            self._response = None
            response.release_conn()

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        body = event.get("object") or {}
        if kind == "ERROR":
            if body.get("code") == _HTTP_GONE:
                raise _WatchGone(body.get("message", ""))
            raise RuntimeError(f"watch error {body.get('code')}: {body.get('message', '')}")
        version = str((body.get("metadata") or {}).get("resourceVersion", ""))
        if kind == "BOOKMARK":
            self._resume_version = version or self._resume_version
            return
        lease = self._api_client.deserialize(json.dumps(body), "V1Lease", "application/json")
        record = record_from_lease(lease)
        if kind == "DELETED":
            self._forget(record.name)
        else:
            self._remember(record)
        self._resume_version = version or self._resume_version

    def _selector(self) -> str:
        return ",".join(f"{key}={value}" for key, value in sorted(self.labels.items()))


def _lines(response: Any, stopping: threading.Event) -> Iterator[str]:
    for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
        if stopping.is_set():
            return
        if line:
            yield line


def _is_newer(version: str, than: str) -> bool:
    """Whether `version` comes after `than`. resourceVersions are opaque, but the API
    server's are etcd revisions (integers); when they are not, the later arrival wins."""
    if version.isdigit() and than.isdigit():
        return int(version) > int(than)
    return True


def lease_from_record(record: LeaseRecord, *, labels: Mapping[str, str]) -> client.V1Lease:
    """The Lease object for `record`; its resourceVersion is the record's version, if any."""
    return client.V1Lease(
        api_version="coordination.k8s.io/v1",
        kind="Lease",
        metadata=client.V1ObjectMeta(
            name=record.name,
            labels=dict(labels),
            annotations=_annotations_of(record),
            resource_version=record.version or None,
        ),
        spec=_spec_of(record),
    )


def _annotations_of(record: LeaseRecord) -> dict[str, str]:
    annotations = dict(record.annotations)
    annotations[DURATION_MS_ANNOTATION] = str(record.duration_ms)
    return annotations


def _spec_of(record: LeaseRecord) -> client.V1LeaseSpec:
    return client.V1LeaseSpec(
        holder_identity=record.holder or None,
        acquire_time=_micro_time(record.acquire_time_ms),
        renew_time=_micro_time(record.renew_time_ms),
        lease_duration_seconds=_whole_seconds(record.duration_ms),
        lease_transitions=record.transitions,
    )


def _spec_json(record: LeaseRecord) -> dict[str, Any]:
    """The spec as the API's JSON, for a patch; a field left out is cleared, as in `_spec_of`."""
    spec: dict[str, Any] = {"leaseTransitions": record.transitions}
    if record.holder:
        spec["holderIdentity"] = record.holder
    for field, epoch_ms in (("acquireTime", record.acquire_time_ms), ("renewTime", record.renew_time_ms)):
        moment = _micro_time(epoch_ms)
        if moment is not None:
            spec[field] = moment.isoformat()
    duration_seconds = _whole_seconds(record.duration_ms)
    if duration_seconds is not None:
        spec["leaseDurationSeconds"] = duration_seconds
    return spec


def _whole_seconds(duration_ms: int) -> int | None:
    # Rounded up: a reader that only knows the spec must never see a shorter lease than
    # the holder counts with.
    return math.ceil(duration_ms / 1000) if duration_ms > 0 else None


def record_from_lease(lease: client.V1Lease) -> LeaseRecord:
    """The record a Lease stands for, including Leases edited by hand (kubectl)."""
    metadata = lease.metadata or client.V1ObjectMeta()
    spec = lease.spec or client.V1LeaseSpec()
    annotations = dict(metadata.annotations or {})
    exact_duration_ms = annotations.pop(DURATION_MS_ANNOTATION, None)
    duration_seconds = spec.lease_duration_seconds or 0
    duration_ms = duration_seconds * 1000
    # Trust the exact figure only while it still agrees with the spec: if someone changed
    # leaseDurationSeconds by hand, the spec is what every other Lease reader obeys.
    if exact_duration_ms is not None and exact_duration_ms.isdigit():
        exact = int(exact_duration_ms)
        if (_whole_seconds(exact) or 0) == duration_seconds:
            duration_ms = exact
    return LeaseRecord(
        name=metadata.name or "",
        holder=spec.holder_identity or "",
        acquire_time_ms=_epoch_ms(spec.acquire_time),
        renew_time_ms=_epoch_ms(spec.renew_time),
        duration_ms=duration_ms,
        transitions=spec.lease_transitions or 0,
        annotations=annotations,
        version=metadata.resource_version or "",
    )


class _MicroTime(datetime.datetime):
    """A datetime that always serializes with microseconds.

    The client serializes datetimes with isoformat(), which drops the fraction when it is
    zero, and the API server parses MicroTime with a fixed six-digit fraction: a lease
    renewed on a whole second would be refused with 400 Bad Request.
    """

    def isoformat(self, sep: str = "T", timespec: str = "auto") -> str:
        return super().isoformat(sep, "microseconds" if timespec == "auto" else timespec)


_UNIX_EPOCH_MICRO = _MicroTime(1970, 1, 1, tzinfo=datetime.UTC)


def _micro_time(epoch_ms: int) -> datetime.datetime | None:
    if epoch_ms <= 0:
        return None
    # Integer arithmetic: a float timestamp could round 0.123 s down to 122 ms. Adding a
    # timedelta keeps the subclass.
    return _UNIX_EPOCH_MICRO + datetime.timedelta(milliseconds=epoch_ms)


def _epoch_ms(moment: datetime.datetime | None) -> int:
    if moment is None:
        return 0
    if moment.tzinfo is None:
        # MicroTime is always UTC on the wire; a naive value can only be UTC.
        moment = moment.replace(tzinfo=datetime.UTC)
    delta = moment - _UNIX_EPOCH
    return delta.days * 86_400_000 + delta.seconds * 1000 + delta.microseconds // 1000
