"""The table digest (docs/verification.md): an order-independent, additive digest of a set of
rows over their wire values, that the source, a mirror applying changes and a mirror reading
its own file all compute alike, in any language.

- **Row bytes.** The row's non-NULL columns, sorted by the UTF-8 bytes of their names, each
  written as ``u32 name length, name, value``; a value is a tag byte and its bytes:
  ``I`` + u32 length + signed decimal ASCII (int; bool as ``0``/``1``), ``F`` + 8 bytes
  IEEE-754 binary64 big-endian (every NaN as ``7FF8000000000000``; -0.0 and ±inf as they
  are), ``S`` + u32 length + UTF-8 (str), ``B`` + u32 length + bytes (bytes), ``A`` + u32
  count + the elements (a list; a NULL element is ``N``). Every u32 is big-endian.
- **Row hash.** The first 8 bytes of SHA-256 of the row bytes, as a big-endian unsigned int.
- **Key hash.** The same over the key columns only (the primary key; a table without one:
  every column), so a row's bucket depends on its key alone.
- **Bucket.** The top ``bits`` bits of the key hash: bucket ``b`` at ``bits`` splits into
  ``2b`` and ``2b + 1`` at ``bits + 1``, so a repair can bisect.
- **Bucket digest.** The sum of the bucket's row hashes modulo 2^64, and its row count: a row
  is added or removed in O(1), in any order.

Pure: no I/O, no state beyond the objects here.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_platform.speedups import compiled_twin

ALGORITHM = "cdc-digest-1"  # a digest message's ``algorithm``: this module; a new one, a new name
HASH_BITS = 64
_MASK = (1 << HASH_BITS) - 1
# a table's buckets: the fewest bits that leave at most ROWS_PER_BUCKET rows in a bucket on
# average, at most MAX_BUCKET_BITS (16,384 buckets: a digest message stays far below NATS's
# 1 MB max_payload; a larger table has larger buckets and a repair bisects them)
ROWS_PER_BUCKET = 1024
MAX_BUCKET_BITS = 14
MAX_HELD_BITS = 20  # the most buckets a TableDigest holds in memory (a repair refining buckets)

_u32 = struct.Struct(">I").pack
_f64 = struct.Struct(">d").pack
_NAN_BITS = b"\x7f\xf8\x00\x00\x00\x00\x00\x00"
_NAN = b"F" + _NAN_BITS
_TRUE = b"I\x00\x00\x00\x011"
_FALSE = b"I\x00\x00\x00\x010"
_NULL_ELEMENT = b"N"


def _int(value: int) -> bytes:
    text = str(int(value)).encode("ascii")
    return b"I" + _u32(len(text)) + text


def _float(value: float) -> bytes:
    return _NAN if math.isnan(value) else b"F" + _f64(value)


def _str(value: str) -> bytes:
    encoded = value.encode("utf-8")
    return b"S" + _u32(len(encoded)) + encoded


def _bytes(value: bytes | bytearray | memoryview) -> bytes:
    data = bytes(value)
    return b"B" + _u32(len(data)) + data


def _array(value: Sequence[Any]) -> bytes:
    parts = [b"A", _u32(len(value))]
    append = parts.append
    for item in value:
        if item is None:
            append(_NULL_ELEMENT)
        else:
            encode = _ENCODERS.get(type(item))
            append(encode(item) if encode is not None else value_bytes(item))
    return b"".join(parts)


def _bool(value: bool) -> bytes:
    return _TRUE if value else _FALSE


# by exact type first (the common case, one dict look-up); subclasses go through isinstance
_ENCODERS: dict[type, Callable[[Any], bytes]] = {int: _int, float: _float, str: _str, bytes: _bytes,
                              bool: _bool, list: _array, tuple: _array,
                              bytearray: _bytes, memoryview: _bytes}


def value_bytes(value: Any) -> bytes:
    """The canonical bytes of one non-NULL wire value (tag and payload); TypeError for a value
    that is not a wire value."""
    encode = _ENCODERS.get(type(value))
    if encode is not None:
        return encode(value)
    for kind in (bool, int, float, str, bytes, bytearray, memoryview, list, tuple):
        if isinstance(value, kind):
            return _ENCODERS[kind](value)
    raise TypeError(f"not a wire value: {type(value).__name__}")


def _name_prefix(name: str) -> bytes:
    encoded = name.encode("utf-8")
    return _u32(len(encoded)) + encoded


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def _utf8(name: str) -> bytes:
    return name.encode("utf-8")


def row_bytes(row: Mapping[str, Any]) -> bytes:
    """The canonical bytes of a row map holding every column (NULL: None)."""
    return b"".join(_name_prefix(name) + value_bytes(row[name])
                    for name in sorted(row, key=_utf8) if row[name] is not None)


def row_hash(row: Mapping[str, Any]) -> int:
    """The row's 64-bit hash (see the module docstring)."""
    return _hash64(row_bytes(row))


