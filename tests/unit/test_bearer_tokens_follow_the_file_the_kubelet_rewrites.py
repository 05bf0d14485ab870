"""The client's token: given as text or read from a file, read again as the kubelet
rewrites a projected token, and refused clearly when it cannot be used."""

from __future__ import annotations

import pathlib

import pytest

from shardq.bearer_tokens import REREAD_EVERY_S, TOKEN_FILE_ENV, BearerToken, bearer_token, with_token
from shardq.errors import InvalidArgument


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_token_file_is_read_again_once_its_reading_is_old(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    clock = Clock()
    token = BearerToken(path=path, clock=clock)
    assert token.metadata() == (("authorization", "Bearer first"),)
    path.write_text("second")
    clock.now = REREAD_EVERY_S - 1
    assert token.metadata() == (("authorization", "Bearer first"),)
    clock.now = REREAD_EVERY_S
    assert token.metadata() == (("authorization", "Bearer second"),)


def test_a_file_gone_for_a_moment_leaves_the_last_token_in_use(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "token"
    path.write_text("first")
    clock = Clock()
    token = BearerToken(path=path, clock=clock)
    path.unlink()
    clock.now = REREAD_EVERY_S
    assert token.metadata() == (("authorization", "Bearer first"),)
    path.write_text("third")
    clock.now = 2 * REREAD_EVERY_S
    assert token.metadata() == (("authorization", "Bearer third"),)


@pytest.mark.parametrize(
    ("content", "words"), [("", "holds no token"), ("two words", "not one token"), ("tab\tinside", "not one token")]
)
def test_a_file_that_holds_no_single_token_is_refused_naming_it(
    tmp_path: pathlib.Path, content: str, words: str
) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(InvalidArgument, match=words) as refused:
        BearerToken(path=path)
    assert str(path) in refused.value.message
    assert refused.value.field == "token_file"


def test_shardq_token_file_is_used_when_no_token_is_given(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    assert bearer_token() is None
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(InvalidArgument, match="cannot read the token file") as refused:
        bearer_token()
    assert refused.value.field == TOKEN_FILE_ENV
    (tmp_path / "missing").write_text("from-env")
    found = bearer_token()
    assert found is not None
    assert found.metadata() == (("authorization", "Bearer from-env"),)
    # Given explicitly, a token wins over the environment.
    given = bearer_token("given")
    assert given is not None
    assert given.metadata() == (("authorization", "Bearer given"),)
    with pytest.raises(InvalidArgument, match="not both"):
        bearer_token("given", tmp_path / "missing")


def test_a_stub_with_a_token_adds_it_to_every_call_and_without_one_is_left_alone() -> None:
    class Stub:
        def SendMessages(self, request: object, **kwargs: object) -> dict[str, object]:
            return {"request": request, **kwargs}

    stub = Stub()
    assert with_token(stub, None) is stub
    wrapped = with_token(stub, BearerToken(token="abc"))
    assert wrapped.SendMessages("r", timeout=5) == {
        "request": "r",
        "timeout": 5,
        "metadata": (("authorization", "Bearer abc"),),
    }
    # The operator's calls carry the cluster's peer secret instead, or beside a token.
    peer = (("shardq-peer-secret", "s" * 32),)
    assert with_token(stub, None, peer).SendMessages("r")["metadata"] == peer
    both = with_token(stub, BearerToken(token="abc"), peer).SendMessages("r")["metadata"]
    assert both == (*peer, ("authorization", "Bearer abc"))
