"""Consumer programs for tests to run as real processes (and send real signals):
`python -c SCRIPT endpoint started-file queue concurrency handler-seconds`. Each handler
writes its message's body to the started file first, then takes handler-seconds; at
the end the program prints `handled N, cut off M` (run_consumer's stats)."""

from __future__ import annotations

import textwrap

ASYNC_CONSUMER = textwrap.dedent(
    """
    import asyncio, pathlib, sys
    from shardq import AsyncClient, run_consumer

    endpoint, started, queue = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
    concurrency, seconds = int(sys.argv[4]), float(sys.argv[5])

    async def handler(message):
        with started.open("a") as log:
            log.write(message.body.decode() + "\\n")
        await asyncio.sleep(seconds)

    async def main():
        async with AsyncClient(endpoint) as client:
            stats = await run_consumer(client, queue, handler, concurrency=concurrency, visibility_timeout_ms=120_000)
        print(f"handled {stats.handled}, cut off {stats.cut_off}")

    asyncio.run(main())
    """
)

# The same with the blocking Client and a handler that runs in a thread.
BLOCKING_CONSUMER = textwrap.dedent(
    """
    import pathlib, sys, time
    from shardq import Client

    endpoint, started, queue = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
    concurrency, seconds = int(sys.argv[4]), float(sys.argv[5])

    def handler(message):
        with started.open("a") as log:
            log.write(message.body.decode() + "\\n")
        time.sleep(seconds)

    with Client(endpoint) as client:
        stats = client.run_consumer(queue, handler, concurrency=concurrency, visibility_timeout_ms=120_000)
    print(f"handled {stats.handled}, cut off {stats.cut_off}")
    """
)
