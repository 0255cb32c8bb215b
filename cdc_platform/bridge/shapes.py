"""A table's new shape against what consumers were last told of it (docs/wire-contract.md "Schema
changes"). Pure: the bridge reads the catalog and the stream, this decides.

A pgoutput Relation message names the columns as they were at its point in the WAL, but not
their identity (``attnum``, which a RENAME keeps) nor the table's storage (``relfilenode``,
which a rewrite or a TRUNCATE replaces). Both come from the catalog, read when the bridge
reaches the message: later, so the table may have been altered again since. Whatever the
catalog says is checked against the Relation message and the announced shape; what it cannot
settle is announced with ``needs_snapshot`` and ``min_snapshot_lsn`` at the catalog read (a
snapshot from there holds every row as the catalog showed the table), never as a guess.

Rewrites are seen at Relation messages: every rewrite (``ALTER COLUMN ... TYPE``, a volatile
``DEFAULT``, ``VACUUM FULL``, ``CLUSTER``) and every TRUNCATE invalidates the table, and
pgoutput then sends a Relation message before the table's next change, the same columns
again included (PostgreSQL 15 to 18, checked by the integration tests). So one catalog read
per Relation message, none per transaction, compares the storage before every change that
could follow a rewrite.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cdc_platform.bridge.events import SchemaEventSlot
from cdc_platform.postgres.catalog import CatalogColumn, TableSchema
from cdc_platform.protocol.changes import ChangeRecord
from cdc_platform.protocol.pgoutput import Relation
from cdc_platform.protocol.values import TypeRegistry
from cdc_platform.wire import Column


@dataclass(frozen=True)
class AnnouncedShape:
    """What consumers were last told of a table: its last schema event, or before the first
    one the shape published when the bridge first saw the table (``fingerprint`` None)."""

    fingerprint: str | None
    storage: int  # relfilenode; 0: unknown
    columns: tuple[Column, ...]

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> AnnouncedShape:
        """A schema event's (KeyError, TypeError or ValueError when it is not one)."""
        return cls(str(event["schema_fingerprint"]), int(event.get("relfilenode") or 0),
                   tuple(Column.from_wire(c) for c in event["table_schema"]["columns"]))

    @classmethod
    def of(cls, schema: TableSchema, fingerprint: str | None = None,
           storage: int | None = None) -> AnnouncedShape:
        """``schema`` announced (``fingerprint`` None: published when the bridge first saw
        the table, which consumers bootstrap from snapshots taken from then on)."""
        return cls(fingerprint, schema.storage if storage is None else storage,
                   schema.columns)


@dataclass(frozen=True)
class ShapeChange:
    """The Relation message's shape resolved against the catalog and the announced shape."""

    schema: TableSchema  # columns with the catalog's details and identities (0: unknown)
    reason: str | None  # why rows before this change cannot be known from the stream
    storage: int  # the storage consumers hold after this change


def resolve_shape(relation: Relation, change: ChangeRecord, current: TableSchema | None,
                  announced: AnnouncedShape | None,
                  truncated_later: Collection[int] = (),
                  types: TypeRegistry | None = None) -> ShapeChange:
    """``relation`` (preceding ``change``) as the schema to announce, given the catalog read
    since (``current``; None: the table is gone from the publication) and ``announced``;
    ``truncated_later``: the xids of the TRUNCATEs of the table that the bridge has read after
    ``change``; ``types``: what the bridge knows of the relation's types."""
    attnums, ambiguous = column_identities(relation, current, announced)
    storage, rewritten = _storage(change, current, announced, truncated_later)
    schema = dataclasses.replace(schema_from_relation(relation, current, attnums, types),
                                 storage=storage)
    return ShapeChange(schema, rewritten or ambiguous, storage)


def truncates_of(slot: SchemaEventSlot, slots: Sequence[SchemaEventSlot]) -> set[int]:
    """The xids of the TRUNCATEs of ``slot``'s table among ``slots`` (what the bridge read)."""
    return {other.change.xid for other in slots if other.change.operation == "TRUNCATE"
            and other.relation.relation_id == slot.relation.relation_id}


