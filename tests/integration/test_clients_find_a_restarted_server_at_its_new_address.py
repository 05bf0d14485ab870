"""A server that comes back at a new address under the same name is found again within
seconds. A restarted pod gets a new IP while its DNS name stays. gRPC's core looks a name
up again at most every 30 s by default (`grpc.dns_min_time_between_resolutions_ms`). So
on the real node every pod of a rolling update stayed out of its shards' ISRs for
25-28 s: its peers kept dialling the old address. Clients, peers and the Spark source now
set it to 500 ms (`shardq/channel_options.py`).

The client runs in a private mount namespace (`unshare --mount`) where a file of the
test's is bind-mounted over /etc/hosts. The test changes what the name resolves to
without touching the machine's /etc/hosts or any DNS server."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from shardq.grpc_io import COMPLETION_QUEUE_POLLING, ENVIRONMENT_VARIABLE
from tests.support.servers import ServerProcess, wait_for

NAME = "shardq-restarted-server.test"
OLD_ADDRESS, NEW_ADDRESS = "127.0.0.2", "127.0.0.3"
# gRPC's default wait between two lookups of a name is 30 s: a client that finds the new
# address well within that did look the name up again.
FOUND_WITHIN_S = 10.0

CLIENT = r"""
import json, sys, time
from shardq import Client, Message
endpoint, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
with Client(endpoint, route_directly=False) as client:
    while time.monotonic() < until:
        try:
            ok = client.send_messages("orders", [Message(b"x")])[0].ok
        except Exception:
            ok = False
        print(json.dumps({"at": time.monotonic(), "ok": ok}), flush=True)
        time.sleep(0.1)
"""


class ClientInOwnNamespace:
    """The client loop above, resolving names through `hosts` instead of /etc/hosts."""

    def __init__(self, hosts: pathlib.Path, endpoint: str, seconds: float, grpc_experiments: str) -> None:
        unshare = shutil.which("unshare")
        assert unshare, "this test needs util-linux's unshare (and root) for a private /etc/hosts"
        self.answers: list[tuple[float, bool]] = []
        self.process = subprocess.Popen(
            [
                unshare,
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                'mount --bind "$0" /etc/hosts && exec "$1" -c "$2" "$3" "$4"',
                str(hosts),
                sys.executable,
                CLIENT,
                endpoint,
                str(seconds),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, ENVIRONMENT_VARIABLE: grpc_experiments},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            answer = json.loads(line)
            self.answers.append((answer["at"], answer["ok"]))

    def first_success_after(self, moment: float) -> float | None:
        return next((at for at, ok in list(self.answers) if ok and at > moment), None)

    def stop(self) -> str:
        self.process.terminate()
        _, stderr = self.process.communicate(timeout=15)
        return stderr


@pytest.fixture
def server(tmp_path: pathlib.Path) -> Iterator[ServerProcess]:
    process = ServerProcess.in_directory(tmp_path, ["orders:shards=1"])
    process.host = OLD_ADDRESS
    process.start()
    try:
        yield process
    finally:
        process.cleanup()


# Either of gRPC's I/O engines: servers (and so their peer channels) run with socket I/O
# on the completion-queue thread, a library user's client may run with gRPC's default.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("grpc_experiments", ["", COMPLETION_QUEUE_POLLING], ids=["event-engine", "completion-queue"])
def test_a_client_finds_a_restarted_server_at_its_new_address_within_seconds(
    server: ServerProcess, tmp_path: pathlib.Path, grpc_experiments: str
) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{OLD_ADDRESS} {NAME}\n")
    client = ClientInOwnNamespace(hosts, f"{NAME}:{server.port}", seconds=90, grpc_experiments=grpc_experiments)
    try:
        wait_for(lambda: client.first_success_after(0.0), timeout=30, what="the client's first send by name")

        server.stop()
        # Rewritten in place: the bind mount follows the file's inode, not its name.
        with hosts.open("r+") as file:
            file.truncate()
            file.write(f"127.0.0.1 localhost\n{NEW_ADDRESS} {NAME}\n")
        server.host = NEW_ADDRESS
        server.start()
        back = time.monotonic()

        found = wait_for(
            lambda: client.first_success_after(back),
            timeout=FOUND_WITHIN_S,
            what=f"a send to {NAME} at its new address {NEW_ADDRESS}",
        )
    finally:
        stderr = client.stop()
    assert found - back < FOUND_WITHIN_S, stderr
