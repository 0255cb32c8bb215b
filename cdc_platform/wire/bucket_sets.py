"""A set of buckets on the wire (docs/wire-contract.md "Snapshot requests" and the repair
meta): the bucket numbers at ``bits`` as a JSON/msgpack list (``buckets``), or as a bitmap
(``bucket_bitmap``) when the list would be long.

``bucket_bitmap`` is standard base64 (RFC 4648 section 4, with padding) of
``max(1, 2^bits / 8)`` bytes: bucket ``b`` is bit ``7 - b % 8`` (most significant first) of
byte ``b // 8``; the bits past ``2^bits`` (``bits`` < 3) are zero; at least one bit is set. At
14 bits it is 2,048 bytes, 2,732 characters: any set of the 16,384 buckets fits a 4,096-byte
request body, where a list holds ~620 of them.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable

from cdc_platform.wire.digest import MAX_BUCKET_BITS

BUCKET_BITMAP_FIELD = "bucket_bitmap"
# A repair meta lists its buckets (``buckets``) up to this many, past it it carries the bitmap
# instead: a union at 20 bits may hold 262,144 buckets (~1.3 MB as a list, over NATS'
# default max_payload; 175 KB as a bitmap). Every repair of at most 14 bits is listed.
META_MAX_LISTED_BUCKETS = 1 << MAX_BUCKET_BITS


def bucket_bitmap_bytes(bits: int) -> int:
    """The length in bytes of a bitmap of the ``2^bits`` buckets at ``bits``."""
    return max(1, (1 << bits) // 8)


def encode_bucket_bitmap(bits: int, buckets: Iterable[int]) -> str:
    """``bucket_bitmap`` of ``buckets`` (numbers below ``2^bits``)."""
    bitmap = bytearray(bucket_bitmap_bytes(bits))
    for bucket in buckets:
        if not 0 <= bucket < 1 << bits:
            raise ValueError(f"bucket {bucket} is not below 2^{bits}")
        bitmap[bucket >> 3] |= 0x80 >> (bucket & 7)
    return base64.b64encode(bitmap).decode("ascii")


def decode_bucket_bitmap(bits: int, text: object) -> tuple[int, ...]:
    """The buckets (sorted) ``bucket_bitmap`` ``text`` sets at ``bits``; ValueError saying
    what is wrong when it is not one."""
    expected = bucket_bitmap_bytes(bits)
    if not isinstance(text, str):
        raise ValueError(  # noqa: TRY004 - one error type for every bad bitmap (callers catch it)
            "bucket_bitmap must be a base64 string")
    try:
        bitmap = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("bucket_bitmap is not base64 (RFC 4648, with padding)") from None
    if len(bitmap) != expected:
        raise ValueError(f"bucket_bitmap holds {len(bitmap):,} bytes, {expected:,} at "
                         f"{bits} bits")
    if base64.b64encode(bitmap).decode("ascii") != text:  # (unused trailing bits set)
        raise ValueError("bucket_bitmap is not canonical base64")
    buckets = tuple(index * 8 + offset for index, byte in enumerate(bitmap) if byte
                    for offset in range(8) if byte & (0x80 >> offset))
    if not buckets:
        raise ValueError("bucket_bitmap sets no bucket")
    if buckets[-1] >= 1 << bits:
        raise ValueError(f"bucket_bitmap sets bits past the 2^{bits} buckets")
    return buckets