def storage_unsettled(slot: SchemaEventSlot, current: TableSchema | None,
                      announced: AnnouncedShape | None,
                      slots: Sequence[SchemaEventSlot]) -> bool:
    """Whether the storage the catalog shows may come from a TRUNCATE the bridge has not read
    yet (then it reads on, past the catalog read, before it decides: see :func:`_storage`)."""
    if current is None or announced is None or not current.storage or not announced.storage:
        return False
    return current.storage != announced.storage and not (
        slot.change.operation == "TRUNCATE" and current.storage_xmin == slot.change.xid) \
        and current.storage_xmin not in truncates_of(slot, slots)


def _storage(change: ChangeRecord, current: TableSchema | None,
             announced: AnnouncedShape | None,
             truncated_later: Collection[int]) -> tuple[int, str | None]:
    """The table's storage from here, and why it means a rewrite (None: it does not).

    The catalog is read after ``change``: a new storage may be a rewrite before it, or any
    change of storage since. The transaction that last wrote the table's pg_class row tells
    a TRUNCATE's storage apart: when it is this TRUNCATE, or one the bridge read after this
    change (having read on past the catalog read: any rewrite hidden behind it changed only
    rows that TRUNCATE empties), nothing was rewritten that consumers keep. Anything else is
    taken for a rewrite (VACUUM FULL and CLUSTER included: a snapshot too many).
    """
    now = current.storage if current is not None else 0
    before = announced.storage if announced is not None else 0
    if not now or not before or now == before:
        return now or before, None
    assert current is not None
    if change.operation == "TRUNCATE" and current.storage_xmin == change.xid:
        return now, None  # every consumer empties the table here: the new baseline
    if current.storage_xmin in truncated_later:
        return before, None  # (that TRUNCATE's own check moves the baseline)
    return now, (f"the table was rewritten (relfilenode {before} -> {now}: a column type "
                 "change, a volatile default, VACUUM FULL or CLUSTER), which logical decoding "
                 "does not emit")


def column_identities(relation: Relation, current: TableSchema | None,
                      announced: AnnouncedShape | None) -> tuple[list[int], str | None]:
    """Each Relation column's ``attnum`` (0: unknown), and why they are ambiguous (None:
    they are not).

    The Relation's columns are in attnum order, and a column added later gets a higher attnum
    than any before it; a column, once dropped, never comes back. The catalog is matched by
    name and type; each way a later ALTER could make that match wrong (a column renamed or
    retyped again, names swapped, a column dropped and another added under its name or type)
    contradicts one of those rules or the announced identities, and is reported instead.
    """
    columns = relation.columns
    names_types = [(c.name, c.type_oid) for c in columns]
    catalog = {(c.name, c.type_oid, c.type_modifier): c.attnum
               for c in (current.columns if current is not None else ())}
    mapped = [catalog.get((c.name, c.type_oid, c.type_modifier)) for c in columns]
    previous = announced.columns if announced is not None else ()
    known_before = bool(previous) and all(c.attnum for c in previous)
    if known_before and [(c.name, c.type_oid) for c in previous] == names_types:
        # the announced columns: a resent Relation message, or only keys/identity changed
        attnums = [c.attnum for c in previous]
        moved = [c.name for c, now, then in zip(columns, mapped, attnums, strict=True)
                 if now is not None and now != then]
        if moved:
            return attnums, (f"column(s) {', '.join(moved)} were dropped and added again under "
                             "the same name and type: whether before or after this change "
                             "cannot be known from the catalog")
        return attnums, None
    if current is None:
        # the table left the publication (or was dropped) since: no consumer can take a
        # snapshot of it any more, so the columns go by their names, as they did before
        return [0] * len(columns), None
    unmatched = [c.name for c, attnum in zip(columns, mapped, strict=True) if attnum is None]
    if unmatched:
        return [attnum or 0 for attnum in mapped], (
            f"column(s) {', '.join(unmatched)} were renamed, retyped or dropped again before "
            "the bridge read the catalog: which columns they are, and what existing rows "
            "hold, cannot be known")
    found: list[int] = [attnum for attnum in mapped if attnum is not None]
    ambiguous = _contradiction(found, current, previous if known_before else (),
                               [c.type_oid for c in columns])
    return found, ambiguous


