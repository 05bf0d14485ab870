"""Producers and consumers against a cluster, every call recorded in a History.

The workload runs on its own event loop thread so a test can inject faults from
its main thread. Each worker talks to one endpoint at a time; on NOT_LEADER,
UNAVAILABLE, SHUTTING_DOWN or a timeout it rotates to the next endpoint (the
endpoint list is re-read from a callable, so a restarted cluster on new ports
is picked up). Every call has a deadline: a SIGSTOPped server never hangs a worker.

Bodies are unique ("c{client}-n{i}"); on the standard queue every `dedup_every`-th
message carries a dedup id and some of those are sent again later with the same
id and body; FIFO producers send each group's messages one at a time (each send
waits for its answer, so send order is acknowledgement order) with the body as
dedup id, and retry sends whose outcome is unknown. Consumers receive with a
short visibility timeout and mostly delete; some extend, release, abandon, or
come back late with an old receipt (which must then be refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from shardq import AsyncClient, Message, QueueAttributes, ReceivedMessage
from shardq.api.v1 import export_pb2, export_pb2_grpc
from shardq.bearer_tokens import bearer_token, with_token
from shardq.errors import Reason, ShardqError
from shardq.status import error_from_rpc
from shardq.tls import aio_channel, client_tls
from tests.faults.history import (
    ChangeVisibility,
    Delete,
    Delivery,
    History,
    Invocation,
    Receive,
    Send,
    Status,
    StoredMessage,
    delivery_from_received,
    status_for_reason,
)

T = TypeVar("T")
EndpointSource = Callable[[], Sequence[str]]

# Errors after which another endpoint may do better (OUTCOME_UNKNOWN: the connection
# broke or the leadership was lost under the call, as a killed leader's does).
ROTATE_ON = frozenset({Reason.NOT_LEADER, Reason.UNAVAILABLE, Reason.SHUTTING_DOWN, Reason.OUTCOME_UNKNOWN})
TIMEOUT = "TIMEOUT"
BACKOFF_S = 0.05
BACKOFF_MAX_S = 0.5
# How long the final read tries a shard's export again (see _export_shard).
READ_RETRY_S = 30.0
READ_BACKOFF_S = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadConfig:
    seed: int
    queue: str = "orders"
    fifo_queue: str = "fifo"
    producers: int = 3
    fifo_producers: int = 2
    consumers: int = 3
    fifo_consumers: int = 2
    messages_per_producer: int = 200
    fifo_groups_per_producer: int = 2
    # Producers spread their sends over this long (they stop earlier if told to).
    send_duration_s: float = 40.0
    dedup_every: int = 4
    repeat_dedup_probability: float = 0.3
    visibility_timeout_ms: int = 2_000
    extend_to_ms: int = 3_000
    wait_time_ms: int = 500
    call_timeout_s: float = 3.0
    unknown_send_retries: int = 3
    # False for clients that cannot reach the leaders' addresses (a host outside the
    # pods' network): the endpoint forwards every call.
    route_directly: bool = True


@dataclasses.dataclass
class Stats:
    calls: int = 0
    ok: int = 0
    failed: int = 0
    unknown: int = 0
    rotations: int = 0

    def count(self, status: Status) -> None:
        self.calls += 1
        if status is Status.OK:
            self.ok += 1
        elif status is Status.FAILED:
            self.failed += 1
        else:
            self.unknown += 1


class _Outcome:
    """What a call ended with: a value, or an error reason and whether it is definite."""

    def __init__(self, *, value: object = None, reason: str = "", status: Status = Status.OK) -> None:
        self.value = value
        self.reason = reason
        self.status = status


class Worker:
    """One simulated client: its own connections, endpoint choice and history id."""

    def __init__(self, *, name: str, endpoints: EndpointSource, history: History, config: WorkloadConfig) -> None:
        self.name = name
        self.history = history
        self.config = config
        self.stats = Stats()
        self._endpoints = endpoints
        self._clients: dict[str, AsyncClient] = {}
        self._position = random.Random(f"{config.seed}-{name}").randrange(1 << 16)
        self._preferred = ""
        self._failures = 0

    def _endpoint(self) -> str:
        endpoints = list(self._endpoints())
        if self._preferred in endpoints:
            return self._preferred
        return endpoints[self._position % len(endpoints)]

    def _client(self) -> AsyncClient:
        endpoint = self._endpoint()
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = AsyncClient(endpoint, route_directly=self.config.route_directly)
        return client

    def _rotate(self) -> None:
        """Next endpoint, or the leader a NOT_LEADER answer named if it is one of ours."""
        self.stats.rotations += 1
        if self._preferred and self._preferred in self._endpoints():
            return
        self._preferred = ""
        self._position += 1

    async def close(self) -> None:
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                await client.close()
        self._clients.clear()

    async def call(self, make: Callable[[AsyncClient], Awaitable[T]]) -> _Outcome:
        """Run one call against the current endpoint with a deadline; on an error another
        endpoint may not have, rotate and back off a little (a down cluster is not spun on)."""
        try:
            value = await asyncio.wait_for(make(self._client()), timeout=self.config.call_timeout_s)
        except TimeoutError:
            outcome = _Outcome(reason=TIMEOUT, status=Status.UNKNOWN)
        except ShardqError as error:
            outcome = _Outcome(reason=error.reason.value, status=status_for_reason(error.reason.value))
            if error.reason not in ROTATE_ON:
                return outcome
            self._preferred = error.leader
        except grpc.RpcError as error:
            reason = error_from_rpc(error).reason.value
            outcome = _Outcome(reason=reason, status=status_for_reason(reason))
        else:
            self._failures = 0
            return _Outcome(value=value)
        self._rotate()
        self._failures += 1
        await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_S * self._failures))
        return outcome

    # -- recorded operations ---------------------------------------------------------------------

    async def send(self, queue: str, body: str, *, group_id: str = "", dedup_id: str = "") -> Send:
        invocation = self.history.invoke(self.name)
        message = Message(body.encode(), group_id=group_id, dedup_id=dedup_id)
        outcome = await self.call(lambda c: c.send_messages(queue, [message]))
        common = History.completion(invocation)
        fields: dict[str, Any] = {"queue": queue, "body": body, "group_id": group_id, "dedup_id": dedup_id}
        if outcome.status is Status.OK:
            assert isinstance(outcome.value, list)
            (result,) = outcome.value
            if result.ok:
                send = Send(
                    **common,
                    **fields,
                    status=Status.OK,
                    message_id=result.message_id,
                    duplicate=result.duplicate,
                    shard=result.shard,
                )
            else:
                send = Send(
                    **common, **fields, status=status_for_reason(result.error_reason), error=result.error_reason
                )
        else:
            send = Send(**common, **fields, status=outcome.status, error=outcome.reason)
        self._record(send)
        return send

    async def receive(self, queue: str, *, max_messages: int, visibility_timeout_ms: int) -> list[Delivery]:
        invocation = self.history.invoke(self.name)
        outcome = await self.call(
            lambda c: c.receive_messages(
                queue,
                max_messages=max_messages,
                visibility_timeout_ms=visibility_timeout_ms,
                wait_time_ms=self.config.wait_time_ms,
            )
        )
        common = History.completion(invocation)
        fields: dict[str, Any] = {
            "queue": queue,
            "max_messages": max_messages,
            "visibility_timeout_ms": visibility_timeout_ms,
        }
        deliveries: tuple[Delivery, ...] = ()
        if outcome.status is Status.OK:
            assert isinstance(outcome.value, list)
            deliveries = tuple(_delivery(m) for m in outcome.value)
        self._record(Receive(**common, **fields, status=outcome.status, error=outcome.reason, deliveries=deliveries))
        return list(deliveries)

    async def delete(self, queue: str, deliveries: Sequence[Delivery]) -> list[Delete]:
        if not deliveries:
            return []
        invocation = self.history.invoke(self.name)
        receipts = [d.receipt for d in deliveries]
        outcome = await self.call(lambda c: c.delete_messages(queue, receipts))
        deletes = [
            Delete(
                **common,
                queue=queue,
                status=status,
                error=error,
                receipt=delivery.receipt,
                message_id=delivery.message_id,
            )
            for delivery, (common, status, error) in zip(
                deliveries, self._entries(invocation, outcome, len(deliveries)), strict=True
            )
        ]
        self._record(*deletes)
        return deletes

    async def change_visibility(self, queue: str, changes: Sequence[tuple[Delivery, int]]) -> list[ChangeVisibility]:
        if not changes:
            return []
        invocation = self.history.invoke(self.name)
        pairs = [(d.receipt, timeout) for d, timeout in changes]
        outcome = await self.call(lambda c: c.change_visibility(queue, pairs))
        records = [
            ChangeVisibility(
                **common,
                queue=queue,
                status=status,
                error=error,
                receipt=delivery.receipt,
                message_id=delivery.message_id,
                visibility_timeout_ms=timeout,
            )
            for (delivery, timeout), (common, status, error) in zip(
                changes, self._entries(invocation, outcome, len(changes)), strict=True
            )
        ]
        self._record(*records)
        return records

    @staticmethod
    def _entries(invocation: Invocation, outcome: _Outcome, count: int) -> list[tuple[dict[str, Any], Status, str]]:
        common = History.completion(invocation)
        if outcome.status is not Status.OK:
            return [(common, outcome.status, outcome.reason)] * count
        assert isinstance(outcome.value, list)
        return [
            (common, Status.OK, "") if entry.ok else (common, status_for_reason(entry.reason), entry.reason)
            for entry in outcome.value
        ]

    def _record(self, *operations: Send | Receive | Delete | ChangeVisibility) -> None:
        for operation in operations:
            self.stats.count(operation.status)
        self.history.append(*operations)


def _delivery(message: ReceivedMessage) -> Delivery:
    return delivery_from_received(
        message_id=message.message_id,
        body=message.body,
        group_id=message.group_id,
        dedup_id=message.dedup_id,
        receipt=message.receipt,
        shard=message.shard,
        seq=message.seq,
        receive_count=message.receive_count,
        visible_until_ms=message.visible_until_ms,
    )


# -- roles -------------------------------------------------------------------------------------


class Workload:
    """Producers and consumers on a private event loop thread: start(), then stop_producing()/stop()."""

    def __init__(self, *, endpoints: EndpointSource, history: History, config: WorkloadConfig) -> None:
        self.endpoints = endpoints
        self.history = history
        self.config = config
        self.workers: list[Worker] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._stop_producing = threading.Event()
        self._thread: threading.Thread | None = None
        self.producers_done = threading.Event()

    def _worker(self, name: str) -> Worker:
        worker = Worker(name=name, endpoints=self.endpoints, history=self.history, config=self.config)
        self.workers.append(worker)
        return worker

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fault-workload", daemon=True)
        self._thread.start()

    def stop_producing(self) -> None:
        """Producers finish their current send and end; consumers go on."""
        self._stop_producing.set()

    def ok_operations(self) -> int:
        return sum(worker.stats.ok for worker in self.workers)

    def stop(self, *, timeout: float = 30.0) -> None:
        """Stop producers and consumers; in-flight calls finish or time out first."""
        self._stop_producing.set()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise AssertionError(f"workload did not stop within {timeout}s")
        if self.errors:
            raise AssertionError(f"workload crashed: {self.errors!r}") from self.errors[0]

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # reported by stop()
            self.errors.append(error)

    async def _main(self) -> None:
        config = self.config
        producers = [self._produce(self._worker(f"p{i}"), i) for i in range(config.producers)]
        producers += [self._produce_fifo(self._worker(f"f{i}"), i) for i in range(config.fifo_producers)]
        consumers = [self._consume(self._worker(f"c{i}"), config.queue, i) for i in range(config.consumers)]
        consumers += [
            self._consume(self._worker(f"fc{i}"), config.fifo_queue, 100 + i) for i in range(config.fifo_consumers)
        ]

        async def produce_all() -> None:
            await asyncio.gather(*producers)
            self.producers_done.set()

        try:
            await asyncio.gather(produce_all(), *consumers)
        finally:
            for worker in self.workers:
                await worker.close()

    def _stopping(self) -> bool:
        return self._stop.is_set()

    async def _pace(self, rng: random.Random) -> None:
        pause = self.config.send_duration_s / max(1, self.config.messages_per_producer)
        await asyncio.sleep(rng.uniform(0.5 * pause, 1.5 * pause))

    async def _send_retrying(self, worker: Worker, queue: str, body: str, *, group_id: str, dedup_id: str) -> None:
        for _ in range(1 + self.config.unknown_send_retries):
            send = await worker.send(queue, body, group_id=group_id, dedup_id=dedup_id)
            # Only a dedup id makes a retry of an unknown send safe.
            if send.status is not Status.UNKNOWN or not dedup_id or self._stop_producing.is_set():
                return

    async def _produce(self, worker: Worker, index: int) -> None:
        config = self.config
        rng = random.Random(f"{config.seed}-produce-{index}")
        repeats: list[tuple[str, str]] = []
        for i in range(config.messages_per_producer):
            if self._stop_producing.is_set():
                return
            body = f"c{worker.name}-n{i}"
            dedup_id = f"d-{body}" if i % config.dedup_every == 0 else ""
            await self._send_retrying(worker, config.queue, body, group_id="", dedup_id=dedup_id)
            if dedup_id and rng.random() < config.repeat_dedup_probability:
                repeats.append((body, dedup_id))
            if repeats and rng.random() < 0.2:
                repeat_body, repeat_dedup = repeats.pop(0)
                await worker.send(config.queue, repeat_body, dedup_id=repeat_dedup)
            await self._pace(rng)

    async def _produce_fifo(self, worker: Worker, index: int) -> None:
        config = self.config
        rng = random.Random(f"{config.seed}-fifo-{index}")
        groups = [f"{worker.name}-g{j}" for j in range(config.fifo_groups_per_producer)]
        for i in range(config.messages_per_producer):
            if self._stop_producing.is_set():
                return
            group = groups[i % len(groups)]
            body = f"c{worker.name}-{group}-n{i}"
            await self._send_retrying(worker, config.fifo_queue, body, group_id=group, dedup_id=body)
            if rng.random() < 0.05:
                # A repeat of an earlier message of the group: must return its id.
                await worker.send(config.fifo_queue, body, group_id=group, dedup_id=body)
            await self._pace(rng)

    async def _consume(self, worker: Worker, queue: str, index: int) -> None:
        config = self.config
        rng = random.Random(f"{config.seed}-consume-{index}")
        abandoned: list[Delivery] = []
        while not self._stopping():
            deliveries = await worker.receive(queue, max_messages=5, visibility_timeout_ms=config.visibility_timeout_ms)
            to_delete: list[Delivery] = []
            to_extend: list[Delivery] = []
            to_release: list[Delivery] = []
            late: list[Delivery] = []
            for delivery in deliveries:
                roll = rng.random()
                if roll < 0.70:
                    to_delete.append(delivery)
                elif roll < 0.80:
                    to_extend.append(delivery)
                elif roll < 0.85:
                    to_release.append(delivery)
                elif roll < 0.90:
                    abandoned.append(delivery)
                else:
                    late.append(delivery)
            await worker.delete(queue, to_delete)
            if to_extend:
                changed = await worker.change_visibility(queue, [(d, config.extend_to_ms) for d in to_extend])
                await worker.delete(queue, [d for d, c in zip(to_extend, changed, strict=True) if c.ok])
            await worker.change_visibility(queue, [(d, 0) for d in to_release])
            if late:
                # Processing that overruns the lease now and then: the delete may be refused.
                await asyncio.sleep(rng.uniform(0, 1.5 * config.visibility_timeout_ms / 1000))
                await worker.delete(queue, late)
            now_ms = time.time_ns() // 1_000_000
            expired = [d for d in abandoned if d.visible_until_ms + 500 < now_ms]
            if expired:
                # An old receipt after its deadline: must be refused, whoever holds the message now.
                abandoned = [d for d in abandoned if d not in expired]
                await worker.delete(queue, expired)

    # -- after the faults --------------------------------------------------------------------

    def drain(self, queues: Sequence[str], *, timeout: float = 60.0, quiet_rounds: int = 3) -> None:
        """Receive and delete until every queue is empty (recorded as client "drain")."""
        asyncio.run(self._drain(queues, timeout=timeout, quiet_rounds=quiet_rounds))

    async def _drain(self, queues: Sequence[str], *, timeout: float, quiet_rounds: int) -> None:
        worker = self._worker("drain")
        deadline = time.monotonic() + timeout
        try:
            for queue in queues:
                quiet = 0
                while quiet < quiet_rounds:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"drain of {queue} did not finish within {timeout}s")
                    deliveries = await worker.receive(queue, max_messages=10, visibility_timeout_ms=5_000)
                    if deliveries:
                        quiet = 0
                        await worker.delete(queue, deliveries)
                        continue
                    outcome = await worker.call(functools.partial(_attributes, queue=queue))
                    attributes = outcome.value
                    empty = (
                        isinstance(attributes, QueueAttributes)
                        and attributes.complete  # a shard left out of the counts may hold messages
                        and attributes.visible + attributes.in_flight + attributes.delayed == 0
                    )
                    quiet = quiet + 1 if empty else 0
        finally:
            await worker.close()


async def _attributes(client: AsyncClient, *, queue: str) -> QueueAttributes:
    return await client.attributes(queue)


def read_stored(endpoints: Sequence[str], queues: Sequence[str], *, timeout: float = 10.0) -> list[StoredMessage]:
    """Everything still stored, by export of every shard from its leader (as DescribeQueue names it)."""
    return asyncio.run(_read_stored(endpoints, queues, timeout=timeout))


async def _read_stored(endpoints: Sequence[str], queues: Sequence[str], *, timeout: float) -> list[StoredMessage]:
    stored: list[StoredMessage] = []
    for queue in queues:
        routes = None
        for endpoint in endpoints:
            async with AsyncClient(endpoint) as client:
                with contextlib.suppress(ShardqError, TimeoutError):
                    routes = await asyncio.wait_for(client.describe(queue), timeout)
            if routes is not None:
                break
        if routes is None:
            raise AssertionError(f"no server could describe {queue}")
        for route in routes:
            candidates = [route.leader_address, *[e for e in endpoints if e != route.leader_address]]
            stored += await _export_shard(candidates, queue, route.shard, timeout=timeout)
    return stored


async def _export_shard(candidates: Sequence[str], queue: str, shard: int, *, timeout: float) -> list[StoredMessage]:
    """The shard's messages, exported from whichever candidate leads it. A leader answers
    UNAVAILABLE ("retry") while its latest writes are not yet on every in-sync replica,
    as right after a leadership move, and a move can make another server the leader
    after DescribeQueue named one: as the Spark source does, such a read is tried again,
    for up to READ_RETRY_S, before the run is failed."""
    deadline = time.monotonic() + READ_RETRY_S
    while True:
        failures: list[str] = []  # the last round's, for the report
        for endpoint in candidates:
            if not endpoint:
                continue
            try:
                return await _export_from(endpoint, queue, shard, timeout=timeout)
            except (grpc.RpcError, TimeoutError) as error:
                failures.append(f"{endpoint}: {error!r}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"could not export {queue} shard {shard} for {READ_RETRY_S} s: {failures}")
        await asyncio.sleep(READ_BACKOFF_S)


async def _export_from(endpoint: str, queue: str, shard: int, *, timeout: float) -> list[StoredMessage]:
    # TLS and a token as every shardq client finds them (SHARDQ_CA_FILE, SHARDQ_TOKEN_FILE):
    # none for the local clusters, the Secret's CA and a token for the real node's.
    async with aio_channel(endpoint, client_tls()) as channel:
        stub = with_token(export_pb2_grpc.ExportServiceStub(channel), bearer_token())
        request = export_pb2.ExportMessagesRequest(queue=queue, shard=shard, include_body=True)
        messages: list[StoredMessage] = []
        async with asyncio.timeout(timeout):
            async for batch in stub.ExportMessages(request):
                messages += [
                    StoredMessage(queue, m.message_id, m.body.decode(errors="replace"), m.group_id, m.dedup_id)
                    for m in batch.messages
                ]
        return messages
