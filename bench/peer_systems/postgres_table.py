"""PostgreSQL as a queue the way pgmq does it: pgmq's own SQL on a pgmq-shaped table.

pgmq (the Postgres extension behind Supabase Queues) is the common way to run an
SQS-like queue in Postgres, but Debian does not ship it, so this runs pgmq's statements
directly, as prepared statements, on a table created the way `pgmq.create` creates one:

- table `pgmq.q_<queue>`: msg_id identity primary key (pgmq's; older pgmq used
  bigserial, the same sequence-backed bigint), read_ct, enqueued_at, vt (the visibility
  timestamp) and message, plus pgmq's index on vt. One difference: message is bytea, not
  jsonb, because the bodies are opaque bytes (jsonb would add parsing and validation cost
  pgmq's users would pay; the notes say so). pgmq's archive table, headers column and
  meta row are left out: nothing here uses them.
- send = pgmq.send's INSERT ... RETURNING msg_id; a send of ten = pgmq.send_batch's one
  INSERT ... SELECT unnest($1) (one statement, one commit, ten rows).
- receive = pgmq.read's CTE: the oldest visible msg_ids, FOR UPDATE SKIP LOCKED (so
  concurrent readers do not wait on each other's rows), then an UPDATE pushing vt out
  30 s and counting the read, RETURNING the rows. The handle is msg_id.
- delete = pgmq.delete's DELETE ... WHERE msg_id = $1 RETURNING msg_id, awaited.

pgmq runs these inside plpgsql functions via EXECUTE format(...), re-planned each call;
prepared statements skip that, so this is if anything a little kinder to Postgres than
pgmq itself.

What it runs: Debian's PostgreSQL 15 server binaries (not the Debian cluster wrapper, and
not the package's own cluster, which is left as it is) as a child process on a free
127.0.0.1 port, with a fresh cluster (initdb) under workdir. Postgres refuses to run as
root, so when this runs as root both initdb and the server run as the `postgres` system
user: initdb via runuser, the server via setpriv, which execs in place so that the PID
this process holds is the postmaster's own and can be signalled directly. fsync and
synchronous_commit stay at their defaults (on): each statement is its own transaction
(autocommit), and its commit record is fsynced to the WAL before the answer comes back.
Auth is trust on 127.0.0.1, the only address it listens on. A workdir used before keeps
its cluster and queue (no second initdb), messages included.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import sql

from peer_systems import (
    STOP_WAIT_S,
    VISIBILITY_TIMEOUT_S,
    PeerQueue,
    Running,
    child_process,
    free_port,
    wait_for_port,
)

NAME = "postgres"

BIN = pathlib.Path("/usr/lib/postgresql/15/bin")
SYSTEM_USER = "postgres"
DB_USER = "postgres"
DATABASE = "postgres"
START_TIMEOUT_S = 60.0
# Connections the harness may open at once (one per caller plus setup); Postgres's
# default of 100 could be the limit rather than the server's speed.
MAX_CONNECTIONS = 300
# pgmq's rule for queue names (it builds table names from them).
QUEUE_NAME = re.compile(r"[A-Za-z0-9_]{1,47}")

# pgmq.create's table and index (pgmq/pgmq-extension/sql/pgmq.sql), message as bytea.
CREATE = """
CREATE SCHEMA IF NOT EXISTS pgmq;
CREATE TABLE IF NOT EXISTS pgmq.{table} (
    msg_id BIGINT PRIMARY KEY GENERATED ALWAYS AS IDENTITY,
    read_ct INT DEFAULT 0 NOT NULL,
    enqueued_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL,
    vt TIMESTAMP WITH TIME ZONE NOT NULL,
    message BYTEA
);
CREATE INDEX IF NOT EXISTS {index} ON pgmq.{table} (vt ASC);
"""

# pgmq.send with delay 0.
SEND = """
INSERT INTO pgmq.{table} (vt, message)
VALUES ((clock_timestamp() + interval '0 seconds'), %s)
RETURNING msg_id
"""

# pgmq.send_batch with delay 0: one INSERT of as many rows as the array holds.
SEND_BATCH = """
INSERT INTO pgmq.{table} (vt, message)
SELECT clock_timestamp() + interval '0 seconds', unnest(%s::bytea[])
RETURNING msg_id
"""

# pgmq.read(queue, vt => VISIBILITY_TIMEOUT_S, qty => $1), without the optional jsonb
# filter (it needs a jsonb message and this workload does not filter).
READ = """
WITH cte AS
    (
        SELECT msg_id
        FROM pgmq.{table}
        WHERE vt <= clock_timestamp()
        ORDER BY msg_id ASC
        LIMIT %s
        FOR UPDATE SKIP LOCKED
    )
