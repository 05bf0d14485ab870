"""Which TLS a client speaks (shardq.tls.client_tls): what it is given, else what the
environment says, else plaintext; and settings that cannot work are refused by name."""

from __future__ import annotations

import pathlib

import pytest

from e2e.certificates import issue_serving_certificates
from shardq.errors import InvalidArgument
from shardq.tls import CA_FILE_ENV, SERVER_NAME_ENV, TLS_ENV, ClientTls, client_tls


@pytest.fixture
def ca(tmp_path: pathlib.Path) -> pathlib.Path:
    return issue_serving_certificates(tmp_path, dns_names=["localhost"]).ca


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (CA_FILE_ENV, TLS_ENV, SERVER_NAME_ENV):
        monkeypatch.delenv(name, raising=False)


def test_without_settings_or_environment_the_client_speaks_plaintext() -> None:
    assert client_tls() is None
    assert client_tls(False) is None


def test_given_settings_win_over_the_environment(ca: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CA_FILE_ENV, str(ca))
    given = ClientTls(root_certificates=None, server_name="given.example")
    assert client_tls(given) is given
    assert client_tls(False) is None  # plaintext, whatever the environment says
    assert client_tls(True) == ClientTls()
    assert client_tls(ca_file=ca, server_name="named.example") == ClientTls(ca.read_bytes(), "named.example")


def test_the_environment_turns_tls_on_when_nothing_is_given(ca: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TLS_ENV, "true")
    assert client_tls() == ClientTls()
    monkeypatch.setenv(SERVER_NAME_ENV, "shardq.example")
    assert client_tls() == ClientTls(server_name="shardq.example")
    monkeypatch.setenv(CA_FILE_ENV, str(ca))  # a CA file is more than the system's roots
    assert client_tls() == ClientTls(ca.read_bytes(), "shardq.example")
    monkeypatch.setenv(TLS_ENV, "0")
    monkeypatch.delenv(CA_FILE_ENV)
    assert client_tls() is None  # a server name alone turns nothing on


def test_settings_that_cannot_work_are_refused_by_name(
    ca: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = next(tmp_path.glob("server.key"))
    with pytest.raises(InvalidArgument, match=r"ca_file: the CA file .* holds no PEM certificate"):
        client_tls(ca_file=key)
    with pytest.raises(InvalidArgument, match=r"ca_file: cannot read the CA file .*: No such file"):
        client_tls(ca_file=tmp_path / "absent.crt")
    with pytest.raises(InvalidArgument, match="a CA file is for TLS, and tls is False"):
        client_tls(False, ca_file=ca)
    with pytest.raises(InvalidArgument, match="give TLS settings or a CA file, not both"):
        client_tls(ClientTls(), ca_file=ca)
    with pytest.raises(InvalidArgument, match="a TLS server name needs TLS"):
        client_tls(server_name="alone.example")
    monkeypatch.setenv(CA_FILE_ENV, str(tmp_path / "absent.crt"))
    with pytest.raises(InvalidArgument, match=f"{CA_FILE_ENV}: cannot read the CA file"):
        client_tls()
