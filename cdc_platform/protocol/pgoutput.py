"""Pure decoder of pgoutput, PostgreSQL's logical replication output plugin. No I/O.

Each CopyData ``XLogData`` payload of a ``START_REPLICATION ... LOGICAL`` stream (and each
``data`` row of ``pg_logical_slot_peek_binary_changes``) is exactly one pgoutput message:

    "Byte1 message type, then the fields of that message" -- PostgreSQL docs,
    *Logical Replication Message Formats* (protocol.sgml, section 55.9 in PostgreSQL 16)

:func:`decode_message` dispatches on that first byte and returns a frozen, slotted
dataclass. Integers are big-endian ("network byte order"); ``String`` is NUL-terminated in
the server encoding (UTF8 here). Every message must be consumed exactly: trailing bytes,
truncated buffers and unknown tags raise :class:`~cdc_platform.errors.ProtocolError`.

Protocol version 1 is the target. Version 2 adds *streamed* in-progress transactions: the
Stream Start/Stop/Commit/Abort messages are decoded here, and the data messages sent between
a Stream Start and its Stream Stop carry a leading ``Int32`` xid, which
:func:`decode_streamed_message` reads. Version 3 (two-phase) and 4 (parallel) are not
requested by this project; their two-phase messages raise a ProtocolError that names them.

Timestamps (``TimestampTz``) are kept as the raw ``int`` PostgreSQL sends: "microseconds
since PostgreSQL epoch (2000-01-01)"; :func:`timestamp_to_iso` renders one as
``2025-12-08T13:45:21.719719Z``.

Speed: the hot path is Insert/Update/Delete TupleData, read by :func:`read_tuple_python`
or, when built, its compiled twin (``_speedups/protocol/pgoutput.pyx``; see ``speedups.py``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

from cdc_platform.errors import ProtocolError
from cdc_platform.speedups import compiled_twin

__all__ = [
    "UNCHANGED_TOAST",
    "Begin",
    "ColumnValue",
    "Commit",
    "Delete",
    "Insert",
    "LogicalMessage",
    "Origin",
    "PgoutputMessage",
    "Relation",
    "RelationColumn",
    "StreamAbort",
    "StreamCommit",
    "StreamStart",
    "StreamStop",
    "Truncate",
    "TupleData",
    "Type",
    "Update",
    "decode_message",
    "decode_streamed_message",
    "timestamp_to_datetime",
    "timestamp_to_iso",
]


# -- values ----------------------------------------------------------------------------------
class _UnchangedToast:
    """TupleData kind ``'u'``: "unchanged toasted value (the actual value is not sent)".

    A singleton, distinct from ``None`` (SQL NULL). It has no truth value on purpose --
    ``if value:`` raises ``TypeError`` -- so no code can mistake it for NULL or for an empty
    value; test it with ``value is UNCHANGED_TOAST``.
    """

    __slots__ = ()
    _instance: _UnchangedToast | None = None

    def __new__(cls) -> _UnchangedToast:  # noqa: PYI034 - a singleton: this class, always
        if cls._instance is None:
            cls._instance = object.__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"

    def __bool__(self) -> bool:
        raise TypeError("UNCHANGED_TOAST has no truth value; test `value is UNCHANGED_TOAST`")

    def __reduce__(self) -> str:
        return "UNCHANGED_TOAST"  # pickles as the module global: stays a singleton

    def __copy__(self) -> _UnchangedToast:
        return self

    def __deepcopy__(self, memo: object) -> _UnchangedToast:
        return self


UNCHANGED_TOAST: Final = _UnchangedToast()

#: One TupleData column: None for 'n' (NULL), UNCHANGED_TOAST for 'u', str for 't' (text
#: format, UTF-8), bytes for 'b' (binary format; only with the ``binary`` option).
ColumnValue: TypeAlias = "str | bytes | None | _UnchangedToast"
#: A row as sent: one value per column of the relation, in column order.
TupleData: TypeAlias = "tuple[ColumnValue, ...]"


# -- timestamps ------------------------------------------------------------------------------
PG_EPOCH: Final = datetime(2000, 1, 1)  # naive, UTC
_TIMESTAMP_INFINITY: Final = 0x7FFF_FFFF_FFFF_FFFF  # DT_NOEND
_TIMESTAMP_MINUS_INFINITY: Final = -0x8000_0000_0000_0000  # DT_NOBEGIN


def timestamp_to_datetime(microseconds: int) -> datetime:
    """A ``TimestampTz`` (microseconds since 2000-01-01 UTC) as a naive UTC datetime."""
    try:
        return PG_EPOCH + timedelta(microseconds=microseconds)
    except OverflowError as exc:
        raise ValueError(f"timestamp {microseconds} is outside datetime's range") from exc


def timestamp_to_iso(microseconds: int) -> str:
    """``TimestampTz`` -> ``"2025-12-08T13:45:21.719719Z"`` (always 6 fractional digits).

    PostgreSQL's ``infinity``/``-infinity`` become those words.
    """
    if microseconds == _TIMESTAMP_INFINITY:
        return "infinity"
    if microseconds == _TIMESTAMP_MINUS_INFINITY:
        return "-infinity"
    return timestamp_to_datetime(microseconds).isoformat(timespec="microseconds") + "Z"


# -- messages --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Begin:
    """'B': "Int64 The final LSN of the transaction. Int64 Commit timestamp of the
    transaction. Int32 Xid of the transaction." (pypgoutput wrongly reads an Int64 xid.)"""

    final_lsn: int
    commit_ts: int  # microseconds since 2000-01-01 UTC; see timestamp_to_iso
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    """'C': "Int8(0) Flags; currently unused. Int64 The LSN of the commit. Int64 The end LSN
    of the transaction. Int64 Commit timestamp of the transaction." """

    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(frozen=True, slots=True)
