"""Every payload of the contract, typed, with its fields in the order they are written
(docs/wire-contract.md). ``*_FIELDS`` lists the fields always present; the ``NotRequired`` ones
appear only as each says.

The golden payloads in ``cdc_platform_tests/data/golden/`` pin the bytes both writers (pure
Python and the compiled twins) produce for each of these.
"""

# (no "from __future__ import annotations": TypedDict reads NotRequired at runtime)
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from datetime import datetime
from typing import Any, Literal, NotRequired, TypedDict

# A wire value: None, bool, int, float, str, bytes, or a list/map of them (docs/wire-contract.md
# "Type mapping").
Value = Any
Row = dict[str, Value]


class ChangeEvent(TypedDict):
    """One INSERT/UPDATE/DELETE/TRUNCATE (``cdc.{table}.{op}``; an element of a batch on
    ``cdc.{table}.{op}.batch``)."""

    table: str  # the wire table name (docs/wire-contract.md "Table names on the wire")
    schema: str
    operation: Literal["INSERT", "UPDATE", "DELETE", "TRUNCATE"]
    relation_id: int
    commit_lsn: str  # "X/Y": compare as (X << 32) | Y
    xid: int
    commit_ts: str
    subject: str
    schema_fingerprint: str
    lsn: str
    ordinal: int  # the change's position in its transaction, from 0
    msg_id: str
    data: Row | None  # the new row; DELETE: the old key (or row); TRUNCATE: None
    unchanged_toast: list[str]  # columns not in data: unchanged TOASTed values
    old: NotRequired[Row]  # UPDATE/DELETE with an old key or row (old_kind "K" or "O")
    old_kind: NotRequired[str]
    cascade: NotRequired[bool]  # TRUNCATE only
    restart_identity: NotRequired[bool]  # TRUNCATE only
    raw_columns: NotRequired[list[str]]  # values sent as PostgreSQL's text (no converter)
    # the table's last change of its transaction: {table: changes} of every table the
    # transaction changed (docs/wire-contract.md "Transactions")
    tx_tables: NotRequired[dict[str, int]]


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a table's schema, as ``columns`` of a KV ``schemas`` value carries it
    (:meth:`to_wire`: these fields, in this order)."""

    name: str
    position: int
    data_type: str  # format_type, e.g. numeric(10,2)
    is_nullable: bool
    column_default: str | None
    type_oid: int
    is_key: bool  # in the replica identity (every column under REPLICA IDENTITY FULL)
    is_primary_key: bool
    missing_value: Value = None  # what rows older than the column read (attmissingval)
    attnum: int = 0  # the column's identity (pg_attribute.attnum): kept by a RENAME; 0: unknown
    # the type whose values the column's are: ``type_oid`` with domains resolved (an array of
    # a domain: the array type of the resolved element); 0 given: ``type_oid`` (no domain)
    base_type_oid: int = 0
    # its values are arrays (nested lists): ``base_type_oid`` is an array type, builtin or not
    is_array: bool = False

    def __post_init__(self) -> None:
        if not self.base_type_oid:
            object.__setattr__(self, "base_type_oid", self.type_oid)

    @classmethod
    def from_wire(cls, column: Mapping[str, Any]) -> "Column":
        """A ``columns`` element read from the wire: KeyError, TypeError or ValueError when it
        is not one. Only ``name``, ``type_oid`` and ``data_type`` are required (what consumers
        read to store a column); the others read as unknown when absent: position 0, nullable,
        no default, not in a key, no missing value, attnum 0, and ``base_type_oid`` and
        ``is_array`` (absent from a schema an older bridge wrote) as ``type_oid`` and false."""
        name = column["name"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"name {name!r}")
        type_oid = int(column["type_oid"])
        data_type = str(column["data_type"])
        default = column.get("column_default")
        return cls(name, int(column.get("position") or 0), data_type,
                   bool(column.get("is_nullable", True)),
                   None if default is None else str(default), type_oid,
                   bool(column.get("is_key")), bool(column.get("is_primary_key")),
                   column.get("missing_value"), int(column.get("attnum") or 0),
                   int(column.get("base_type_oid") or type_oid),
                   bool(column.get("is_array")))

    def to_wire(self) -> dict[str, Value]:
        return {name: getattr(self, name) for name in COLUMN_FIELDS}


class TableSchemaValue(TypedDict):
    """The KV ``schemas`` value (key = wire table name); also in schema events and metas."""

    table: str
    schema: str  # "namespace.name", quoted where PostgreSQL would quote
    timestamp: int
    columns: list[dict[str, Value]]  # each as Column.to_wire() writes it
    namespace: str
    name: str
    relation_id: int
    primary_key: list[str]
    replica_identity: str  # "default" | "full" | "index" | "nothing"
    fingerprint: str
    # the storage (pg_class.relfilenode) the stream's consumers hold: as the table's last
    # schema event announced it, or, before any, when the table was published
    relfilenode: int


class SchemaEvent(TypedDict):
    """A table's new shape on ``cdc.{table}.schema``, before the first change using it."""

    table: str
    schema: str
    operation: Literal["SCHEMA"]
    relation_id: int
    commit_lsn: str
    xid: int
    commit_ts: str
    subject: str
    schema_fingerprint: str
    lsn: str
    ordinal: int  # the ordinal of the change it precedes
    msg_id: str
    previous_fingerprint: str | None
    needs_snapshot: bool  # existing rows cannot be known from the stream: bootstrap again
    reason: str | None
    relfilenode: int
    # needs_snapshot: bootstrap from a snapshot whose lsn is at least this (>= commit_lsn)
    min_snapshot_lsn: str
    table_schema: TableSchemaValue


