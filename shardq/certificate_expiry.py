"""When a served certificate (a server's, or the operator's metrics port's) expires: its
`notAfter`, read from the PEM.

Python's `ssl` loads a certificate without saying its dates (only a private function
does), and the image has no X.509 library, so this reads the few DER fields in
front of the validity (RFC 5280, 4.1): Certificate ::= SEQUENCE { tbsCertificate
SEQUENCE { [0] version OPTIONAL, serialNumber, signature, issuer, validity SEQUENCE {
notBefore, notAfter }, ... }, ... }. A certificate that does not read so gives None: the
metric is left out, nothing else depends on it.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import re

_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)
_SEQUENCE = 0x30
_VERSION = 0xA0  # [0] EXPLICIT, present from X.509 v2 on
_UTC_TIME = 0x17
_GENERALIZED_TIME = 0x18


class _NotDer(ValueError):
    pass


def _element(der: bytes, at: int) -> tuple[int, int, int]:
    """The tag, the start and the end of the content of the DER element at `at`."""
    if at + 2 > len(der):
        raise _NotDer("truncated")
    tag, length = der[at], der[at + 1]
    start = at + 2
    if length & 0x80:
        size = length & 0x7F
        if size == 0 or size > 4 or start + size > len(der):
            raise _NotDer("a length DER does not allow")
        length = int.from_bytes(der[start : start + size], "big")
        start += size
    end = start + length
    if end > len(der):
        raise _NotDer("truncated")
    return tag, start, end


def _children(der: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    found = []
    at = start
    while at < end:
        tag, content_start, content_end = _element(der, at)
        found.append((tag, content_start, content_end))
        at = content_end
    return found


def _seconds(tag: int, text: str) -> float:
    """A UTCTime (YYMMDDHHMMSSZ: years 1950-2049) or GeneralizedTime (YYYYMMDDHHMMSSZ),
    as RFC 5280 requires them, in Unix seconds."""
    if not text.endswith("Z"):
        raise _NotDer("a time not in UTC")
    digits = text[:-1]
    if tag == _UTC_TIME and len(digits) == 12:
        year = int(digits[:2])
        year += 1900 if year >= 50 else 2000
        rest = digits[2:]
    elif tag == _GENERALIZED_TIME and len(digits) == 14:
        year, rest = int(digits[:4]), digits[4:]
    else:
        raise _NotDer("not a certificate time")
    if not rest.isdigit():
        raise _NotDer("not a certificate time")
    month, day, hour, minute, second = (int(rest[i : i + 2]) for i in range(0, 10, 2))
    if not (1 <= month <= 12 and 1 <= day <= 31 and hour <= 23 and minute <= 59 and second <= 60):
        raise _NotDer("not a certificate time")
    return float(calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)))


def not_after_of_der(der: bytes) -> float:
    """The notAfter of a DER certificate in Unix seconds; ValueError if it does not read."""
    tag, start, end = _element(der, 0)
    if tag != _SEQUENCE:
        raise _NotDer("not a certificate")
    tag, start, end = _element(der, start)
    if tag != _SEQUENCE:
        raise _NotDer("no tbsCertificate")
    fields = _children(der, start, end)
    if fields and fields[0][0] == _VERSION:
        fields = fields[1:]
    if len(fields) < 4 or fields[3][0] != _SEQUENCE:
        raise _NotDer("no validity")
    _, validity_start, validity_end = fields[3]
    times = _children(der, validity_start, validity_end)
    if len(times) != 2:
        raise _NotDer("no notAfter")
    tag, start, end = times[1]
    try:
        text = der[start:end].decode("ascii")
    except UnicodeDecodeError:
        raise _NotDer("not a certificate time") from None
    return _seconds(tag, text)


def not_after(cert_chain_pem: bytes) -> float | None:
    """When the first certificate of a PEM chain (the one presented) expires, in Unix
    seconds; None when there is none or it does not read."""
    found = _PEM_CERTIFICATE.search(cert_chain_pem)
    if found is None:
        return None
    try:
        return not_after_of_der(base64.b64decode(b"".join(found.group(1).split()), validate=True))
    except (ValueError, binascii.Error):
        return None
