"""`kubectl logs`, `kubectl exec` and `kubectl port-forward` reach a real pod: the API
server talks to the kubelet over its serving certificate."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from e2e.polling import wait_for
from e2e.realnode import RunningNode
from e2e.shard_workloads import GRPC_PORT, create_shard_servers
from shardq import Client, Message

pytestmark = [pytest.mark.realnode, pytest.mark.timeout(300)]


def test_logs_exec_and_port_forward(real_node: RunningNode, node_namespace: str) -> None:
    info = real_node.info
    with info.api_client() as api:
        create_shard_servers(
            api, node_namespace, name="shard", image=info.shardq_image, replicas=1, queue="orders:shards=1"
        )

    def kubectl(*args: str) -> str:
        command = info.kubectl_command("--namespace", node_namespace, *args)
        result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "shardq: listening on 0.0.0.0:7600" in kubectl("logs", "shard-0")
    assert kubectl(
        "exec", "shard-0", "--", "python3", "-c", "import shardq, sys; print(sys.version_info[:2])"
    ).strip() == ("(3, 11)")

    forward = subprocess.Popen(
        info.kubectl_command("--namespace", node_namespace, "port-forward", "pod/shard-0", f":{GRPC_PORT}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert forward.stdout is not None
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline and "Forwarding from 127.0.0.1" not in line:
            line = forward.stdout.readline()
        match = re.search(r"127\.0\.0\.1:(\d+) -> 7600", line)
        assert match, f"no forwarding line from kubectl port-forward: {line!r}"
        endpoint = f"127.0.0.1:{match.group(1)}"

        def sent_through_forward() -> str | None:
            with Client(endpoint) as forwarded:
                return forwarded.send_messages("orders", [Message(b"through port-forward")])[0].message_id

        message_id = wait_for(sent_through_forward, timeout=30, what="a send through port-forward", interval=0.5)
        with Client(endpoint) as forwarded:
            received = forwarded.receive_messages("orders", max_messages=1, wait_time_ms=2_000)
        assert [m.message_id for m in received] == [message_id]
    finally:
        forward.terminate()
        forward.communicate(timeout=10)
