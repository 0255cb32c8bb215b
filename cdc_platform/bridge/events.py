"""Change records -> JetStream messages, in the two documented message modes.

Pure: no I/O. ``MessageBuilder`` keeps per-relation wire names and schema fingerprints (from
Relation messages) and turns the assembler's events into :class:`OutgoingMessage` lists.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from cdc_platform.lsn import format_lsn
from cdc_platform.naming import wire_name
from cdc_platform.protocol.changes import (
    ChangeRecord,
    LogicalMessageReceived,
    RelationChanged,
    RelationResent,
    TransactionCommitted,
)
from cdc_platform.protocol.pgoutput import Relation
from cdc_platform.publishing.messages import OutgoingMessage
from cdc_platform.speedups import compiled_twin
from cdc_platform.wire import (
    HEADER_SCHEMA_FINGERPRINT,
    SCHEMA_OPERATION,
    WATERMARK_PREFIX,
    batch_msg_id,
    cdc_batch_subject,
    cdc_schema_subject,
    cdc_subject,
    encoder,
    schema_event_msg_id,
    schema_fingerprint,
    watermark_msg_id,
    watermark_subject,
)

log = logging.getLogger(__name__)

MessageMode = Literal["per-change", "batched"]
# What a snapshot id may be (snapshot.job checks the same): one NATS subject token.
_SNAPSHOT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
BATCH_MAX_EVENTS = 500
# LSN -> text: the compiled formatter when built (a row inserted by INSERT ... SELECT has an
# LSN of its own, so the text is made once per change).
lsn_text: Callable[[int], str] = format_lsn
# A change's msgpack map written around fields already packed (prefix, its item count, then
# key, value, ...): compiled only; the pure code packs the whole dict instead.
pack_map: Callable[[bytes, int, tuple[Any, ...]], bytes] | None = None
_ARRAY32 = b"\xdd"  # msgpack array32 header: batches are the already-packed events joined


def relation_fingerprint(relation: Relation) -> str:
    return schema_fingerprint(
        [(c.name, c.type_oid, c.type_modifier, c.is_key) for c in relation.columns],
        relation.replica_identity)


@dataclass(slots=True)
class _RelationInfo:
    wire_name: str
    fingerprint: str
    headers: tuple[tuple[str, str], ...] = ()
    key_columns: tuple[str, ...] = ()  # the replica identity: named in error lines

    def __post_init__(self) -> None:
        self.headers = ((HEADER_SCHEMA_FINGERPRINT, self.fingerprint),)


@dataclass(slots=True)
class _HeldBatch:
    """A closed batch waiting to be sent (its table's last of the transaction so far)."""

    subject: str
    commit_lsn: int
    first: int
    last: int
    fingerprint: str
    events: list[bytes]  # packed events
    last_record: ChangeRecord


class _Shared(NamedTuple):
    """What every change of one table and operation in one transaction shares, looked up
    once per change: one dict lookup instead of one per field."""

    subject: str
    commit_lsn_text: str
    headers: tuple[tuple[str, str], ...]
    info: _RelationInfo
    packed_count: int      # with the compiled writer: how many shared fields, packed ...
    packed: bytes          # ... as these bytes; (0, b"") otherwise


@dataclass(frozen=True, slots=True)
class SchemaEventSlot:
    """Where a schema event goes in ``BuiltBatch.messages`` (a placeholder there): the
    bridge looks up what the catalog adds (missing values, rewrites), then fills it with
    :meth:`MessageBuilder.schema_event` or drops it (the shape is the one last published)."""

    index: int
    relation: Relation
    change: ChangeRecord  # the first change that uses the shape


@dataclass(slots=True)
class BuiltBatch:
    """What one read batch turns into."""

    messages: list[OutgoingMessage]
    position: int | None  # end LSN of the last transaction fully contained so far
    changed_relations: list[Relation]
    watermarks: list[dict[str, Any]]
    changes: int
    counts: dict[tuple[str, str], int]  # (table wire name, op) -> changes, for metrics
    last_commit_ts: str | None  # of the transaction ``position`` ends
    transactions: int = 0  # transactions whose commit this batch holds
    schema_events: list[SchemaEventSlot] = field(default_factory=list)

    def extend(self, later: BuiltBatch) -> None:
        """Append what the next read batch built (the bridge reading ahead)."""
        offset = len(self.messages)
        self.messages.extend(later.messages)
        self.schema_events.extend(dataclasses.replace(slot, index=slot.index + offset)
                                  for slot in later.schema_events)
        if later.position is not None:
            self.position, self.last_commit_ts = later.position, later.last_commit_ts
        self.changed_relations.extend(later.changed_relations)
        self.watermarks.extend(later.watermarks)
        self.changes += later.changes
        for key, count in later.counts.items():
            self.counts[key] = self.counts.get(key, 0) + count
        self.transactions += later.transactions


class MessageBuilder:
    def __init__(self, fmt: Literal["msgpack", "json"] = "msgpack",
                 mode: MessageMode = "per-change", batch_max_events: int = BATCH_MAX_EVENTS,
                 batch_max_bytes: int = 900 * 1024, compiled: bool = True) -> None:
        """``compiled``: write msgpack with the compiled twin when it is built (False: the
        pure-Python writer; the same bytes)."""
        self.format = fmt
        self.mode = mode
        self.encode = encoder(fmt)
        self.batch_max_events = batch_max_events
        self.batch_max_bytes = batch_max_bytes
        self._relations: dict[int, _RelationInfo] = {}
        # the open batch (batched mode): events of one table/op within one transaction
        self._batch_key: tuple[int, str] | None = None
        self._batch_events: list[bytes] = []
        self._batch_bytes = 0
        self._batch_first = 0
        self._batch_last = 0
        self._batch_commit_lsn = 0
        self._batch_fingerprint = ""
        self._batch_subject = ""
        self._lsn_cache: tuple[int, str] = (-1, "")
        self._commit_cache: tuple[int, str] = (-1, "")
        # The compiled msgpack writer, and what every change of one table and operation in
        # one transaction shares (see _Shared).
        self._pack_map = pack_map if compiled and fmt == "msgpack" else None
        self._shared: dict[tuple[int, str, int], _Shared] = {}
        self._raw_reported: dict[tuple[int, tuple[str, ...]], float] = {}
        # End-of-transaction marks (docs/wire-contract.md "Transactions"): the last change of each
        # table in the open transaction is held back until its Commit, then sent with ``tx_tables``.
        self._held: dict[int, ChangeRecord] = {}  # per-change: relation id -> last change
        self._held_batches: dict[int, _HeldBatch] = {}  # batched: relation id -> last batch
        self._tx_counts: dict[int, int] = {}  # relation id -> changes in the transaction
        self._batch_last_record: ChangeRecord | None = None
        # Relations whose new shape goes out as a schema event before their next change.
        self._new_shapes: dict[int, Relation] = {}

    def reset(self) -> None:
        """A new replication session: PostgreSQL resends from the last confirmed commit, so
        an open batch, and the changes held for the end-of-transaction mark, will come
        again. Publishing them would store them twice under another message id (the replay
        cuts 500-999 where it held 500-699)."""
        self._batch_events = []
        self._batch_bytes = 0
        self._batch_key = None
        self._held.clear()
        self._held_batches.clear()
        self._tx_counts.clear()
        self._new_shapes.clear()  # the replay sends its Relation messages again

    # -- relation bookkeeping ----------------------------------------------------------------
    def register(self, relation: Relation) -> None:
        self._relations[relation.relation_id] = _RelationInfo(
            wire_name(relation.namespace, relation.name), relation_fingerprint(relation),
            key_columns=tuple(c.name for c in relation.columns if c.is_key))
        # A table altered (or renamed) mid-transaction: later changes carry the new name and
        # fingerprint, so nothing packed for the old shape may be reused.
        self._shared.clear()

    def _info(self, record: ChangeRecord) -> _RelationInfo:
        info = self._relations.get(record.relation_id)
        if info is None:  # pgoutput always sends Relation first; be safe anyway
            info = _RelationInfo(wire_name(record.schema, record.table), "")
            self._relations[record.relation_id] = info
        return info

    # -- events ----------------------------------------------------------------------------
    def _lsn_text(self, lsn: int) -> str:
        """LSN text, cached: rows of one multi-insert record share an LSN, and every change
        of a transaction shares its commit LSN (format_lsn was 8% of the bridge's time)."""
        cached = self._lsn_cache
        if cached[0] != lsn:
            cached = self._lsn_cache = (lsn, lsn_text(lsn))
        return cached[1]

    def _commit_lsn_text(self, commit_lsn: int) -> str:
        cached = self._commit_cache
        if cached[0] != commit_lsn:
            cached = self._commit_cache = (commit_lsn, lsn_text(commit_lsn))
        return cached[1]

    @staticmethod
    def _static_fields(record: ChangeRecord, info: _RelationInfo, subject: str,
                       commit_lsn_text: str) -> dict[str, Any]:
        """The fields every change of one table and operation in one transaction shares."""
        return {
            "table": info.wire_name,
            "schema": record.schema,
            "operation": record.operation,
            "relation_id": record.relation_id,
            "commit_lsn": commit_lsn_text,
            "xid": record.xid,
            "commit_ts": record.commit_ts,
            "subject": subject,
            "schema_fingerprint": info.fingerprint,
        }

    def _change_fields(self, record: ChangeRecord, msg_id: str) -> tuple:
        """The fields of this change: key, value, key, value, ..."""
        operation = record.operation
        fields: tuple = (
            "lsn", self._lsn_text(record.lsn),
            "ordinal", record.ordinal,
            "msg_id", msg_id,
            # DELETE: the old key/row, as the seed bridge sent it in "data"
            "data", record.old if operation == "DELETE" else record.new,
            "unchanged_toast", record.unchanged_toast,
        )
        if record.old is not None:
            fields += ("old", record.old, "old_kind", record.old_kind)
        if operation == "TRUNCATE":
            fields += ("cascade", record.cascade, "restart_identity", record.restart_identity)
        if record.raw_columns:
            fields += ("raw_columns", list(record.raw_columns))
            self._report_raw(record)
        return fields

    def _report_raw(self, record: ChangeRecord) -> None:
        """One error line per table and columns a minute: the value went out as text."""
        key = (record.relation_id, record.raw_columns)
        now = time.monotonic()
        if now - self._raw_reported.get(key, -math.inf) < 60.0:
            return
        self._raw_reported[key] = now
        row = record.old if record.operation == "DELETE" else record.new
        info = self._relations.get(record.relation_id)
        key_columns = info.key_columns if info is not None else ()
        shown_key = {name: (row or {}).get(name) for name in key_columns}
        log.error("%s.%s: no converter accepts the value of column(s) %s in the %s at "
                  "commit %s with key %s: sent as the text PostgreSQL printed, listed in "
                  "the event's raw_columns", record.schema, record.table,
                  ", ".join(record.raw_columns), record.operation,
                  self._commit_lsn_text(record.commit_lsn), shown_key)

    def event_map(self, record: ChangeRecord, info: _RelationInfo, subject: str,
                  msg_id: str, commit_lsn_text: str) -> dict[str, Any]:
        """The event as a map: the shared fields first, then this change's."""
        event = self._static_fields(record, info, subject, commit_lsn_text)
        fields = self._change_fields(record, msg_id)
        for index in range(0, len(fields), 2):
            event[fields[index]] = fields[index + 1]
        return event

    def _shared_of(self, record: ChangeRecord) -> _Shared:
        """The :class:`_Shared` of ``record``'s table, operation and transaction (cached)."""
        key = (record.relation_id, record.operation, record.commit_lsn)
        shared = self._shared.get(key)
        if shared is None:
            if len(self._shared) >= 256:
                self._shared.clear()
            info = self._info(record)
            subject_of = cdc_subject if self.mode == "per-change" else cdc_batch_subject
            subject = subject_of(info.wire_name, record.operation)
            commit_text = self._commit_lsn_text(record.commit_lsn)
            count, packed = 0, b""
            if self._pack_map is not None:
                fields = self._static_fields(record, info, subject, commit_text)
                count, packed = len(fields), b"".join(
                    self.encode(name) + self.encode(value) for name, value in fields.items())
            shared = self._shared[key] = _Shared(subject, commit_text, info.headers, info,
                                                 count, packed)
        return shared

    def encode_event(self, record: ChangeRecord, shared: _Shared, msg_id: str) -> bytes:
        """``encode(event_map(...))``; with the compiled twin and msgpack, the shared
        fields are packed once per table, operation and transaction and the same bytes are
        written around them."""
        if self._pack_map is None:
            return self.encode(self.event_map(record, shared.info, shared.subject, msg_id,
                                              shared.commit_lsn_text))
        return self._pack_map(shared.packed, shared.packed_count,
                              self._change_fields(record, msg_id))

    def build(self, events: Iterable[Any]) -> BuiltBatch:
        messages: list[OutgoingMessage] = []
        position: int | None = None
        changed: list[Relation] = []
        watermarks: list[dict[str, Any]] = []
        changes = 0
        # Changes come in runs of one table and operation: counted per run, not per change.
        runs: list[tuple[int, str, int]] = []   # (relation id, operation, changes before)
        run_relation, run_operation = -1, ""
        last_commit_ts = None
        transactions = 0
        per_change = self.mode == "per-change"
        single, append = self._single, messages.append
        held, tx_counts = self._held, self._tx_counts
        new_shapes = self._new_shapes
        schema_events: list[SchemaEventSlot] = []
        for event in events:
            kind = type(event)
            if kind is ChangeRecord:
                if event.relation_id != run_relation or event.operation != run_operation:
                    run_relation, run_operation = event.relation_id, event.operation
                    runs.append((run_relation, run_operation, changes))
                changes += 1
                relation_id = event.relation_id
                if new_shapes and relation_id in new_shapes:
                    if not per_change:  # the open batch may be this table's (old shape)
                        self._close_batch(messages)
                    schema_events.append(SchemaEventSlot(
                        len(messages), new_shapes.pop(relation_id), event))
                    append(OutgoingMessage("", "", b""))  # placeholder, filled by the bridge
                tx_counts[relation_id] = tx_counts.get(relation_id, 0) + 1
                if per_change:  # the table's previous change is not its last: send it
                    previous = held.get(relation_id)
                    held[relation_id] = event
                    if previous is not None:
                        append(single(previous))
                else:
                    self._add_to_batch(event, messages)
            elif kind is TransactionCommitted:
                self._end_transaction(messages)
                position = event.end_lsn
                last_commit_ts = event.commit_ts
                transactions += 1
            elif kind is RelationChanged:
                # what was built with the old shape goes now (a change of the table follows,
                # so it is not the table's last)
                self._release(event.relation.relation_id, messages)
                self.register(event.relation)
                changed.append(event.relation)
                self._new_shapes[event.relation.relation_id] = event.relation
            elif kind is RelationResent:
                # the same columns, but the table was invalidated (a rewrite or a TRUNCATE
                # among the possible causes): the bridge checks its storage before its next
                # change, in a slot it drops when nothing changed
                self._release(event.relation.relation_id, messages)
                new_shapes.setdefault(event.relation.relation_id, event.relation)
            elif kind is LogicalMessageReceived and event.prefix == WATERMARK_PREFIX:
                if not per_change:
                    self._close_batch(messages)
                mark = self._watermark(event)
                if mark is not None:
                    watermarks.append(mark)
                    messages.append(OutgoingMessage(
                        mark["subject"], mark["msg_id"], self.encode(mark)))
        counts: dict[tuple[str, str], int] = {}
        for index, (relation_id, operation, before) in enumerate(runs):
            after = runs[index + 1][2] if index + 1 < len(runs) else changes
            info = self._relations.get(relation_id)
            key = (info.wire_name if info is not None else str(relation_id), operation)
            counts[key] = counts.get(key, 0) + after - before
        return BuiltBatch(messages, position, changed, watermarks, changes, counts,
                          last_commit_ts, transactions, schema_events)

    def schema_event(self, slot: SchemaEventSlot, table_schema: dict[str, Any], *,
                     previous_fingerprint: str | None, needs_snapshot: bool,
                     reason: str | None, storage: int = 0,
                     min_snapshot_lsn: int = 0) -> OutgoingMessage:
        """The schema event of ``slot`` (docs/wire-contract.md "Schema changes"): the envelope of
        the change it precedes, operation ``SCHEMA``, and the table's KV schema value."""
        record, relation = slot.change, slot.relation
        # the builder's relation info may already hold a later shape: use the slot's
        table = wire_name(relation.namespace, relation.name)
        fingerprint = relation_fingerprint(relation)
        subject = cdc_schema_subject(table)
        msg_id = schema_event_msg_id(record.commit_lsn, record.ordinal)
        event = {
            "table": table,
            "schema": record.schema,
            "operation": SCHEMA_OPERATION,
            "relation_id": record.relation_id,
            "commit_lsn": self._commit_lsn_text(record.commit_lsn),
            "xid": record.xid,
            "commit_ts": record.commit_ts,
            "subject": subject,
            "schema_fingerprint": fingerprint,
            "lsn": self._lsn_text(record.lsn),
            "ordinal": record.ordinal,
            "msg_id": msg_id,
            "previous_fingerprint": previous_fingerprint,
            "needs_snapshot": needs_snapshot,
            "reason": reason,
            "relfilenode": storage,
            "min_snapshot_lsn": lsn_text(max(min_snapshot_lsn, record.commit_lsn)),
            "table_schema": table_schema,
        }
        return OutgoingMessage(subject, msg_id, self.encode(event),
                               ((HEADER_SCHEMA_FINGERPRINT, fingerprint),))

    def _single(self, record: ChangeRecord) -> OutgoingMessage:
        shared = self._shared.get((record.relation_id, record.operation, record.commit_lsn))
        if shared is None:
            shared = self._shared_of(record)
        msg_id = f"{shared.commit_lsn_text}:{record.ordinal}"  # = wire.change_msg_id, inlined
        if self._pack_map is None:
            payload = self.encode(self.event_map(record, shared.info, shared.subject, msg_id,
                                                 shared.commit_lsn_text))
        else:
            payload = self._pack_map(shared.packed, shared.packed_count,
                                     self._change_fields(record, msg_id))
        return OutgoingMessage(shared.subject, msg_id, payload, shared.headers)

    # -- batched mode ----------------------------------------------------------------------------
    def _add_to_batch(self, record: ChangeRecord, out: list[OutgoingMessage]) -> None:
        key = (record.relation_id, record.operation)
        if key != self._batch_key or record.commit_lsn != self._batch_commit_lsn:
            self._close_batch(out)
        shared = self._shared.get((record.relation_id, record.operation, record.commit_lsn))
        if shared is None:
            shared = self._shared_of(record)
        info, subject = shared.info, shared.subject
        packed = self.encode_event(record, shared, f"{shared.commit_lsn_text}:{record.ordinal}")
        if self._batch_events and (len(self._batch_events) >= self.batch_max_events
                                   or self._batch_bytes + len(packed) > self.batch_max_bytes):
            self._close_batch(out)  # cut by content only: a replay cuts the same batches
        if not self._batch_events:
            self._batch_key = key
            self._batch_commit_lsn = record.commit_lsn
            self._batch_first = record.ordinal
            self._batch_subject = subject
            self._batch_fingerprint = info.fingerprint
        self._batch_events.append(packed)
        self._batch_bytes += len(packed)
        self._batch_last = record.ordinal
        self._batch_last_record = record

    def _close_batch(self, out: list[OutgoingMessage]) -> None:
        """The open batch becomes its table's held batch (the previous one is sent): the
        table's last batch of the transaction waits for the Commit and its mark."""
        if not self._batch_events:
            self._batch_key = None
            return
        assert self._batch_key is not None and self._batch_last_record is not None
        relation_id = self._batch_key[0]
        previous = self._held_batches.get(relation_id)
        self._held_batches[relation_id] = _HeldBatch(
            self._batch_subject, self._batch_commit_lsn, self._batch_first, self._batch_last,
            self._batch_fingerprint, self._batch_events, self._batch_last_record)
        if previous is not None:
            out.append(self._batch_message(previous))
        self._batch_events = []
        self._batch_bytes = 0
        self._batch_key = None

    def _batch_message(self, batch: _HeldBatch) -> OutgoingMessage:
        if self.format == "msgpack":
            payload = _ARRAY32 + len(batch.events).to_bytes(4, "big") + b"".join(batch.events)
        else:
            payload = b"[" + b",".join(batch.events) + b"]"
        return OutgoingMessage(
            batch.subject, batch_msg_id(batch.commit_lsn, batch.first, batch.last), payload,
            ((HEADER_SCHEMA_FINGERPRINT, batch.fingerprint),))

    # -- end-of-transaction marks ------------------------------------------------------------
    def _release(self, relation_id: int, out: list[OutgoingMessage]) -> None:
        """Send what is held for ``relation_id`` unmarked (its shape is about to change)."""
        if self.mode == "per-change":
            record = self._held.pop(relation_id, None)
            if record is not None:
                out.append(self._single(record))
            return
        self._close_batch(out)  # a batch has one shape (fingerprint header)
        batch = self._held_batches.pop(relation_id, None)
        if batch is not None:
            out.append(self._batch_message(batch))

    def _end_transaction(self, out: list[OutgoingMessage]) -> None:
        """Each table's last change (or batch) of the transaction, with ``tx_tables``: every
        table the transaction changed and its number of changes, so a consumer of any set of
        tables knows it holds the whole transaction without waiting for the next."""
        if self.mode != "per-change":
            self._close_batch(out)
        if not self._tx_counts:
            return
        tables: dict[str, int] = {}
        for relation_id, count in self._tx_counts.items():
            info = self._relations.get(relation_id)
            name = info.wire_name if info is not None else str(relation_id)
            tables[name] = tables.get(name, 0) + count
        for record in self._held.values():
            shared = self._shared_of(record)
            msg_id = f"{shared.commit_lsn_text}:{record.ordinal}"
            out.append(OutgoingMessage(shared.subject, msg_id,
                                       self._marked_event(record, shared, msg_id, tables),
                                       shared.headers))
        for batch in self._held_batches.values():
            record = batch.last_record
            shared = self._shared_of(record)
            batch.events[-1] = self._marked_event(
                record, shared, f"{shared.commit_lsn_text}:{record.ordinal}", tables)
            out.append(self._batch_message(batch))
        self._held.clear()
        self._held_batches.clear()
        self._tx_counts.clear()

    def _marked_event(self, record: ChangeRecord, shared: _Shared, msg_id: str,
                      tables: dict[str, int]) -> bytes:
        event = self.event_map(record, shared.info, shared.subject, msg_id,
                               shared.commit_lsn_text)
        event["tx_tables"] = tables
        return self.encode(event)

    # -- snapshot watermarks --------------------------------------------------------------------
    def _watermark(self, event: LogicalMessageReceived) -> dict[str, Any] | None:
        """The marker of a snapshot's watermark message; None (and a warning) for a message
        under our prefix that is not one: it stays in the WAL for good, so raising here
        would stop the bridge at the same place after every restart."""
        try:
            details = json.loads(event.content)
            snapshot_id = details["snapshot_id"]
            valid = isinstance(snapshot_id, str) and _SNAPSHOT_ID.fullmatch(snapshot_id)
        except (ValueError, TypeError, KeyError):
            valid = False
        if not valid:
            log.warning("ignored a %s message at %s that is not a snapshot watermark: %r",
                        WATERMARK_PREFIX, format_lsn(event.lsn), event.content[:100])
            return None
        subject = watermark_subject(snapshot_id)
        return {
            "type": "watermark",
            "snapshot_id": snapshot_id,
            "table": details.get("table"),
            "lsn": format_lsn(event.lsn),
            "commit_lsn": format_lsn(event.commit_lsn) if event.commit_lsn else None,
            "subject": subject,
            "msg_id": watermark_msg_id(snapshot_id),
        }


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.bridge import events as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    lsn_text, pack_map = _twin.lsn_text, _twin.pack_map
