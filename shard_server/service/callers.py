"""Whether a client call may go on (shared by the queue and export servicers)."""

from __future__ import annotations

from collections.abc import Iterable

from shard_server.domain.client_access import Verb
from shard_server.runtime.client_access import ClientAccess
from shardq.coordination.peer_credentials import PeerCredential


async def admit(
    access: ClientAccess,
    credential: PeerCredential,
    metadata: Iterable[tuple[str, str | bytes]] | None,
    verbs: tuple[Verb, ...],
    queue: str,
) -> None:
    """Returns when the call may go on; raises Unauthenticated or PermissionDenied.
    Servicers call it only when `access.enforced`, so an open server pays nothing.
    The cluster's servers (forwarding a client's call they admitted themselves) and its
    operator or supervisor carry the peer secret instead of a token."""
    if credential.secret is not None and credential.admits(metadata):
        return
    await access.require(metadata, verbs, queue)
