"""A server (or the operator's metrics port) loading a certificate that has expired
(clients and peers will refuse it) or expires within 14 days says so in its log, at start
and at each renewal it loads; a certificate further from its end, and the start-up check
of the files, say nothing."""

from __future__ import annotations

import datetime
import logging
import pathlib
import shutil

import pytest

from e2e.certificates import ServingCertificates, issue_serving_certificates
from shard_server.runtime.serving_tls import TlsFiles, check_tls_files
from shardq.serving_certificates import ServingCertificate

LOGGER = "shardq.serving_certificates"


def issued(directory: pathlib.Path, stem: str, validity: datetime.timedelta) -> ServingCertificates:
    return issue_serving_certificates(directory, dns_names=["localhost"], stem=stem, validity=validity)


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(record.levelno, record.getMessage()) for record in caplog.records if record.name == LOGGER]


def test_a_certificate_far_from_its_end_is_not_mentioned(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    certificates = issued(tmp_path, "far", datetime.timedelta(days=60))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ServingCertificate(certificates.cert, certificates.key)
    assert said(caplog) == []


def test_one_expiring_within_two_weeks_is_a_warning_naming_the_file_and_the_day(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    certificates = issued(tmp_path, "soon", datetime.timedelta(days=3))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ServingCertificate(certificates.cert, certificates.key)
    ((level, message),) = said(caplog)
    assert level == logging.WARNING
    day = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3)).strftime("%Y-%m-%d")
    assert f"the TLS certificate in {certificates.cert} expires at {day}" in message
    assert "in 3.0 days; renew it" in message


def test_an_expired_one_is_an_error_saying_clients_refuse_it(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    certificates = issued(tmp_path, "gone", datetime.timedelta(minutes=-1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ServingCertificate(certificates.cert, certificates.key)
    ((level, message),) = said(caplog)
    assert level == logging.ERROR
    assert f"the TLS certificate in {certificates.cert} expired at " in message
    assert "clients and peers refuse it" in message


def test_a_renewal_that_is_loaded_is_judged_again(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    far = issued(tmp_path, "far", datetime.timedelta(days=60))
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(far.cert, cert)
    shutil.copy(far.key, key)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        certificate = ServingCertificate(cert, key)
        assert said(caplog) == []
        soon = issued(tmp_path, "soon", datetime.timedelta(days=2))
        shutil.copy(soon.cert, cert)
        shutil.copy(soon.key, key)
        certificate.ssl_context()  # a new connection loads the changed files
    levels = [level for level, _ in said(caplog)]
    assert levels == [logging.INFO, logging.WARNING], said(caplog)


def test_the_start_up_check_of_the_files_says_nothing(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    # The CLI checks the files before logging is set up; the server that then loads them
    # says it once, formatted.
    certificates = issued(tmp_path, "soon", datetime.timedelta(days=1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        check_tls_files(TlsFiles(cert=certificates.cert, key=certificates.key))
    assert said(caplog) == []
