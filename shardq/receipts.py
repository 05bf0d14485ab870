"""Receipt handles: opaque to users, self-checking, and enough to reject stale ones.

A receipt names the claim it came from: (queue, shard, seq, epoch, claim token).
The server accepts it only while that exact claim is the message's current one
and its deadline has not passed; the checksum turns typos and truncation into
MALFORMED_RECEIPT instead of a confusing STALE_RECEIPT.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import struct
import zlib

_VERSION = 1
# version, queue fingerprint, shard, seq, epoch, claim token
_LAYOUT = struct.Struct(">BIHQQQ")
_CHECK = struct.Struct(">I")
_ENCODED_LENGTH = len(base64.urlsafe_b64encode(b"\0" * (_LAYOUT.size + _CHECK.size)))


_FROM_URLSAFE = bytes.maketrans(b"-_", b"+/")
_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")


class MalformedReceipt(ValueError):
    pass


@dataclasses.dataclass(slots=True)  # not frozen: built per message, and frozen ones cost ~4x to build
class Receipt:
    queue_fingerprint: int
    shard: int
    seq: int
    epoch: int
    claim_token: int


def queue_fingerprint(queue: str) -> int:
    return zlib.crc32(queue.encode())


def encode_receipt(receipt: Receipt) -> str:
    payload = _LAYOUT.pack(
        _VERSION, receipt.queue_fingerprint, receipt.shard, receipt.seq, receipt.epoch, receipt.claim_token
    )
    # What base64.urlsafe_b64encode does, without its wrappers (hot path: once per claimed message).
    encoded = binascii.b2a_base64(payload + _CHECK.pack(zlib.crc32(payload)), newline=False)
    return encoded.translate(_TO_URLSAFE).decode()


def decode_receipt(text: str) -> Receipt:
    if len(text) != _ENCODED_LENGTH:
        raise MalformedReceipt(f"receipt has length {len(text)}, expected {_ENCODED_LENGTH}")
    try:
        # What base64.urlsafe_b64decode does, without its wrappers (hot path).
        raw = binascii.a2b_base64(text.encode("ascii").translate(_FROM_URLSAFE))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise MalformedReceipt("receipt is not base64url") from None
    if len(raw) != _LAYOUT.size + _CHECK.size:
        raise MalformedReceipt("receipt has the wrong length")
    payload, check = raw[: _LAYOUT.size], raw[_LAYOUT.size :]
    if _CHECK.unpack(check)[0] != zlib.crc32(payload):
        raise MalformedReceipt("receipt checksum does not match")
    version, fingerprint, shard, seq, epoch, token = _LAYOUT.unpack(payload)
    if version != _VERSION:
        raise MalformedReceipt(f"receipt version {version} is not supported")
    return Receipt(fingerprint, shard, seq, epoch, token)
