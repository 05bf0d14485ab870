"""Shard servers as the operator sees them through their pods (pure)."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from shardq.coordination.takeovers import ServerObservation
from shardq_operator.naming import GRPC_PORT


def _epoch_ms(timestamp: str | None) -> int | None:
    if not timestamp:
        return None
    moment = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return int(moment.timestamp() * 1000)


def observe_pod(pod: Mapping[str, Any]) -> ServerObservation:
    """A pod's server: running while its container runs and the pod is not being deleted;
    started when that container started (a restarted container is a new process, whose
    predecessor's lease must not be renewed by it); ready since its Ready condition turned
    true. Kubelet times have whole seconds: a container restarted within the second its
    lease was taken is caught by lease expiry instead. Unready since the Ready condition
    turned false after the container started: it was ready in this incarnation and stopped
    answering (a restarted container's condition turned false before it started)."""
    metadata = pod.get("metadata", {})
    status = pod.get("status", {})
    name = metadata.get("name", "")
    statuses = [s for s in status.get("containerStatuses") or [] if s.get("name") == "server"]
    running_state = (statuses[0].get("state") or {}).get("running") if statuses else None
    running = running_state is not None and not metadata.get("deletionTimestamp") and status.get("phase") == "Running"
    started = _epoch_ms(running_state.get("startedAt")) if running_state else None
    ready_since = unready_since = None
    for condition in status.get("conditions") or []:
        if condition.get("type") != "Ready":
            continue
        changed = _epoch_ms(condition.get("lastTransitionTime"))
        if condition.get("status") == "True":
            ready_since = changed
        elif changed is not None and started is not None and changed > started:
            unready_since = changed
    return ServerObservation(
        name=name,
        running=running,
        started_at_ms=started or 0,
        ready_since_ms=ready_since if running else None,
        unready_since_ms=unready_since if running else None,
    )


def observe_servers(server_ids: Iterable[str], pods: Iterable[Mapping[str, Any]]) -> dict[str, ServerObservation]:
    """Every server of the map: from its pod, or not running when it has none."""
    by_name = {pod.get("metadata", {}).get("name", ""): pod for pod in pods}
    return {
        server_id: observe_pod(by_name[server_id])
        if server_id in by_name
        else ServerObservation(name=server_id, running=False, started_at_ms=0)
        for server_id in server_ids
    }


# Container waiting reasons that do not pass by themselves: someone must act.
_FAILING = {
    "CrashLoopBackOff",
    "ImagePullBackOff",
    "ErrImagePull",
    "ErrImageNeverPull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
}


@dataclasses.dataclass(frozen=True)
class NotReady:
    """Why a server is not ready, as its pod says: `kind` is "unschedulable" (no node will
    take the pod: an unbound volume, too little room), "failing" (its container cannot
    start or keeps exiting) or "starting" (it is on its way)."""

    kind: str
    detail: str


def why_not_ready(pod: Mapping[str, Any] | None) -> NotReady | None:
    """What keeps a server's pod from ready (None when it is ready). The cluster's status
    shows it: a pod stuck on an unbound volume read "servers starting" for good."""
    if pod is None:
        return NotReady("starting", "no pod yet")
    if observe_pod(pod).ready:
        return None
    metadata, status = pod.get("metadata", {}), pod.get("status", {})
    if metadata.get("deletionTimestamp"):
        return NotReady("starting", "its pod is being deleted")
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            why = condition.get("message") or condition.get("reason") or "no reason given"
            return NotReady("unschedulable", f"not scheduled: {why}")
    if not pod.get("spec", {}).get("nodeName"):
        return NotReady("starting", "not scheduled yet")
    statuses = [s for s in status.get("containerStatuses") or [] if s.get("name") == "server"]
    state = (statuses[0].get("state") or {}) if statuses else {}
    waiting = state.get("waiting")
    if waiting:
        reason = waiting.get("reason") or "waiting"
        text = f"{reason}: {waiting['message']}" if waiting.get("message") else reason
        last = ((statuses[0].get("lastState") or {}).get("terminated")) or {}
        if last:
            text += f" (last exit code {last.get('exitCode')}{', ' + last['reason'] if last.get('reason') else ''})"
        return NotReady("failing" if reason in _FAILING else "starting", text)
    if status.get("phase") in ("Failed", "Succeeded"):
        return NotReady("failing", f"its pod {status['phase'].lower()}")
    if state.get("running"):
        return NotReady("starting", "running, not ready yet (starting, or its replicas catching up)")
    if not statuses:
        return NotReady("starting", "scheduled, its container not created yet")
    return NotReady("starting", "not ready yet")


def servers_not_ready(server_ids: Iterable[str], pods: Iterable[Mapping[str, Any]]) -> dict[str, NotReady]:
    """Every server of the map that is not ready, with why (`why_not_ready`)."""
    by_name = {pod.get("metadata", {}).get("name", ""): pod for pod in pods}
    return {server_id: why for server_id in server_ids if (why := why_not_ready(by_name.get(server_id)))}


def pod_address(pod: Mapping[str, Any], port: int) -> str | None:
    """Where the operator reaches a pod's server (its IP: the operator may run outside the
    cluster's DNS), or None before it has one."""
    ip = pod.get("status", {}).get("podIP")
    return f"{ip}:{port}" if ip else None


def servers_to_ask(
    server_ids: Iterable[str], pods: Iterable[Mapping[str, Any]]
) -> tuple[dict[str, str], dict[str, str]]:
    """For a deleted queue's finalizer: the servers that can be asked whether they still
    hold its data ({server: address}), and those that cannot answer now, with why. A
    server that is down or starting may still hold the data on its volume; were it passed
    over, the queue would be gone while a copy lived on there, to come back (in its old
    epochs) under a queue or cluster created again with the same name."""
    by_name = {pod.get("metadata", {}).get("name", ""): pod for pod in pods}
    askable: dict[str, str] = {}
    silent: dict[str, str] = {}
    for server_id in sorted(set(server_ids) | set(by_name)):
        pod = by_name.get(server_id)
        address = None if pod is None else pod_address(pod, GRPC_PORT)
        if pod is None:
            silent[server_id] = "it has no pod"
        elif not observe_pod(pod).ready or address is None:
            silent[server_id] = "it is not ready"
        else:
            askable[server_id] = address
    return askable, silent
