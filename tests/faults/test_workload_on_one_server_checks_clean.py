"""The workload and checker against one real standalone server, killed and restarted
mid-run: a correct server must produce a history with no violations. This keeps the
checker honest (no false positives on real timings) while the cluster is not there."""

from __future__ import annotations

import pathlib

import pytest

from tests.faults.checking import QueueSpec, check_history, format_violations
from tests.faults.history import History, dump_history
from tests.faults.workload import Workload, WorkloadConfig, read_stored
from tests.support.servers import ServerFactory, wait_for

QUEUES = (QueueSpec("orders"), QueueSpec("fifo", fifo=True))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2])
def test_workload_through_a_restart_checks_clean(
    server_factory: ServerFactory, tmp_path: pathlib.Path, seed: int
) -> None:
    server = server_factory("orders:shards=4", "fifo:fifo=true,shards=2")
    history = History()
    config = WorkloadConfig(seed=seed, messages_per_producer=60, send_duration_s=8.0)
    workload = Workload(endpoints=lambda: [server.endpoint], history=history, config=config)
    workload.start()
    try:
        wait_for(lambda: len(history) > 200, timeout=20, what="traffic before the fault")
        server.kill()
        server.restart()
        assert workload.producers_done.wait(timeout=60), "producers did not finish"
    finally:
        workload.stop()
    workload.drain([q.name for q in QUEUES])
    final = read_stored([server.endpoint], [q.name for q in QUEUES])
    dump_history(history.operations(), tmp_path / "history.jsonl", final=final)
    operations = history.operations()
    assert sum(o.ok for o in operations) > 300, "the workload should have done real work"
    violations = check_history(operations, final=final, queues=QUEUES)
    assert not violations, f"history in {tmp_path / 'history.jsonl'}\n" + format_violations(violations)