def key_hash(row: Mapping[str, Any], key_columns: Iterable[str]) -> int:
    """The hash of the row's key columns alone (``key_columns``: the primary key; a table
    without one: every column)."""
    return row_hash({name: row[name] for name in key_columns})


def bucket_of(key_hash: int, bits: int) -> int:
    """The bucket, at ``bits`` bits, of a row whose key hashes to ``key_hash``."""
    return key_hash >> (HASH_BITS - bits)


def bucket_bits(row_count: int) -> int:
    """How many bits a table of ``row_count`` rows is split by (see ROWS_PER_BUCKET)."""
    bits = 0
    while bits < MAX_BUCKET_BITS and row_count > ROWS_PER_BUCKET << bits:
        bits += 1
    return bits


# a column as _joined writes it: (name, name prefix, prefix + "S", prefix + "I", prefix + "F")
_Prefixed = tuple[str, bytes, bytes, bytes, bytes]


def _prefixes(name: str) -> _Prefixed:
    prefix = _name_prefix(name)
    return name, prefix, prefix + b"S", prefix + b"I", prefix + b"F"


def _joined(prefixed: Sequence[_Prefixed], row: Mapping[str, Any]) -> bytes:
    """``row_bytes`` of the columns ``prefixed``, with the common types inlined (a row's
    str, int and float values are most of what a table holds)."""
    parts: list[bytes] = []
    append = parts.append
    for name, prefix, str_prefix, int_prefix, float_prefix in prefixed:
        value = row[name]
        if value is None:
            continue
        kind = type(value)
        if kind is str:
            data = value.encode("utf-8")
            append(str_prefix)
            append(_u32(len(data)))
            append(data)
        elif kind is int:
            data = str(value).encode("ascii")
            append(int_prefix)
            append(_u32(len(data)))
            append(data)
        elif kind is float:
            append(float_prefix)
            append(_NAN_BITS if value != value else _f64(value))  # noqa: PLR0124 - NaN
        else:
            append(prefix)
            append(value_bytes(value))
    return b"".join(parts)


class RowDigester:
    """Row and key hashes of one table shape: the column order and the name bytes worked out
    once, for the rows of a scan or a stream. A row must hold every column."""

    def __init__(self, columns: Iterable[str], key_columns: Sequence[str] = ()) -> None:
        given = tuple(columns)
        names = sorted(given, key=_utf8)
        if len(set(names)) != len(names):
            raise ValueError(f"column names repeat: {names}")
        key = set(key_columns) or set(names)
        if not key <= set(names):
            raise ValueError(f"key columns {sorted(key - set(names))} are not columns")
        self.columns = tuple(names)
        self.key_columns = tuple(name for name in names if name in key)
        self._given = given
        self._prefixed = tuple(_prefixes(name) for name in names)
        self._key_prefixed = tuple(column for column in self._prefixed if column[0] in key)

    def row_bytes(self, row: Mapping[str, Any]) -> bytes:
        return _joined(self._prefixed, row)

    def row_hash(self, row: Mapping[str, Any]) -> int:
        return _hash64(_joined(self._prefixed, row))

    def key_hash(self, row: Mapping[str, Any]) -> int:
        return _hash64(_joined(self._key_prefixed, row))

    def hashes(self, row: Mapping[str, Any]) -> tuple[int, int]:
        """``(key_hash, row_hash)``: what a bucket digest adds or removes for the row."""
        return self.key_hash(row), self.row_hash(row)

    def hashes_of_values(self, values: Sequence[Any]) -> tuple[int, int]:
        """``hashes`` of the row whose values are ``values``, one per column in the order
        the digester was made with (not the sorted ``columns``): no row map needed."""
        if len(values) != len(self._given):
            raise ValueError(f"{len(self._given)} values expected, not {len(values)}")
        return self.hashes(dict(zip(self._given, values, strict=True)))


