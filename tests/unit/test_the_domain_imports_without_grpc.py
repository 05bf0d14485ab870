"""The pure domain (and the client's pure modules it uses) import with grpc
unavailable: the import contracts say so, and this proves it at run time, where a
package's __init__ could pull grpc in behind the contracts' back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import sys
    # A module set to None in sys.modules cannot be imported: any `import grpc` fails.
    for name in ("grpc", "lmdb", "kubernetes", "prometheus_client"):
        sys.modules[name] = None
    import shard_server.domain.applying, shard_server.domain.sending, shard_server.domain.receiving
    import shard_server.domain.acknowledging, shard_server.domain.housekeeping, shard_server.domain.validation
    import shardq.queues, shardq.errors, shardq.receipts, shardq.durations
    loaded = sorted(name for name in ("grpc", "lmdb", "kubernetes") if sys.modules.get(name) is not None)
    print(loaded)
    """
)


def test_the_domain_imports_with_grpc_lmdb_and_kubernetes_unavailable() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_top_level_names_still_work() -> None:
    import shardq

    assert shardq.Message(b"x").body == b"x"
    assert shardq.Client.__name__ == "Client"
    assert set(shardq.__all__) <= set(dir(shardq))