UPDATE pgmq.{table} m
SET
    vt = clock_timestamp() + {vt},
    read_ct = read_ct + 1
FROM cte
WHERE m.msg_id = cte.msg_id
RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.vt, m.message
"""

# pgmq.delete(queue, msg_id).
DELETE = """
DELETE FROM pgmq.{table}
WHERE msg_id = %s
RETURNING msg_id
"""


class TableQueue:
    """One caller's view: a connection of its own, in autocommit (each statement commits)."""

    def __init__(self, connection: psycopg.AsyncConnection[Any], statements: dict[str, bytes]) -> None:
        self._connection = connection
        self._send = statements["send"]
        self._send_batch = statements["send_batch"]
        self._read = statements["read"]
        self._delete = statements["delete"]

    async def send(self, bodies: Sequence[bytes]) -> None:
        # prepare=True: parsed and planned once per connection, then only bound and run.
        if len(bodies) == 1:
            await self._connection.execute(self._send, (bodies[0],), prepare=True)
        else:
            await self._connection.execute(self._send_batch, (list(bodies),), prepare=True)

    async def receive(self, max_messages: int) -> list[Any]:
        cursor = await self._connection.execute(self._read, (max_messages,), prepare=True)
        return [row[0] for row in await cursor.fetchall()]

    async def delete(self, handle: Any) -> None:
        await self._connection.execute(self._delete, (handle,), prepare=True)

    async def close(self) -> None:
        await self._connection.close()


def _as_server_user(command: list[str], *, stay: bool) -> list[str]:
    """`command` as the postgres system user when running as root (Postgres refuses root).
    stay=True when the PID must be the server's own: setpriv execs in place, where runuser
    forks a child and waits for it."""
    if os.geteuid() != 0:
        return command
    if stay:
        return ["setpriv", f"--reuid={SYSTEM_USER}", f"--regid={SYSTEM_USER}", "--init-groups", "--", *command]
    return ["runuser", "-u", SYSTEM_USER, "--", *command]


def _give_to_server_user(path: pathlib.Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, SYSTEM_USER, SYSTEM_USER)
        # The server user must reach it: every directory above it must be searchable.
        probe = subprocess.run(
            _as_server_user(["test", "-w", str(path), "-a", "-x", str(path)], stay=False), check=False
        )
        if probe.returncode != 0:
            raise PermissionError(f"the {SYSTEM_USER} user cannot reach {path}: make its parents searchable")


def _initdb(datadir: pathlib.Path, log: pathlib.Path) -> None:
    with open(log, "ab") as output:
        subprocess.run(
            _as_server_user(
                [
                    str(BIN / "initdb"),
                    "--pgdata",
                    str(datadir),
                    "--auth=trust",
                    f"--username={DB_USER}",
                    "--encoding=UTF8",
                    "--locale=C",
                ],
                stay=False,
            ),
            stdout=output,
            stderr=subprocess.STDOUT,
            check=True,
        )