@dataclass
class TableDigest:
    """The digests of a table's 2^bits buckets, kept current row by row: bucket ``b``'s total
    (its rows' hashes summed modulo 2^64) is ``totals[b]``, its row count ``counts[b]``."""

    bits: int
    totals: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.bits <= MAX_HELD_BITS:
            raise ValueError(f"bits must be 0..{MAX_HELD_BITS}, not {self.bits}")
        size = 1 << self.bits
        if not self.totals and not self.counts:
            self.totals, self.counts = [0] * size, [0] * size
        elif len(self.totals) != size or len(self.counts) != size:
            raise ValueError(f"{1 << self.bits} buckets expected at {self.bits} bits")

    def add(self, key_hash: int, row_hash: int) -> None:
        bucket = key_hash >> (HASH_BITS - self.bits)
        self.totals[bucket] = (self.totals[bucket] + row_hash) & _MASK
        self.counts[bucket] += 1

    def remove(self, key_hash: int, row_hash: int) -> None:
        bucket = key_hash >> (HASH_BITS - self.bits)
        self.totals[bucket] = (self.totals[bucket] - row_hash) & _MASK
        self.counts[bucket] -= 1

    def folded(self, bits: int) -> TableDigest:
        """The same rows in 2^bits buckets (``bits`` at most this digest's): each bucket the
        sum of the finer buckets it holds."""
        if not 0 <= bits <= self.bits:
            raise ValueError(f"cannot fold {self.bits} bits into {bits}")
        shift = self.bits - bits
        coarse = TableDigest(bits)
        for index, (total, count) in enumerate(zip(self.totals, self.counts, strict=True)):
            parent = index >> shift
            coarse.totals[parent] = (coarse.totals[parent] + total) & _MASK
            coarse.counts[parent] += count
        return coarse

    def differing(self, other: TableDigest) -> list[int]:
        """The buckets whose digests differ, at the coarser of the two digests' bits."""
        bits = min(self.bits, other.bits)
        mine = self if self.bits == bits else self.folded(bits)
        theirs = other if other.bits == bits else other.folded(bits)
        return [index for index in range(1 << bits)
                if mine.totals[index] != theirs.totals[index]
                or mine.counts[index] != theirs.counts[index]]


def digest_rows(digest: TableDigest, digester: RowDigester,
                rows: Iterable[Mapping[str, Any]]) -> int:
    """Add ``rows`` to ``digest``; the number of rows added."""
    added = 0
    for row in rows:
        digest.add(*digester.hashes(row))
        added += 1
    return added


def digest_columns(digest: TableDigest, digester: RowDigester,
                   columns: Sequence[Sequence[Any]], count: int) -> int:
    """Add ``count`` rows given column by column to ``digest`` (``columns[i]``: the values of
    the i-th column in the order ``digester`` was made with, as ``Chunker.rows_of`` converts
    them before it builds row maps); the number added."""
    if len(columns) != len(digester._given):
        raise ValueError(f"{len(digester._given)} columns expected, not {len(columns)}")
    if any(len(column) != count for column in columns):
        raise ValueError(f"every column must hold {count} values")
    for index in range(count):
        digest.add(*digester.hashes_of_values([column[index] for column in columns]))
    return count


def table_digest(rows: Iterable[Mapping[str, Any]], digester: RowDigester,
                 bits: int) -> TableDigest:
    """The digest of ``rows`` (every row of a table, or of a bucket) at ``bits`` bits."""
    digest = TableDigest(bits)
    digest_rows(digest, digester, rows)
    return digest


def pack_totals(totals: Sequence[int]) -> bytes:
    """A digest message's ``totals``: each bucket total as 8 bytes, big-endian."""
    return struct.pack(f">{len(totals)}Q", *totals)


def bucket_digests(bits: int, totals: bytes, counts: Sequence[int],
                   buckets: Sequence[int] | None = None) -> dict[int, tuple[int, int]]:
    """A digest message's buckets, ``{bucket: (total, count)}``: every bucket at ``bits``, or
    those of ``buckets``. ValueError when the fields do not fit together."""
    if not 0 <= bits <= MAX_HELD_BITS:
        raise ValueError(f"bits must be 0..{MAX_HELD_BITS}, not {bits}")
    covered = list(range(1 << bits)) if buckets is None else list(buckets)
    if any(not 0 <= bucket < 1 << bits for bucket in covered) or len(set(covered)) != len(
            covered):
        raise ValueError(f"buckets must be distinct numbers below 2^{bits}")
    if len(totals) != 8 * len(covered) or len(counts) != len(covered):
        raise ValueError(f"{len(covered)} buckets need {8 * len(covered)} bytes of totals and "
                         f"{len(covered)} counts, not {len(totals)} and {len(counts)}")
    unpacked = struct.unpack(f">{len(covered)}Q", totals)
    return {bucket: (total, int(count))
            for bucket, total, count in zip(covered, unpacked, counts, strict=True)}


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.wire import digest as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    RowDigester = _twin.RowDigester  # type: ignore[misc]
    digest_rows = _twin.digest_rows
    digest_columns = _twin.digest_columns
