"""The mirrored tables themselves: created in a shape, and altered to follow a change of it
(docs/wire-contract.md "Schema changes") where an ALTER can; where none can (a column's type
or the key changed), the table needs a new snapshot instead."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from enum import Enum
from typing import Any

from cdc_platform.mirror.columns import TableShape, quote, to_sqlite


class SchemaChange(Enum):
    CREATED = "created"
    ALTERED = "altered"
    UNCHANGED = "unchanged"
    NEEDS_BOOTSTRAP = "needs_bootstrap"  # a change no ALTER can follow (a type change, a key)


def follow_shape(db: sqlite3.Connection, before: TableShape | None, shape: TableShape,
                 added_values: Mapping[str, Any] | None = None) -> SchemaChange:
    """Create the table in ``shape``, or alter it from ``before`` (the shape it was last
    given; None: not known) to ``shape``.

    ``added_values``: what existing rows read for a newly added column (the schema's
    missing value); a column added without one holds NULL in existing rows.
    """
    existing = _existing_columns(db, shape.table)
    renamed, replaced = _identities(before, shape)
    if not existing:
        create_table(db, shape)
        return SchemaChange.CREATED
    # A renamed column keeps its values: it is compared under its new name. A column
    # whose name another one takes (a renamed one, or a new one: dropped and added again)
    # is dropped.
    physical = existing
    retired = [name for name, _, _ in physical if name not in renamed
               and (name in renamed.values() or name in replaced)]
    existing = [(renamed.get(name, name), declared, pk) for name, declared, pk in physical
                if name not in retired]
    wanted = [(c.name, c.sqlite_type, c.is_primary_key) for c in shape.columns]
    if wanted == existing and not renamed:
        return SchemaChange.UNCHANGED
    old = {name: (declared, pk) for name, declared, pk in existing}
    new = {c.name: (c.sqlite_type, c.is_primary_key) for c in shape.columns}
    kept_same = all(new[name] == old[name] for name in old if name in new)
    key_same = ({n for n, (_, pk) in old.items() if pk}
                == {n for n, (_, pk) in new.items() if pk})
    retired_key = any(pk for name, _, pk in physical if name in retired)
    if not kept_same or not key_same or retired_key:
        return SchemaChange.NEEDS_BOOTSTRAP
    if not shape.key_columns:  # (SQLite drops no indexed column: made again below)
        drop_lookup(db, shape.table)
    for name in [*retired, *(name for name in old if name not in new)]:
        db.execute(f"ALTER TABLE {quote(shape.table)} DROP COLUMN {quote(name)}")
    _rename_columns(db, shape.table, renamed)
    for column in shape.columns:
        if column.name not in old:
            db.execute(f"ALTER TABLE {quote(shape.table)} ADD COLUMN "
                       f"{quote(column.name)} {column.sqlite_type}".rstrip())
            value = (added_values or {}).get(column.name)
            if value is not None:
                db.execute(f"UPDATE {quote(shape.table)} SET {quote(column.name)} = ?",
                           (to_sqlite(value),))
    if not shape.key_columns:
        create_lookup(db, shape)
    # SQLite appends added columns; a column order that differs from the source's (a
    # column dropped and added under the same name) is still the same set of values.
    return SchemaChange.ALTERED


def create_table(db: sqlite3.Connection, shape: TableShape) -> None:
    columns = ", ".join(f"{quote(c.name)} {c.sqlite_type}".rstrip() for c in shape.columns)
    key = shape.key_columns
    if key:
        columns += f", PRIMARY KEY ({', '.join(quote(name) for name in key)})"
    db.execute(f"CREATE TABLE {quote(shape.table)} ({columns})")
    if not key:
        create_lookup(db, shape)


def create_lookup(db: sqlite3.Connection, shape: TableShape) -> None:
    """Without a key, updates and deletes name a row by its values (REPLICA IDENTITY
    FULL): an index on a few of them spares a full scan per change."""
    lookup = [c.name for c in shape.columns if c.sqlite_type != "BLOB"][:3]
    if lookup:
        db.execute(
            f"CREATE INDEX {quote(_lookup_index(shape.table))} ON "
            f"{quote(shape.table)} ({', '.join(quote(name) for name in lookup)})")


def drop_lookup(db: sqlite3.Connection, table: str) -> None:
    db.execute(f"DROP INDEX IF EXISTS {quote(_lookup_index(table))}")


def _lookup_index(table: str) -> str:
    return table + " (row lookup)"


def _existing_columns(db: sqlite3.Connection, table: str) -> list[tuple[str, str, bool]]:
    rows = db.execute(f"PRAGMA table_info({quote(table)})").fetchall()
    return [(name, declared, bool(pk)) for _, name, declared, _, _, pk in rows]


def _rename_columns(db: sqlite3.Connection, table: str, renamed: Mapping[str, str]) -> None:
    """Rename in place, through names of their own first (``a -> b, b -> a`` works)."""
    steps = {old: f"_cdc_renaming_{index}" for index, old in enumerate(renamed)}
    for old, step in steps.items():
        db.execute(f"ALTER TABLE {quote(table)} RENAME COLUMN {quote(old)} TO "
                   f"{quote(step)}")
    for old, step in steps.items():
        db.execute(f"ALTER TABLE {quote(table)} RENAME COLUMN {quote(step)} TO "
                   f"{quote(renamed[old])}")


def _identities(before: TableShape | None, after: TableShape) -> tuple[dict[str, str], set[str]]:
    """By identity (attnum), where both shapes know it: old name -> new name of each column
    renamed, and the names that now belong to another column (dropped and added again)."""
    if before is None:
        return {}, set()
    names = {c.attnum: c.name for c in after.columns if c.attnum}
    attnums = {c.name: c.attnum for c in after.columns}
    renamed = {c.name: names[c.attnum] for c in before.columns
               if c.attnum in names and names[c.attnum] != c.name}
    replaced = {c.name for c in before.columns if c.attnum and c.name not in renamed
                and attnums.get(c.name, c.attnum) not in (0, c.attnum)}
    return renamed, replaced
