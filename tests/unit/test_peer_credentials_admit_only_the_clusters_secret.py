"""The peer secret: who it admits, and which files it refuses, saying why without quoting it."""

from __future__ import annotations

import pathlib
import stat

import pytest

from shardq.coordination.peer_credentials import (
    NO_PEER_SECRET,
    PEER_SECRET_HEADER,
    new_peer_secret,
    parse_peer_secret,
    read_peer_secret,
    write_peer_secret,
)

SECRET = "s3cr3t-" * 6


def test_without_a_secret_every_caller_is_a_peer_and_calls_carry_nothing() -> None:
    assert NO_PEER_SECRET.metadata == ()
    assert NO_PEER_SECRET.admits(None)
    assert NO_PEER_SECRET.admits([("anything", "else")])


def test_a_secret_admits_exactly_the_calls_that_carry_it() -> None:
    credential = parse_peer_secret(SECRET)
    assert credential.metadata == ((PEER_SECRET_HEADER, SECRET),)
    assert credential.admits([("x-other", "1"), (PEER_SECRET_HEADER, SECRET)])
    assert not credential.admits(None)
    assert not credential.admits([])
    assert not credential.admits([(PEER_SECRET_HEADER, SECRET[:-1])])
    assert not credential.admits([(PEER_SECRET_HEADER, SECRET + "x")])
    assert not credential.admits([(PEER_SECRET_HEADER, SECRET.encode())])  # a binary header is not it
    assert not credential.admits([("x-" + PEER_SECRET_HEADER, SECRET)])
    assert SECRET not in repr(credential)


def test_new_secrets_differ_and_are_usable() -> None:
    first, second = new_peer_secret(), new_peer_secret()
    assert first != second
    assert parse_peer_secret(first).secret == first


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "printable ASCII without spaces"),
        ("short", "at least 32 characters, this one 5"),
        ("a secret with spaces that is long enough anyway", "printable ASCII without spaces"),
        ("tab\tseparated-but-long-enough-to-pass-the-length", "printable ASCII without spaces"),
        ("é" * 40, "printable ASCII without spaces"),
    ],
)
def test_an_unusable_secret_is_refused_naming_the_problem_not_the_secret(text: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint) as refused:
        parse_peer_secret(text)
    assert not text or text not in str(refused.value)


def test_a_secret_file_is_owner_only_and_read_back_without_its_newline(tmp_path: pathlib.Path) -> None:
    path = write_peer_secret(tmp_path / "peer-secret", SECRET)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == SECRET + "\n"
    assert read_peer_secret(path).secret == SECRET


def test_a_missing_or_binary_file_is_refused_naming_the_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=f"cannot read the peer secret {tmp_path / 'absent'}"):
        read_peer_secret(tmp_path / "absent")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff" * 40)
    with pytest.raises(ValueError, match=f"{binary}: a peer secret is printable ASCII"):
        read_peer_secret(binary)
