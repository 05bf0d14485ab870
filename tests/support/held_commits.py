"""A shard environment whose LMDB commit of a batch answered before it (written ahead, or a
receive's) can be held, or one written ahead made to fail.

A fault injector: a real commit cannot be timed to stop at the instant after its batch
was answered from the commit-ahead file, nor made to fail on demand. Everything else,
the store, the work, the commit-ahead file and the committer, is the real one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from shard_server.domain.events import Sent
from shard_server.storage.codecs import decode_entry
from shard_server.storage.lmdb_store import LmdbShardTransaction, OpenBatch, ShardEnvironment

T = TypeVar("T")


@dataclass
class HeldCommit:
    """One held commit: `reached` once the writer waits at it, which `release` ends; of a
    batch sending `sending`, when given, written ahead or not as `written_ahead` says."""

    sending: bytes | None = None
    written_ahead: bool = True
    reached: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class HeldCommitEnvironment(ShardEnvironment):
    """A real shard environment whose next LMDB commit of a batch written ahead (or of
    one not written ahead) can be held until released, or made to fail."""

    fail_next_commit = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._next_hold: HeldCommit | None = None

    def hold_next_commit(self, *, sending: bytes | None = None, written_ahead: bool = True) -> HeldCommit:
        """Hold the LMDB commit of the next batch written ahead (its answer goes out
        first), or of the next one sending `sending`: a server may still be committing
        a batch begun before the caller's send (a receive answers before its claim
        commits), and holding that one would hold the send behind it. With
        `written_ahead` False, of the next batch not written ahead instead (a receive's:
        it is answered once its claims are decided, before its commit)."""
        self._next_hold = HeldCommit(sending=sending, written_ahead=written_ahead)
        return self._next_hold

    def _bodies_written_ahead(self, index: int) -> list[bytes]:
        for written in self.committed_ahead():
            entry = decode_entry(written)
            if entry.index == index:
                return [event.record.body for event in entry.events if isinstance(event, Sent)]
        return []

    def begin_batch(
        self,
        work: Callable[[LmdbShardTransaction], T],
        *,
        epoch: int,
        at_ms: int,
        write_ahead_if: Callable[[int], bool] | None = None,
    ) -> OpenBatch[T]:
        batch = super().begin_batch(work, epoch=epoch, at_ms=at_ms, write_ahead_if=write_ahead_if)
        commit = batch.commit
        hold = self._next_hold
        if (
            hold is not None
            and batch.written_ahead == hold.written_ahead
            and (hold.sending is None or hold.sending in self._bodies_written_ahead(batch.index))
        ):
            self._next_hold = None

            def held() -> None:
                hold.reached.set()
                released = hold.released.wait(10)
                commit()  # a test that failed before releasing it must not leave the transaction open
                assert released, "the test never released the commit"

            batch.commit = held  # type: ignore[method-assign]
        elif batch.written_ahead and self.fail_next_commit:
            self.fail_next_commit = False

            def failing() -> None:
                batch._txn.abort()  # LMDB's commit below then fails, as a failed write or sync would
                commit()

            batch.commit = failing  # type: ignore[method-assign]
        return batch