class Origin:
    """'O': "Int64 The LSN of the commit on the origin server. String Name of the origin."
    Sent after Begin when the transaction was replayed under a replication origin."""

    commit_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class RelationColumn:
    """One column of a Relation message: "Int8 Flags for the column (0 or 1, marks the
    column as part of the key). String Name. Int32 OID of the column's data type. Int32
    Type modifier of the column (atttypmod)." """

    name: str
    type_oid: int
    type_modifier: int
    is_key: bool


@dataclass(frozen=True, slots=True)
class Relation:
    """'R': "Int32 OID of the relation. String Namespace (empty string for pg_catalog).
    String Relation name. Int8 Replica identity setting for the relation (same as
    relreplident in pg_class). Int16 Number of columns." then the columns.

    Sent before the first change of a relation in a session and again after its definition
    changed. ``replica_identity`` is ``'d'`` default, ``'n'`` nothing, ``'f'`` full or
    ``'i'`` index."""

    relation_id: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[RelationColumn, ...]


@dataclass(frozen=True, slots=True)
class Type:
    """'Y': "Int32 OID of the data type. String Namespace (empty string for pg_catalog).
    String Name of the data type." Sent for columns of non-built-in types."""

    type_oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    """'I': "Int32 OID of the relation. Byte1('N') Identifies the following TupleData
    message as a new tuple. TupleData." """

    relation_id: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update:
    """'U': "Int32 OID of the relation. Byte1('K') ... key ... Byte1('O') ... old tuple ...
    Byte1('N') ... new tuple". "The Update message may contain either a 'K' message part or
    an 'O' message part or neither of them, but never both of them." ``old_kind`` is the
    part's letter, ``None`` when absent."""

    relation_id: int
    old_kind: Literal["K", "O"] | None
    old: TupleData | None
    new: TupleData


@dataclass(frozen=True, slots=True)
class Delete:
    """'D': "Int32 OID of the relation. Byte1('K') ... key ... or Byte1('O') ... old tuple
    ... TupleData". "The Delete message may contain either a 'K' message part or an 'O'
    message part, but never both of them." """

    relation_id: int
    old_kind: Literal["K", "O"]
    old: TupleData


@dataclass(frozen=True, slots=True)
class Truncate:
    """'T': "Int32 Number of relations. Int8 Option bits for TRUNCATE: 1 for CASCADE, 2 for
    RESTART IDENTITY. Int32 OID of the relation (repeated for each relation)." """

    relation_ids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    """'M': "Int8 Flags; Either 0 for no flags or 1 if the logical decoding message is
    transactional. Int64 The LSN of the logical decoding message. String The prefix of the
    logical decoding message. Int32 Length of the content. Byten The content." """

    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class StreamStart:
    """'S' (protocol 2): "Int32 Xid of the transaction. Int8 A value of 1 indicates this is
    the first stream segment for this XID, 0 for any other stream segment." """

    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    """'E' (protocol 2): no fields; ends the current stream segment."""


@dataclass(frozen=True, slots=True)
class StreamCommit:
    """'c' (protocol 2): "Int32 Xid of the transaction. Int8(0) Flags; currently unused.
    Int64 The LSN of the commit. Int64 The end LSN of the transaction. Int64 Commit
    timestamp of the transaction." """

    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(frozen=True, slots=True)
