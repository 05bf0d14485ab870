"""Run `python -m shardq ...` under cProfile in every thread, not only the main one.

`python -m cProfile` sees only the main thread, but the server commits (LMDB
write transactions and fsync) on one writer thread per shard. This wrapper gives
each thread its own profiler and, when the server exits (SIGTERM shuts it down
gracefully), writes two pstats files: OUT with every thread merged, and
OUT.threads with the non-main threads only.

Usage: python bench/profiled_server.py OUT.prof serve --data-dir ... (arguments of `shardq`)
"""

from __future__ import annotations

import cProfile
import pstats
import runpy
import sys
import threading
from typing import Any


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, shardq_args = argv[0], argv[1:]
    thread_profiles: list[cProfile.Profile] = []
    registry_lock = threading.Lock()
    original_run = threading.Thread.run

    def profiled_run(thread: threading.Thread) -> None:
        profile = cProfile.Profile()
        with registry_lock:
            thread_profiles.append(profile)
        profile.enable()
        try:
            original_run(thread)
        finally:
            profile.disable()

    threading.Thread.run = profiled_run  # type: ignore[method-assign,assignment]  # deliberate: profile every new thread
    main_profile = cProfile.Profile()
    sys.argv = ["shardq", *shardq_args]
    exit_code: Any = 0
    main_profile.enable()
    try:
        runpy.run_module("shardq", run_name="__main__", alter_sys=True)
    except SystemExit as exit_request:
        exit_code = exit_request.code
    finally:
        main_profile.disable()
        with registry_lock:
            finished = list(thread_profiles)
        everything = pstats.Stats(main_profile)
        if finished:
            threads_only = pstats.Stats(finished[0])
            for profile in finished[1:]:
                threads_only.add(profile)
            threads_only.dump_stats(out + ".threads")
            everything.add(threads_only)
        everything.dump_stats(out)
    return exit_code if isinstance(exit_code, int) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