def _connect_when_ready(conninfo: str, process: subprocess.Popen[bytes]) -> psycopg.Connection[Any]:
    """The port opens before the server accepts sessions ("the database system is starting
    up"), so retry until it does."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return psycopg.connect(conninfo, autocommit=True)
        except psycopg.OperationalError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _fast_shutdown(process: subprocess.Popen[bytes]) -> None:
    """SIGINT is Postgres's fast shutdown: disconnect sessions, checkpoint, exit. The
    SIGTERM child_process sends is smart shutdown, which waits for every client to leave
    and, if they do not, ends in SIGKILL, which leaves backends behind for a moment."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_WAIT_S)


@contextlib.contextmanager
def running(workdir: pathlib.Path, queue: str) -> Iterator[Running]:
    if not QUEUE_NAME.fullmatch(queue):
        raise ValueError(f"queue name {queue!r}: pgmq allows letters, digits and _ (at most 47)")
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    home = workdir / "postgres"
    home.mkdir(exist_ok=True)
    _give_to_server_user(home)
    datadir = home / "data"
    sockets = home / "sockets"
    sockets.mkdir(exist_ok=True)
    _give_to_server_user(sockets)
    log = workdir / "postgres.log"

    # A workdir used before keeps its cluster (and queue table): initdb only a new one.
    if not (datadir / "PG_VERSION").exists():
        _initdb(datadir, log)

    port = free_port()
    command = _as_server_user(
        [
            str(BIN / "postgres"),
            "-D",
            str(datadir),
            "-p",
            str(port),
            "-c",
            "listen_addresses=127.0.0.1",
            # The socket would otherwise go to /var/run/postgresql, outside workdir.
            "-c",
            f"unix_socket_directories={sockets}",
            "-c",
            f"max_connections={MAX_CONNECTIONS}",
            # Stated rather than assumed: these are the defaults, and the durability claim.
            "-c",
            "fsync=on",
            "-c",
            "synchronous_commit=on",
        ],
        stay=True,
    )
    with child_process(command, log=str(log)) as server:
        try:
            wait_for_port(port, process=server, timeout_s=START_TIMEOUT_S, what="postgres")
            conninfo = f"host=127.0.0.1 port={port} user={DB_USER} dbname={DATABASE}"
            table = sql.Identifier(f"q_{queue}")
            names = {"table": table}
            with _connect_when_ready(conninfo, server) as admin:
                admin.execute(sql.SQL(CREATE).format(index=sql.Identifier(f"q_{queue}_vt_idx"), **names))
                row = admin.execute("SHOW server_version").fetchone()
                version = str(row[0]) if row else "15"
                # Rendered once to bytes: the same query text each call, so each
                # connection's prepared statement is found by it.
                statements = {
                    "send": sql.SQL(SEND).format(**names).as_bytes(admin),
                    "send_batch": sql.SQL(SEND_BATCH).format(**names).as_bytes(admin),
                    "read": sql.SQL(READ)
                    .format(vt=sql.Literal(f"{VISIBILITY_TIMEOUT_S} seconds") + sql.SQL("::interval"), **names)
                    .as_bytes(admin),
                    "delete": sql.SQL(DELETE).format(**names).as_bytes(admin),
                }
            callers = itertools.count(1)

            async def connect() -> PeerQueue:
                connection = await psycopg.AsyncConnection.connect(
                    conninfo, autocommit=True, application_name=f"caller-{next(callers)}"
                )
                return TableQueue(connection, statements)

            yield Running(
                name=NAME,
                version=f"PostgreSQL {version}",
                durability=(
                    "fsync=on, synchronous_commit=on (defaults), autocommit: every statement's commit "
                    "is fsynced to the WAL before it is acknowledged"
                ),
                pids=[server.pid],
                connect=connect,
                notes=(
                    "pgmq's SQL (send, send_batch, read, delete) as prepared statements on a pgmq-shaped "
                    "table, not the pgmq extension (Debian does not ship it); message is bytea, not pgmq's "
                    "jsonb. A send of ten is one INSERT ... SELECT unnest (pgmq.send_batch). Delete is a real "
                    "DELETE (no archive). One connection per caller."
                ),
            )
        finally:
            _fast_shutdown(server)
