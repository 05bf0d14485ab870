"""The expiry a TLS server reports (shardq_tls_certificate_expiration_timestamp_seconds)
is read from the PEM it serves without an X.509 library: checked here against
cryptography's reading of certificates made by cryptography, with both time encodings
RFC 5280 uses, both key types a Secret holds, chains, and files that are not
certificates."""

from __future__ import annotations

import base64
import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from shardq.certificate_expiry import not_after

KeyType = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def certificate(expires: datetime.datetime, key: KeyType, *, long_names: bool = False) -> x509.Certificate:
    # A name long enough pushes the tbsCertificate's length past 255 (a two-byte length).
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ("x" * 60) if long_names else "shardq")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(expires)
    )
    if long_names:
        sans = [x509.DNSName(f"server-{n}.shardq-peers.namespace.svc.cluster.local") for n in range(20)]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(key, hashes.SHA256())


def pem(*certificates: x509.Certificate) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certificates)


EC_KEY = ec.generate_private_key(ec.SECP256R1())


@pytest.mark.parametrize(
    "expires",
    [
        # UTCTime (two-digit years, up to 2049)...
        datetime.datetime(2031, 5, 6, 7, 8, 9, tzinfo=datetime.UTC),
        datetime.datetime(2049, 12, 31, 23, 59, 59, tzinfo=datetime.UTC),
        # ...and GeneralizedTime from 2050 on.
        datetime.datetime(2050, 1, 1, 0, 0, 0, tzinfo=datetime.UTC),
        datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC),
    ],
)
def test_the_not_after_is_read_in_either_time_encoding(expires: datetime.datetime) -> None:
    made = certificate(expires, EC_KEY)
    assert made.not_valid_after_utc == expires
    assert not_after(pem(made)) == expires.timestamp()


def test_an_rsa_certificate_with_long_lengths_reads_alike() -> None:
    expires = datetime.datetime(2027, 3, 4, 5, 6, 7, tzinfo=datetime.UTC)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    made = certificate(expires, key, long_names=True)
    assert len(made.tbs_certificate_bytes) > 255
    assert not_after(pem(made)) == expires.timestamp()


def test_a_chain_gives_the_first_certificate_the_one_presented() -> None:
    leaf = certificate(datetime.datetime(2027, 1, 1, tzinfo=datetime.UTC), EC_KEY)
    issuer = certificate(datetime.datetime(2036, 1, 1, tzinfo=datetime.UTC), EC_KEY)
    assert not_after(b"leading text\n" + pem(leaf, issuer)) == leaf.not_valid_after_utc.timestamp()


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"not a certificate at all",
        b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
        b"-----BEGIN CERTIFICATE-----\nMAMCAQE=\n-----END CERTIFICATE-----\n",  # SEQUENCE { INTEGER 1 }
        b"-----BEGIN PRIVATE KEY-----\nMAMCAQE=\n-----END PRIVATE KEY-----\n",
    ],
)
def test_what_is_not_a_certificate_gives_no_date(text: bytes) -> None:
    assert not_after(text) is None


def test_a_truncated_certificate_gives_no_date() -> None:
    der = certificate(datetime.datetime(2027, 1, 1, tzinfo=datetime.UTC), EC_KEY).public_bytes(
        serialization.Encoding.DER
    )
    for cut in (1, 2, 40, 120, len(der) - 1):
        body = base64.b64encode(der[:cut])
        assert not_after(b"-----BEGIN CERTIFICATE-----\n" + body + b"\n-----END CERTIFICATE-----\n") is None, cut


@pytest.mark.parametrize(
    "impostor",
    # Month 13, day 0, hour 25, no Z, a letter: each as long as the real notAfter, so the
    # DER around it still reads.
    [b"311306070809Z", b"310500070809Z", b"310506250809Z", b"3105060708090", b"31050607080aZ"],
)
def test_a_not_after_that_is_no_time_gives_no_date(impostor: bytes) -> None:
    made = certificate(datetime.datetime(2031, 5, 6, 7, 8, 9, tzinfo=datetime.UTC), EC_KEY)
    der = made.public_bytes(serialization.Encoding.DER)
    assert der.count(b"310506070809Z") == 1
    body = base64.b64encode(der.replace(b"310506070809Z", impostor))
    assert not_after(b"-----BEGIN CERTIFICATE-----\n" + body + b"\n-----END CERTIFICATE-----\n") is None