class StreamAbort:
    """'A' (protocol 2): "Int32 Xid of the transaction. Int32 Xid of the subtransaction
    (will be same as xid of the transaction for top-level transactions)." With protocol 4
    and ``streaming = parallel`` also "Int64 The LSN of the abort operation. Int64 Abort
    timestamp"; ``None`` otherwise."""

    xid: int
    subxid: int
    abort_lsn: int | None = None
    abort_ts: int | None = None


PgoutputMessage: TypeAlias = (
    "Begin | Commit | Origin | Relation | Type | Insert | Update | Delete | Truncate"
    " | LogicalMessage | StreamStart | StreamStop | StreamCommit | StreamAbort"
)

# -- wire primitives -------------------------------------------------------------------------
_U8 = struct.Struct(">B").unpack_from
_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_U32_U32 = struct.Struct(">II").unpack_from
_U32_U8 = struct.Struct(">IB").unpack_from
_BEGIN = struct.Struct(">QqI").unpack_from
_COMMIT = struct.Struct(">BQQq").unpack_from
_STREAM_COMMIT = struct.Struct(">IBQQq").unpack_from
_STREAM_ABORT_V4 = struct.Struct(">IIQq").unpack_from
_MESSAGE_HEAD = struct.Struct(">BQ").unpack_from
_COLUMN_TAIL = struct.Struct(">Ii").unpack_from  # type oid, type modifier

_T, _N, _U, _B = ord("t"), ord("n"), ord("u"), ord("b")
_KIND_NEW, _KIND_KEY, _KIND_OLD = ord("N"), ord("K"), ord("O")


def _string(data: bytes, pos: int) -> tuple[str, int]:
    """``String``: "a null-terminated string" -> (text, position after the NUL)."""
    end = data.index(0, pos)  # ValueError (-> ProtocolError) when the NUL is missing
    return data[pos:end].decode(), end + 1


def read_tuple_python(data: bytes, pos: int) -> tuple[TupleData, int]:
    """TupleData: "Int16 Number of columns." then per column one of Byte1('n') "the data
    is NULL", Byte1('u') "unchanged TOASTed value", Byte1('t') "the data is in text format"
    + Int32 length + Byten, Byte1('b') "the data is in binary format" + Int32 + Byten."""
    (count,) = _U16(data, pos)
    pos += 2
    size = len(data)
    values: list[ColumnValue] = []
    for index in range(count):
        kind = data[pos]
        pos += 1
        if kind == _T or kind == _B:
            (length,) = _U32(data, pos)
            pos += 4
            end = pos + length
            if end > size:
                raise ProtocolError(
                    f"TupleData column {index} declares {length} bytes but only "
                    f"{size - pos} remain (truncated message)")
            values.append(data[pos:end].decode() if kind == _T else data[pos:end])
            pos = end
        elif kind == _N:
            values.append(None)
        elif kind == _U:
            values.append(UNCHANGED_TOAST)
        else:
            raise ProtocolError(f"unknown TupleData column kind {chr(kind)!r} in column {index}")
    return tuple(values), pos


def read_tuple(data: bytes, pos: int, unchanged: object) -> tuple[TupleData, int] | None:
    """TupleData at ``data[pos:]`` -> ``(values, end)``, unchanged TOAST values as
    ``unchanged``; None: left to :func:`read_tuple_python`, which says what is wrong. The pure
    code leaves every tuple to it; the compiled twin reads the well-formed ones."""
    return None


def _tuple(data: bytes, pos: int) -> tuple[TupleData, int]:
    result = read_tuple(data, pos, UNCHANGED_TOAST)
    return result if result is not None else read_tuple_python(data, pos)


# -- message decoders: (data, pos after tag [and xid]) -> (message, end position) ------------
def _begin(data: bytes, pos: int) -> tuple[Begin, int]:
    return Begin(*_BEGIN(data, pos)), pos + 20


def _commit(data: bytes, pos: int) -> tuple[Commit, int]:
    return Commit(*_COMMIT(data, pos)), pos + 25


def _origin(data: bytes, pos: int) -> tuple[Origin, int]:
    (lsn,) = _U64(data, pos)
    name, pos = _string(data, pos + 8)
    return Origin(lsn, name), pos


def _relation(data: bytes, pos: int) -> tuple[Relation, int]:
    (relation_id,) = _U32(data, pos)
    namespace, pos = _string(data, pos + 4)
    name, pos = _string(data, pos)
    replica_identity = chr(data[pos])
    (count,) = _U16(data, pos + 1)
    pos += 3
    columns = []
    for _ in range(count):
        flags = data[pos]
        column_name, pos = _string(data, pos + 1)
        type_oid, type_modifier = _COLUMN_TAIL(data, pos)
        pos += 8
        columns.append(RelationColumn(column_name, type_oid, type_modifier, bool(flags & 1)))
    return Relation(relation_id, namespace, name, replica_identity, tuple(columns)), pos


