"""A history of client operations: what each client asked, when, and what it was told.

Every operation carries two timestamps on two clocks: monotonic nanoseconds
(real-time order between operations, comparable across threads and processes
of one machine) and wall milliseconds (comparable with the server's
`visible_until_ms`, which is server wall time on the same machine).

An operation's outcome is one of:
- OK: the server acknowledged it;
- FAILED: the server definitely did not do it (e.g. STALE_RECEIPT);
- UNKNOWN: it may or may not have taken effect (timeout, connection loss,
  NOT_LEADER or UNAVAILABLE from a server that may have forwarded it).

Batch calls are recorded as one operation per entry with the call's timing:
entries of one batch are concurrent operations.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import pathlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeAlias, cast

from shardq.errors import Reason
from shardq.receipts import MalformedReceipt, decode_receipt


class Status(enum.StrEnum):
    OK = "ok"
    FAILED = "failed"
    UNKNOWN = "unknown"


# Reasons that mean "the server looked at the request and refused it": nothing
# happened. Every other error (and any transport failure) leaves the outcome unknown.
DEFINITE_REFUSALS = frozenset(
    {
        Reason.INVALID_ARGUMENT,
        Reason.QUEUE_NOT_FOUND,
        Reason.QUEUE_FULL,
        Reason.STALE_RECEIPT,
        Reason.RECEIPT_EXPIRED,
        Reason.MALFORMED_RECEIPT,
        Reason.MESSAGE_NOT_FOUND,
        Reason.WRONG_QUEUE,
    }
)


def status_for_reason(reason: str) -> Status:
    """FAILED for a definite refusal, UNKNOWN for anything that may have happened."""
    return Status.FAILED if reason in DEFINITE_REFUSALS else Status.UNKNOWN


@dataclasses.dataclass(frozen=True, slots=True)
class Invocation:
    op_id: int
    client: str
    invoke_ns: int
    invoke_wall_ms: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Operation:
    op_id: int
    client: str
    queue: str
    invoke_ns: int
    complete_ns: int
    invoke_wall_ms: int
    complete_wall_ms: int
    status: Status
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Send(Operation):
    body: str
    group_id: str = ""
    dedup_id: str = ""
    # Set when OK.
    message_id: str = ""
    duplicate: bool = False
    shard: int = -1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """One message in a successful receive."""

    message_id: str
    body: str
    group_id: str
    dedup_id: str
    receipt: str
    shard: int
    seq: int
    epoch: int
    claim_token: int
    receive_count: int
    visible_until_ms: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Receive(Operation):
    max_messages: int
    visibility_timeout_ms: int
    deliveries: tuple[Delivery, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Delete(Operation):
    receipt: str
    # The message the receipt was issued for (the client knows it from the delivery).
    message_id: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChangeVisibility(Operation):
    receipt: str
    message_id: str
    visibility_timeout_ms: int


AnyOperation: TypeAlias = Send | Receive | Delete | ChangeVisibility
_KIND_BY_TYPE: dict[type[Operation], str] = {
    Send: "send",
    Receive: "receive",
    Delete: "delete",
    ChangeVisibility: "change_visibility",
}
_TYPE_BY_KIND: dict[str, type[Operation]] = {kind: cls for cls, kind in _KIND_BY_TYPE.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class StoredMessage:
    """A message still stored when the run ended (read by export after the final drain)."""

    queue: str
    message_id: str
    body: str
    group_id: str = ""
    dedup_id: str = ""


def delivery_from_received(
    *,
    message_id: str,
    body: bytes,
    group_id: str,
    dedup_id: str,
    receipt: str,
    shard: int,
    seq: int,
    receive_count: int,
    visible_until_ms: int,
) -> Delivery:
    try:
        decoded = decode_receipt(receipt)
        epoch, claim_token = decoded.epoch, decoded.claim_token
    except MalformedReceipt:
        epoch, claim_token = -1, -1
    return Delivery(
        message_id=message_id,
        body=body.decode(errors="replace"),
        group_id=group_id,
        dedup_id=dedup_id,
        receipt=receipt,
        shard=shard,
        seq=seq,
        epoch=epoch,
        claim_token=claim_token,
        receive_count=receive_count,
        visible_until_ms=visible_until_ms,
    )


def now_ns() -> int:
    return time.monotonic_ns()


def now_wall_ms() -> int:
    return time.time_ns() // 1_000_000


class History:
    """Append-only, thread-safe record of operations (asyncio tasks may share it too:
    appends never await, and the lock is only held for a list append)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._operations: list[AnyOperation] = []
        self._ids = itertools.count(1)

    def invoke(self, client: str) -> Invocation:
        """Take the invocation timestamps; call right before sending the request."""
        with self._lock:
            op_id = next(self._ids)
        return Invocation(op_id, client, now_ns(), now_wall_ms())

    @staticmethod
    def completion(invocation: Invocation) -> dict[str, Any]:
        """The common fields of a finished operation; take them right after the answer."""
        return {
            "op_id": invocation.op_id,
            "client": invocation.client,
            "invoke_ns": invocation.invoke_ns,
            "invoke_wall_ms": invocation.invoke_wall_ms,
            "complete_ns": now_ns(),
            "complete_wall_ms": now_wall_ms(),
        }

    def append(self, *operations: AnyOperation) -> None:
        with self._lock:
            self._operations.extend(operations)

    def operations(self) -> list[AnyOperation]:
        with self._lock:
            return list(self._operations)

    def __len__(self) -> int:
        with self._lock:
            return len(self._operations)

    def __iter__(self) -> Iterator[AnyOperation]:
        return iter(self.operations())

    def dump(self, path: pathlib.Path) -> None:
        dump_history(self.operations(), path)


def operation_to_json(operation: AnyOperation) -> dict[str, Any]:
    data = dataclasses.asdict(operation)
    data["kind"] = _KIND_BY_TYPE[type(operation)]
    return data


def operation_from_json(data: dict[str, Any]) -> AnyOperation:
    fields = dict(data)
    cls = _TYPE_BY_KIND[fields.pop("kind")]
    fields["status"] = Status(fields["status"])
    if cls is Receive:
        fields["deliveries"] = tuple(Delivery(**d) for d in fields["deliveries"])
    return cast(AnyOperation, cls(**fields))


def dump_history(
    operations: Iterable[AnyOperation], path: pathlib.Path, *, final: Sequence[StoredMessage] = ()
) -> None:
    """JSON lines, one operation per line in op id order, then one line per stored message."""
    with path.open("w") as out:
        for operation in sorted(operations, key=lambda o: o.op_id):
            out.write(json.dumps(operation_to_json(operation), sort_keys=True) + "\n")
        for message in final:
            out.write(json.dumps({"kind": "stored", **dataclasses.asdict(message)}, sort_keys=True) + "\n")


def load_history(path: pathlib.Path) -> tuple[list[AnyOperation], list[StoredMessage]]:
    operations: list[AnyOperation] = []
    final: list[StoredMessage] = []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        if data["kind"] == "stored":
            del data["kind"]
            final.append(StoredMessage(**data))
        else:
            operations.append(operation_from_json(data))
    return operations, final