class WatermarkMarker(TypedDict):
    """``cdc.cdc-platform.watermark.{snapshot_id}``: where a snapshot's cutover is in CDC."""

    type: Literal["watermark"]
    snapshot_id: str
    table: str | None
    lsn: str
    commit_lsn: str | None
    subject: str
    msg_id: str


class ResyncMarker(TypedDict):
    """``cdc.cdc-platform.resync.{slot}``: the bridge's slot was invalidated and the bridge (with
    ``CDC_ON_SLOT_LOST=resync``) streams from a new slot. Stored before anything from the new
    slot, so every message after it in ``CDC`` comes from the new slot; changes committed
    after ``lost_after`` and before the new slot's start may be missing from the stream."""

    type: Literal["resync"]
    slot: str
    lost_after: str  # the lost slot's confirmed position: the stream is whole up to it
    reason: str
    timestamp: int  # milliseconds since the epoch
    msg_id: str


class VerificationDigestPayload(TypedDict):
    """``cdc.cdc-platform.verify.{table}.{verification_id}`` (stream ``CDC``): the source's
    table digest (docs/verification.md) at ``lsn``: it covers exactly the transactions whose
    commit_lsn < lsn, as a snapshot at ``lsn`` would. Stored after every one of them."""

    type: Literal["digest"]
    verification_id: str  # "verify-...": also the id of its watermark marker
    table: str
    lsn: str  # compare a mirror holding every transaction below it and none above
    marker_subject: str  # the verification's watermark marker (before every commit >= lsn)
    schema_fingerprint: str  # the columns digested: comparable only with the same ones
    algorithm: str  # "cdc-digest-1" (docs/verification.md Part 1)
    bits: int
    row_count: int  # of the rows digested (the buckets' counts summed)
    # per covered bucket, in the order of ``buckets`` (every bucket 0..2^bits-1 when null):
    totals: bytes  # 8 bytes each, big-endian uint64 (JSON: base64, as bytea)
    counts: list[int]
    buckets: list[int] | None  # the buckets covered, when the run was asked for some
    duration_seconds: float
    msg_id: str


class MirrorVerification(TypedDict):
    """A mirror's last verification of a table (docs/verification.md Part 2, item 3)."""

    verification_id: str
    lsn: str | None
    status: str  # "equal" | "differ" | "not_comparable" | "repaired"
    buckets_differing: int  # how many of the digest's buckets differed
    rows_repaired: int
    at: str | None  # when, ISO 8601 UTC


class MirrorTableState(TypedDict):
    """One table of a :class:`MirrorStateValue`, as the mirror's file holds it."""

    # "bootstrapping" | "streaming" | "stale" | "resyncing" (streaming, but not verified since
    # the bridge lost its slot: it may lack changes) | "waiting" (its schema cannot be
    # mirrored as it is: it waits for the table's next schema)
    status: str
    snapshot_id: str | None
    cutover_lsn: str | None
    applied_lsn: str | None  # the last applied commit LSN (null: nothing applied yet)
    last_verification: MirrorVerification | None
    reason: str | None  # why a table is stale or waiting (null otherwise)


class MirrorStateValue(TypedDict):
    """KV ``mirrors``, key = mirror id (``{team}.{name}`` or ``{name}``): a mirror's state,
    JSON, published on ``mirror.state.{mirror id}`` every CDC_MIRROR_STATE_INTERVAL and after
    each verification; gone after the bucket's TTL once the mirror stops. A mirror that stops
    on purpose (caught up with ``--once``, SIGTERM, Ctrl-C) publishes a last value with
    ``stopped_at``; one that crashes or is killed does not."""

    mirror_id: str
    host: str
    pid: int
    version: str
    started_at: str  # ISO 8601 UTC
    updated_at: str
    consistent_lsn: str | None  # every streaming table equals the source there
    stream_last_lsn: str | None  # the commit LSN of CDC's last message
    lag_bytes: int | None  # stream_last_lsn - consistent_lsn
    lag_seconds: float  # behind the source's commit time (the status line's)
    tables: dict[str, MirrorTableState]
    stopped_at: NotRequired[str]  # ISO 8601 UTC: its last value, it stopped on purpose


