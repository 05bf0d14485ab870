"""The `shardq` command (`python -m shardq`, and the console script)."""

from __future__ import annotations

from shardq.grpc_io import use_completion_queue_polling


def main() -> None:
    # Before the command's modules import gRPC, which reads its settings once, at import.
    use_completion_queue_polling()
    from shardq.cli import main as run_command

    run_command()


if __name__ == "__main__":
    main()
