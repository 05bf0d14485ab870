"""The token a client presents to a server that authenticates its clients
(`shardq serve --client-auth kubernetes`): every call carries `authorization: Bearer …`.

In a pod the token is a projected ServiceAccount token issued for the servers' audience
(`shardq` unless the cluster says otherwise), which the kubelet rewrites before it
expires: the file is read again every half minute, so a long-lived client keeps calling
with a current token. `SHARDQ_TOKEN_FILE` names the file for every client in a process
(the CLI, `Client`, `AsyncClient`, the Spark source) that is not given one.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

from shardq.errors import InvalidArgument

TOKEN_FILE_ENV = "SHARDQ_TOKEN_FILE"
AUTHORIZATION_HEADER = "authorization"
# Well inside a projected token's shortest life (10 minutes, rewritten at 80% of it).
REREAD_EVERY_S = 30.0

Metadata = tuple[tuple[str, str], ...]
Stub = TypeVar("Stub")


def _checked(token: str, field: str, where: str) -> str:
    token = token.strip()
    if not token:
        raise InvalidArgument(field, f"{where} holds no token")
    if any(character.isspace() or not character.isprintable() for character in token):
        raise InvalidArgument(field, f"{where} is not one token: it holds spaces or unprintable characters")
    return token


class BearerToken:
    """A token given as text, or read from `path` (again every REREAD_EVERY_S). A token
    that cannot be used raises InvalidArgument naming `field`, where it came from."""

    def __init__(
        self,
        *,
        token: str | None = None,
        path: str | os.PathLike[str] | None = None,
        field: str = "token_file",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (token is None) == (path is None):
            raise InvalidArgument("token", "give a token or a token file, not both")
        self.path = None if path is None else pathlib.Path(path)
        self.field = field
        self.clock = clock
        self._read_at = clock()
        self._metadata = self._metadata_of(_checked(token, "token", "the token") if token is not None else self._read())

    def _read(self) -> str:
        assert self.path is not None
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise InvalidArgument(self.field, f"cannot read the token file {self.path}: {reason}") from None
        return _checked(text, self.field, f"the token file {self.path}")

    @staticmethod
    def _metadata_of(token: str) -> Metadata:
        return ((AUTHORIZATION_HEADER, f"Bearer {token}"),)

    def metadata(self) -> Metadata:
        """What a call carries: the token as last read."""
        if self.path is not None and self.clock() - self._read_at >= REREAD_EVERY_S:
            self._read_at = self.clock()
            # Mid-rewrite or gone for a moment: the last token read serves until it is back.
            with contextlib.suppress(InvalidArgument):
                self._metadata = self._metadata_of(self._read())
        return self._metadata


def bearer_token(token: str | None = None, token_file: str | os.PathLike[str] | None = None) -> BearerToken | None:
    """The token a client was given, or the file SHARDQ_TOKEN_FILE names, or None (calls
    carry no token). Raises InvalidArgument naming a file that cannot be read."""
    if token is not None or token_file is not None:
        return BearerToken(token=token, path=token_file)
    from_environment = os.environ.get(TOKEN_FILE_ENV)
    if from_environment:
        return BearerToken(path=from_environment, field=TOKEN_FILE_ENV)
    return None


class _WithMetadata:
    """A stub whose every call carries `extra` and the token (read at each call)."""

    def __init__(self, stub: Any, token: BearerToken | None, extra: Metadata) -> None:
        self._stub = stub
        self._token = token
        self._extra = extra

    def __getattr__(self, method: str) -> Any:
        metadata = self._extra if self._token is None else self._extra + self._token.metadata()
        return functools.partial(getattr(self._stub, method), metadata=metadata)


def with_token(stub: Stub, token: BearerToken | None, extra: Metadata = ()) -> Stub:
    """`stub` itself without a token or `extra` metadata (its calls unchanged); otherwise
    a stub whose calls carry them. The shardq client passes no metadata of its own, so
    nothing is lost."""
    if token is None and not extra:
        return stub
    wrapped: Any = _WithMetadata(stub, token, extra)
    return wrapped  # type: ignore[no-any-return]