class SnapshotChunk(TypedDict):
    """``init.snap.{table}.{snapshot_id}.{chunk}``: up to CDC_CHUNK_ROWS rows."""

    table: str
    operation: Literal["snapshot"]
    snapshot_id: str
    chunk: int  # partition * 1_000_000 + n: unique, not contiguous
    lsn: str  # the snapshot LSN
    data: list[Row]
    partition: int
    schema_fingerprint: str
    # [row index in data, column name] of values sent as text (no converter accepted them)
    raw_cells: NotRequired[list[list[Any]]]


class SnapshotMetaPayload(TypedDict):
    """``init.meta.{table}``, published after every chunk of the snapshot is stored."""

    snapshot_id: str
    lsn: str  # the cutover LSN: apply CDC events with commit_lsn >= lsn
    timestamp: int
    batch_count: int  # chunks to load
    row_count: int
    table: str
    cdc_stream: str
    cdc_start_seq: int | None  # the watermark marker's sequence: read CDC from here
    watermark_subject: str
    watermark_lsn: str
    cutover_rule: str  # the rule below, in words
    format: Literal["msgpack", "json"]
    compression: str | None  # "zstd" or None
    dictionary_id: int | None
    dictionary_bucket: str | None
    dictionary_key: str | None
    schema_fingerprint: str
    table_schema: TableSchemaValue  # the rows' shape (the KV value may be newer)
    partitions: int
    chunks: list[list[int]]  # [partition, first chunk number, chunk count]
    bytes_raw: int
    bytes_compressed: int
    duration_seconds: float
    chunk_subject_prefix: str


class RepairMetaPayload(SnapshotMetaPayload):
    """``init.repair.{table}``: the meta of a repair snapshot, which holds the rows of some
    buckets only (docs/verification.md Part 2, item 4): a snapshot meta, ``bits`` and the
    buckets (a list, or a bitmap when they are more than a list of 14 bits)."""

    bits: int
    # exactly one of: sorted, the rows whose key hash's top ``bits`` bits are one of these
    # (at most META_MAX_LISTED_BUCKETS of them) ...
    buckets: NotRequired[list[int]]
    bucket_bitmap: NotRequired[str]  # ... or more, as wire.bucket_sets' bitmap


class SnapshotReply(TypedDict):
    """The reply to a snapshot request with ``reply_to`` (status ``done``)."""

    snapshot_id: str
    lsn: str
    cdc_stream: str
    cdc_start_seq: int | None
    meta_subject: str
    meta_seq: int
    reused: bool


def fields(payload_type: type) -> tuple[str, ...]:
    """The fields of ``payload_type`` always present, in the order they are written."""
    required = payload_type.__required_keys__  # type: ignore[attr-defined]
    return tuple(name for name in payload_type.__annotations__ if name in required)


def optional_fields(payload_type: type) -> frozenset[str]:
    return frozenset(payload_type.__optional_keys__)  # type: ignore[attr-defined]


def in_field_order(payload_type: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as a ``payload_type`` payload: its fields in their order; ValueError naming
    what is missing or unknown (a writer drifting from the contract fails here, not in a
    consumer)."""
    names = fields(payload_type)
    optional = optional_fields(payload_type)
    missing = [name for name in names if name not in values]
    unknown = [name for name in values if name not in names and name not in optional]
    if missing or unknown:
        raise ValueError(f"{payload_type.__name__}: missing {missing}, unknown {unknown}")
    ordered = {name: values[name] for name in names}
    ordered.update((name, value) for name, value in values.items() if name in optional)
    return ordered


CHANGE_EVENT_FIELDS = fields(ChangeEvent)
SCHEMA_EVENT_FIELDS = fields(SchemaEvent)
SNAPSHOT_CHUNK_FIELDS = fields(SnapshotChunk)
SNAPSHOT_META_FIELDS = fields(SnapshotMetaPayload)
REPAIR_META_FIELDS = fields(RepairMetaPayload)
VERIFICATION_DIGEST_FIELDS = fields(VerificationDigestPayload)
MIRROR_STATE_FIELDS = fields(MirrorStateValue)
TABLE_SCHEMA_FIELDS = fields(TableSchemaValue)
COLUMN_FIELDS = tuple(field.name for field in dataclass_fields(Column))


def schema_fingerprint(columns: Sequence[tuple[str, int, int, bool]],
                       replica_identity: str) -> str:
    """Stable id of a table's shape: (name, type oid, type modifier, is_key) per column."""
    canonical = json.dumps([list(c) for c in columns] + [replica_identity],
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def commit_ts_epoch(commit_ts: str) -> float:
    """An event's ``commit_ts`` (``2025-12-08T13:45:21.719719Z``) -> seconds since the epoch;
    one PostgreSQL cannot express in a datetime (infinity, year 0) -> now."""
    try:
        return datetime.fromisoformat(commit_ts).timestamp()
    except ValueError:
        return time.time()