def _contradiction(attnums: Sequence[int], current: TableSchema | None,
                   previous: Sequence[Column], type_oids: Sequence[int]) -> str | None:
    """Why identities matched by name cannot be the columns of the Relation message."""
    if any(later <= earlier for earlier, later in itertools.pairwise(attnums)):
        return ("columns were renamed again before the bridge read the catalog (their names "
                "no longer follow their order)")
    present = set(attnums)
    in_catalog = {c.attnum: c.name for c in (current.columns if current is not None else ())}
    before = {c.attnum: c for c in previous}
    # a column that existed at this change (it is older than one of its columns, or was
    # announced and still exists) must be one of the Relation's
    missing = [name for attnum, name in in_catalog.items() if attnum not in present
               and (attnum < max(attnums, default=0) or attnum in before)]
    if missing:
        return (f"column(s) {', '.join(missing)} exist but are not in the change's shape: "
                "columns were renamed again before the bridge read the catalog")
    by_name = {c.name: c for c in previous}
    gone_types = {c.type_oid for attnum, c in before.items()
                  if attnum not in present and attnum not in in_catalog}
    for attnum, type_oid in zip(attnums, type_oids, strict=True):
        name = in_catalog[attnum]
        was = by_name.get(name)
        if was is not None and was.type_oid == type_oid and was.attnum != attnum:
            return (f"column {name} was dropped and added again under the same name and type: "
                    "whether before or after this change cannot be known from the catalog")
        if previous and attnum not in before and type_oid in gone_types:
            return (f"column {name} is new and a column of its type is gone: from the catalog, "
                    "a rename followed by a DROP and an ADD cannot be told from it")
    return None


def schema_from_relation(relation: Relation, current: TableSchema | None,
                         attnums: Sequence[int],
                         types: TypeRegistry | None = None) -> TableSchema:
    """The Relation message's shape (authoritative for the columns at this point of the WAL)
    with what the catalog adds for each column it identifies: nullability, default, missing
    value, primary key membership. A column's base type (and whether it is an array type) is
    the catalog's, or for a column it does not identify what ``types`` resolves (without
    them: its type)."""
    types = types or TypeRegistry()
    by_attnum = {c.attnum: c for c in current.columns} if current else {}
    columns = []
    for position, (column, attnum) in enumerate(zip(relation.columns, attnums, strict=True),
                                                 start=1):
        known: CatalogColumn | None = by_attnum.get(attnum) if attnum else None
        if known is not None and known.type_oid != column.type_oid:
            known = None  # the catalog's column is another one now: only what pgoutput says
        columns.append(CatalogColumn(
            name=column.name, position=position,
            data_type=known.data_type if known else str(column.type_oid),
            is_nullable=known.is_nullable if known else True,
            column_default=known.column_default if known else None,
            type_oid=column.type_oid, type_modifier=column.type_modifier,
            is_key=column.is_key,
            is_primary_key=known.is_primary_key if known else False,
            missing_value=known.missing_value if known else None,
            attnum=attnum,
            base_type_oid=known.base_type_oid if known else types.base_type_oid(
                column.type_oid),
            is_array=known.is_array if known else types.is_array(column.type_oid)))
    return dataclasses.replace(
        TableSchema(relation.namespace, relation.name, relation.relation_id,
                    relation.replica_identity, tuple(columns)),
        storage=current.storage if current else 0,
        read_at_lsn=current.read_at_lsn if current else 0)