def _type(data: bytes, pos: int) -> tuple[Type, int]:
    (type_oid,) = _U32(data, pos)
    namespace, pos = _string(data, pos + 4)
    name, pos = _string(data, pos)
    return Type(type_oid, namespace, name), pos


def _insert(data: bytes, pos: int) -> tuple[Insert, int]:
    relation_id, marker = _U32_U8(data, pos)
    if marker != _KIND_NEW:
        raise ProtocolError(f"Insert: expected 'N' before the new tuple, got {chr(marker)!r}")
    new, pos = _tuple(data, pos + 5)
    return Insert(relation_id, new), pos


def _update(data: bytes, pos: int) -> tuple[Update, int]:
    relation_id, marker = _U32_U8(data, pos)
    pos += 5
    old_kind: Literal["K", "O"] | None = None
    old: TupleData | None = None
    if marker == _KIND_KEY or marker == _KIND_OLD:
        old_kind = "K" if marker == _KIND_KEY else "O"
        old, pos = _tuple(data, pos)
        marker = data[pos]
        pos += 1
    if marker != _KIND_NEW:
        raise ProtocolError(f"Update: expected 'K', 'O' or 'N', got {chr(marker)!r}")
    new, pos = _tuple(data, pos)
    return Update(relation_id, old_kind, old, new), pos


def _delete(data: bytes, pos: int) -> tuple[Delete, int]:
    relation_id, marker = _U32_U8(data, pos)
    if marker != _KIND_KEY and marker != _KIND_OLD:
        raise ProtocolError(f"Delete: expected 'K' or 'O', got {chr(marker)!r}")
    old, pos = _tuple(data, pos + 5)
    return Delete(relation_id, "K" if marker == _KIND_KEY else "O", old), pos


def _truncate(data: bytes, pos: int) -> tuple[Truncate, int]:
    count, options = _U32_U8(data, pos)
    pos += 5
    if count > (len(data) - pos) // 4:
        raise ProtocolError(f"Truncate: {count} relations declared, "
                            f"only {len(data) - pos} bytes remain (truncated message)")
    relation_ids = struct.unpack_from(f">{count}I", data, pos)
    return Truncate(relation_ids, bool(options & 1), bool(options & 2)), pos + 4 * count


def _logical_message(data: bytes, pos: int) -> tuple[LogicalMessage, int]:
    flags, lsn = _MESSAGE_HEAD(data, pos)
    prefix, pos = _string(data, pos + 9)
    (length,) = _U32(data, pos)
    pos += 4
    end = pos + length
    if end > len(data):
        raise ProtocolError(f"Message: content declares {length} bytes but only "
                            f"{len(data) - pos} remain (truncated message)")
    return LogicalMessage(bool(flags & 1), lsn, prefix, data[pos:end]), end


def _stream_start(data: bytes, pos: int) -> tuple[StreamStart, int]:
    xid, first = _U32_U8(data, pos)
    return StreamStart(xid, bool(first)), pos + 5


def _stream_stop(data: bytes, pos: int) -> tuple[StreamStop, int]:
    return StreamStop(), pos


def _stream_commit(data: bytes, pos: int) -> tuple[StreamCommit, int]:
    return StreamCommit(*_STREAM_COMMIT(data, pos)), pos + 29


def _stream_abort(data: bytes, pos: int) -> tuple[StreamAbort, int]:
    # The parallel (protocol 4) form is recognisable by its length alone.
    if len(data) - pos == 24:
        return StreamAbort(*_STREAM_ABORT_V4(data, pos)), pos + 24
    return StreamAbort(*_U32_U32(data, pos)), pos + 8


_DECODERS: dict[int, Callable[[bytes, int], tuple[PgoutputMessage, int]]] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("O"): _origin,
    ord("R"): _relation,
    ord("Y"): _type,
    ord("I"): _insert,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
    ord("M"): _logical_message,
    ord("S"): _stream_start,
    ord("E"): _stream_stop,
    ord("c"): _stream_commit,
    ord("A"): _stream_abort,
}
_NAMES = {
    "B": "Begin", "C": "Commit", "O": "Origin", "R": "Relation", "Y": "Type", "I": "Insert",
    "U": "Update", "D": "Delete", "T": "Truncate", "M": "Message", "S": "Stream Start",
    "E": "Stream Stop", "c": "Stream Commit", "A": "Stream Abort",
}
# Known tags this decoder does not handle: two-phase commit (protocol version 3).
_UNSUPPORTED = {
    "b": "Begin Prepare", "P": "Prepare", "K": "Commit Prepared", "r": "Rollback Prepared",
    "p": "Stream Prepare",
}
#: Data messages that carry "Int32 Xid of the transaction (only present for streamed
#: transactions)" right after the tag.
_STREAMED_XID_TAGS = frozenset(ord(t) for t in "RYIUDTM")


