"""Who counts as a peer: the cluster's shared secret, carried on every call between servers.

A server started with a peer secret answers replication calls (Append, Snapshot,
GetReplicaStatus) and calls marked as forwarded by another server only when they carry
the same secret; anyone else gets UNAUTHENTICATED with reason NOT_A_PEER. Without it
every caller was trusted as a peer: a client could append entries to a follower's log,
or set the reserved `shardq.*` attributes by marking its send as forwarded.

A server without a secret (a standalone server, or a cluster started by hand without
one) still trusts every caller, as before. `shardq local` always gives its servers one,
and the operator does when it has a key (the chart makes one). The secret travels as
call metadata, like a bearer token: anyone who can read the traffic between servers can
read it.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import pathlib
import re
import secrets
from collections.abc import Iterable

PEER_SECRET_HEADER = "shardq-peer-secret"
MIN_SECRET_CHARACTERS = 32
# gRPC metadata values are printable ASCII; a space would be lost to trimming.
_SECRET = re.compile(r"[\x21-\x7e]+")


@dataclasses.dataclass(frozen=True, slots=True)
class PeerCredential:
    """The secret a server's peers present, or None when every caller counts as a peer."""

    secret: str | None = dataclasses.field(default=None, repr=False)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What a call to a peer carries: nothing when there is no secret."""
        return () if self.secret is None else ((PEER_SECRET_HEADER, self.secret),)

    def admits(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Whether a call with this metadata comes from a peer (compared in constant time)."""
        if self.secret is None:
            return True
        expected = self.secret.encode()
        return any(
            key == PEER_SECRET_HEADER and isinstance(value, str) and hmac.compare_digest(value.encode(), expected)
            for key, value in metadata or ()
        )


NO_PEER_SECRET = PeerCredential()


def new_peer_secret() -> str:
    """A fresh secret: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def parse_peer_secret(text: str) -> PeerCredential:
    """The credential in a secret file's text (surrounding whitespace dropped); raises
    ValueError naming what is wrong with it, never quoting the secret."""
    secret = text.strip()
    if not _SECRET.fullmatch(secret):
        raise ValueError("a peer secret is printable ASCII without spaces (gRPC metadata carries it)")
    if len(secret) < MIN_SECRET_CHARACTERS:
        raise ValueError(f"a peer secret has at least {MIN_SECRET_CHARACTERS} characters, this one {len(secret)}")
    return PeerCredential(secret)


def read_peer_secret(path: pathlib.Path) -> PeerCredential:
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: a peer secret is printable ASCII without spaces") from None
    except OSError as error:
        raise ValueError(f"cannot read the peer secret {path}: {error.strerror}") from None
    try:
        return parse_peer_secret(text)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def write_peer_secret(path: pathlib.Path, secret: str) -> pathlib.Path:
    """Write `secret` readable by its owner only, atomically."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="ascii") as file:
        file.write(secret + "\n")
    os.replace(scratch, path)
    return path


__all__ = [
    "MIN_SECRET_CHARACTERS",
    "NO_PEER_SECRET",
    "PEER_SECRET_HEADER",
    "PeerCredential",
    "new_peer_secret",
    "parse_peer_secret",
    "read_peer_secret",
    "write_peer_secret",
]
