"""Sizes in bytes as people write them ("4096", "64KiB", "1.5GiB"), read one way for queue
settings such as `maxMessageBytes` and for `shardq serve --map-size`."""

from __future__ import annotations

import decimal
import re

from shardq.durations import shown_briefly

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40
# Every unit is binary, however it is spelled: queue settings always read "1MB" as 1048576 bytes.
_UNITS = {
    "": 1,
    "b": 1,
    **dict.fromkeys(("k", "ki", "kib", "kb"), KIB),
    **dict.fromkeys(("m", "mi", "mib", "mb"), MIB),
    **dict.fromkeys(("g", "gi", "gib", "gb"), GIB),
    **dict.fromkeys(("t", "ti", "tib", "tb"), TIB),
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)", re.IGNORECASE)
# Sizes travel as int64, and an LMDB map is sized by a 64-bit size_t.
MAX_SIZE_BYTES = 2**63 - 1


class NotASize(ValueError):
    """The text is not written as a size; each caller says in its own words what it takes."""


def parse_size(text: str) -> decimal.Decimal:
    """The exact number of bytes `text` states, which may be a fraction of a byte ("1.3k"):
    callers decide whether to refuse one or round it down. Raise NotASize for text that is
    not a size, ValueError for one above MAX_SIZE_BYTES."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or match.group(2).lower() not in _UNITS:
        raise NotASize(f"not a size: {shown_briefly(text)}")
    number = decimal.Decimal(match.group(1))
    unit = _UNITS[match.group(2).lower()]
    # Decimal, not float: "9007199254740993" stays itself, and "4.000000000000000001k" is not
    # taken for a whole 4096 bytes. The context holds every digit of the product (and any
    # exponent), so nothing is rounded however many digits a caller sends.
    exact = decimal.Context(
        prec=len(match.group(1)) + len(str(unit)),
        Emax=decimal.MAX_EMAX,
        Emin=decimal.MIN_EMIN,
        traps=[decimal.Inexact],
    )
    size = exact.multiply(number, unit)
    if size > MAX_SIZE_BYTES:
        raise ValueError(f"size {shown_briefly(text)} is too large: at most {MAX_SIZE_BYTES} bytes")
    return size
