"""The `shardq` command (`python -m shardq`, and the console script)."""

from __future__ import annotations

import os

from shardq.grpc_io import use_completion_queue_polling


def main() -> None:
    # Before the command's modules import gRPC, which reads its settings once, at import.
    use_completion_queue_polling()
    # gRPC's C core logs each failed TLS handshake on stderr at INFO: seven lines before a
    # command's one-line error. Errors only, unless the user asks for more (servers log
    # a peer whose certificate fails themselves, runtime.serving_tls).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from shardq.cli import main as run_command

    run_command()


if __name__ == "__main__":
    main()