def _tag_error(tag: int) -> ProtocolError:
    letter = chr(tag)
    if letter in _UNSUPPORTED:
        return ProtocolError(f"pgoutput {_UNSUPPORTED[letter]} message ({letter!r}) is part of "
                             "two-phase decoding (protocol version 3), which is not supported")
    return ProtocolError(f"unknown pgoutput message type {letter!r} (0x{tag:02x})")


def _decode(data: bytes, start: int, streamed: bool) -> tuple[int | None, PgoutputMessage]:
    size = len(data)
    if start >= size:
        raise ProtocolError("empty pgoutput message")
    tag = data[start]
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise _tag_error(tag)
    xid = None
    pos = start + 1
    try:
        if streamed and tag in _STREAMED_XID_TAGS:
            (xid,) = _U32(data, pos)
            pos += 4
        message, end = decoder(data, pos)
    except ProtocolError as exc:
        raise ProtocolError(f"malformed pgoutput {_NAMES[chr(tag)]} message "
                            f"({size - start} bytes): {exc}") from exc
    except (struct.error, IndexError, ValueError) as exc:  # incl. UnicodeDecodeError
        raise ProtocolError(f"truncated or malformed pgoutput {_NAMES[chr(tag)]} message "
                            f"({size - start} bytes): {exc}") from exc
    if end != size:
        if end > size:
            raise ProtocolError(f"truncated pgoutput {_NAMES[chr(tag)]} message: "
                                f"{size - start} bytes, {end - start} needed")
        raise ProtocolError(f"pgoutput {_NAMES[chr(tag)]} message has {size - end} trailing "
                            f"bytes after {end - start} decoded")
    return xid, message


_new_object = object.__new__


def _slot_setter(name: str) -> Callable[[Insert, Any], None]:
    """The slot descriptor's setter of a frozen Insert field."""
    setter: Callable[[Insert, Any], None] = getattr(Insert, name).__set__
    return setter


_set_insert_relation_id = _slot_setter("relation_id")
_set_insert_new = _slot_setter("new")


def decode_message(data: bytes | bytearray | memoryview, offset: int = 0) -> PgoutputMessage:
    """Decode the one pgoutput message in ``data[offset:]`` (protocol version 1 framing).

    ``offset`` lets a caller decode straight out of a CopyData buffer without slicing it
    (``decode_message(copy_data, XLOGDATA_HEADER_SIZE)``). A ``memoryview`` or
    ``bytearray`` is copied once into ``bytes``: decoding from bytes is faster than from a
    view, and the copy is a memcpy of the message.
    """
    if data.__class__ is not bytes:
        data = bytes(data)
    # Hot path, inlined: an Insert (the most common message). Anything else -- and every
    # error -- takes the general path below.
    try:
        if data[offset] == 73:  # 'I'
            relation_id, marker = _U32_U8(data, offset + 1)  # relation oid, 'N'
            if marker == 78:  # 'N'
                values, end = _tuple(data, offset + 6)
                if end == len(data):
                    # A frozen dataclass's __init__ sets fields through object.__setattr__;
                    # the slot descriptors are twice as fast and build the same object.
                    insert = _new_object(Insert)
                    _set_insert_relation_id(insert, relation_id)
                    _set_insert_new(insert, values)
                    return insert
    except (IndexError, ValueError, struct.error, ProtocolError):  # incl. UnicodeDecodeError
        pass
    return _decode(data, offset, False)[1]


def decode_streamed_message(
    data: bytes | bytearray | memoryview, offset: int = 0
) -> tuple[int | None, PgoutputMessage]:
    """Decode a message received between a Stream Start and its Stream Stop (protocol 2).

    Those data messages (Relation, Type, Insert, Update, Delete, Truncate, Message) start
    with the streamed transaction's xid; returns ``(xid, message)``. Any other message is
    decoded as by :func:`decode_message` and returned with ``xid`` None.
    """
    if type(data) is not bytes:
        data = bytes(data)
    return _decode(data, offset, True)


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.protocol import pgoutput as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    read_tuple = _twin.read_tuple
