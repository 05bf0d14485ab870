"""What a client says when its server restarts or dies: calls made while a server comes
up succeed, a receipt operation cut off mid-call is OUTCOME_UNKNOWN (it may have been
applied), and a dead server leaves no asyncio noise behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from shardq import Client, Message
from shardq.errors import OutcomeUnknown
from tests.support.servers import ServerProcess, wait_in_flight

QUEUE = "orders-dlq"


def test_a_client_made_while_the_server_restarts_does_not_fail(server: ServerProcess) -> None:
    server.stop()
    assert server.process is not None
    with server.log_path.open("ab") as log:
        # Not waiting for it: the client's first calls race its start.
        server.process = subprocess.Popen(server.command(), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    with Client(server.endpoint) as client:
        assert client.attributes(QUEUE).queue == QUEUE
        (sent,) = client.send_messages(QUEUE, [Message(b"after the restart")])
        assert sent.ok


def test_a_delete_cut_off_mid_call_is_outcome_unknown(server: ServerProcess) -> None:
    with Client(server.endpoint) as client:
        client.send_messages(QUEUE, [Message(b"x")])
        (message,) = client.receive_messages(QUEUE, max_messages=1, visibility_timeout_ms=60_000)
        wait_in_flight(client, QUEUE, 1)
        os.kill(server.pid, signal.SIGSTOP)  # the delete reaches a server that cannot answer
        errors: list[BaseException] = []

        def delete() -> None:
            try:
                client.delete_messages(QUEUE, [message.receipt])
            except BaseException as error:
                errors.append(error)

        deleting = threading.Thread(target=delete)
        deleting.start()
        deleting.join(timeout=1.0)
        assert deleting.is_alive(), "the delete should be waiting for the stopped server"
        server.kill()  # the connection drops with the call in flight
        deleting.join(timeout=30)
        (error,) = errors
        assert isinstance(error, OutcomeUnknown), repr(error)


NOISY_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from shardq import Client, Message
    client = Client(sys.argv[1])
    client.send(sys.argv[2], b"streamed")
    client.send_messages(sys.argv[2], [Message(b"unary")])
    os.kill(int(sys.argv[3]), signal.SIGKILL)
    for call in (lambda: client.send(sys.argv[2], b"z"), lambda: client.receive_messages(sys.argv[2])):
        try:
            call()
        except Exception as error:
            print(type(error).__name__)
    client.close()
    """
)


@pytest.mark.timeout(120)
def test_a_dead_server_leaves_no_asyncio_noise(server: ServerProcess) -> None:
    done = subprocess.run(
        [sys.executable, "-c", NOISY_SCRIPT, server.endpoint, "orders", str(server.pid)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Unavailable", "Unavailable"]
    assert "Task was destroyed" not in done.stderr
    assert "Exception ignored" not in done.stderr
    assert done.stderr.strip() == ""
