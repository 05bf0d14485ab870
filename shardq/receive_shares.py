"""Shared short polls: several receivers' receives in one request.

A client folding concurrent receives (wait 0) sends their max_messages as the
request's `shares`; the server claims each share as a receive of its own would,
in order and in one commit, and answers every share's messages in order with
`share_counts` saying how many are whose. Client and server (forwarding to another
leader) read the answer the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from shardq.api.v1 import queue_pb2
from shardq.errors import Reason, ShardqError

T = TypeVar("T")


def split_shares(response: queue_pb2.ReceiveMessagesResponse, messages: Sequence[T], shares: int) -> list[list[T]]:
    """`messages` (the response's, as protos or as the caller converted them) by share, in
    the order the shares were asked."""
    counts = list(response.share_counts)
    if len(counts) != shares or sum(counts) != len(messages):
        raise ShardqError(
            Reason.UNAVAILABLE,
            f"a shared receive of {shares} shares was answered with share counts {counts} for {len(messages)} messages",
        )
    parts: list[list[T]] = []
    start = 0
    for count in counts:
        parts.append(list(messages[start : start + count]))
        start += count
    return parts
