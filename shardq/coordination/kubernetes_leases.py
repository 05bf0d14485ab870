"""The Kubernetes lease store: one coordination.k8s.io/v1 Lease per shard, in one namespace.

The API server gives compare-and-swap for free: a replace carrying
metadata.resourceVersion fails with 409 Conflict if the Lease changed since it was read.
"""

from __future__ import annotations

import builtins
import datetime
import math
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from shardq.coordination.leases import LeaseConflict, LeaseRecord

# leaseDurationSeconds is whole seconds; the exact duration in ms is kept beside it so a
# record reads back as it was written. The annotation is ours: callers never see it.
DURATION_MS_ANNOTATION = "shardq.io/lease-duration-ms"
# Leases this store creates carry these labels, and list() selects on them, so Leases that
# other controllers keep in the same namespace are never mistaken for shards.
DEFAULT_LABELS: Mapping[str, str] = {"app.kubernetes.io/managed-by": "shardq"}

# A renewal that outlives the lease is worthless, and a caller stuck in a hung request
# cannot act on the answer; fencing itself never depends on a request returning.
DEFAULT_REQUEST_TIMEOUT_SECONDS = 5.0

_UNIX_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_HTTP_NOT_FOUND = 404
_HTTP_CONFLICT = 409


class KubernetesLeaseStore:
    """A LeaseStore over Lease objects in `namespace`, through the official client.

    Needs get, list, create and patch on leases.coordination.k8s.io in that namespace.
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        namespace: str,
        labels: Mapping[str, str] = DEFAULT_LABELS,
        request_timeout_seconds: float = DEFAULT_REQUEST_TIMEOUT_SECONDS,
    ) -> None:
        self._leases = client.CoordinationV1Api(api_client)
        self.namespace = namespace
        self.labels = dict(labels)
        self.request_timeout_seconds = request_timeout_seconds

    def get(self, name: str) -> LeaseRecord | None:
        try:
            lease = self._leases.read_namespaced_lease(
                name, self.namespace, _request_timeout=self.request_timeout_seconds
            )
        except ApiException as error:
            if error.status == _HTTP_NOT_FOUND:
                return None
            raise
        return record_from_lease(lease)

    def create(self, record: LeaseRecord) -> LeaseRecord:
        lease = lease_from_record(record, labels=self.labels)
        try:
            created = self._leases.create_namespaced_lease(
                self.namespace, lease, _request_timeout=self.request_timeout_seconds
            )
        except ApiException as error:
            if error.status == _HTTP_CONFLICT:
                raise LeaseConflict(f"lease {record.name!r} already exists") from error
            raise
        return record_from_lease(created)

    def update(self, record: LeaseRecord) -> LeaseRecord:
        # Without a resourceVersion the write would be unconditional: a blind overwrite.
        if not record.version:
            raise ValueError(f"lease {record.name!r}: an update needs the version it was read at")
        # A JSON Patch, not a replace: a PUT to a Lease that was deleted recreates it (Leases
        # allow create-on-update), which would resurrect an old epoch without the owner
        # references that let the garbage collector remove it; a PUT would also drop the
        # labels and owner references the operator set. A patch of a missing object is 404,
        # and the resourceVersion it carries makes the server answer 409 if the Lease moved on.
        patch: list[dict[str, Any]] = [
            {"op": "replace", "path": "/metadata/resourceVersion", "value": record.version},
            {"op": "add", "path": "/metadata/annotations", "value": _annotations_of(record)},
            {"op": "add", "path": "/spec", "value": _spec_json(record)},
        ]
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
                raise LeaseConflict(f"lease {record.name!r} changed since version {record.version}") from error
            if error.status == _HTTP_NOT_FOUND:
                raise LeaseConflict(f"lease {record.name!r} does not exist") from error
            raise
        return record_from_lease(patched)

    def list(self, prefix: str) -> builtins.list[LeaseRecord]:
        # The API has no name-prefix filter; the label selector keeps the listing to our Leases.
        selector = ",".join(f"{key}={value}" for key, value in sorted(self.labels.items()))
        found: builtins.list[LeaseRecord] = []
        page: str | None = None
        while True:
            leases = self._leases.list_namespaced_lease(
                self.namespace,
                label_selector=selector or None,
                limit=500,
                _continue=page,
                _request_timeout=self.request_timeout_seconds,
            )
            found.extend(
                record_from_lease(lease)
                for lease in leases.items
                if lease.metadata is not None and (lease.metadata.name or "").startswith(prefix)
            )
            page = leases.metadata.var_continue if leases.metadata is not None else None
            if not page:
                break
        return sorted(found, key=lambda record: record.name)


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
