"""Which column a Relation message's column is (its attnum), from a catalog read later: what
the catalog settles and what it cannot (``bridge/shapes.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from cdc_platform.bridge.shapes import AnnouncedShape, column_identities, schema_from_relation
from cdc_platform.postgres.catalog import CatalogColumn, TableSchema
from cdc_platform.protocol.pgoutput import Relation, RelationColumn
from cdc_platform.protocol.values import TypeRegistry

TEXT, INT = 25, 23


def relation(*columns: tuple[str, int]) -> Relation:
    return Relation(16400, "public", "t", "d", tuple(
        RelationColumn(name, oid, -1, name == "id") for name, oid in columns))


def catalog(*columns: tuple[str, int, int]) -> TableSchema:
    return TableSchema("public", "t", 16400, "d", tuple(
        CatalogColumn(name, attnum, "x", True, None, oid, name == "id", name == "id",
                      attnum=attnum, type_modifier=-1) for name, oid, attnum in columns),
        storage=1)


# announced: id (1), b text (2)
ANNOUNCED = AnnouncedShape.of(catalog(("id", INT, 1), ("b", TEXT, 2)), "f1")


@pytest.mark.parametrize(("columns", "now", "attnums"), [
    # nothing changed since
    ([("id", INT), ("b", TEXT)], [("id", INT, 1), ("b", TEXT, 2)], [1, 2]),
    # renamed before this change
    ([("id", INT), ("c", TEXT)], [("id", INT, 1), ("c", TEXT, 2)], [1, 2]),
    # renamed after it: the announced columns still
    ([("id", INT), ("b", TEXT)], [("id", INT, 1), ("c", TEXT, 2)], [1, 2]),
    # a column added after it
    ([("id", INT), ("b", TEXT)], [("id", INT, 1), ("b", TEXT, 2), ("x", INT, 3)], [1, 2]),
    # b dropped, x added before it (another type)
    ([("id", INT), ("x", INT)], [("id", INT, 1), ("x", INT, 3)], [1, 3]),
])
def test_what_the_catalog_settles(columns, now, attnums):
    assert column_identities(relation(*columns), catalog(*now), ANNOUNCED) == (attnums, None)


@pytest.mark.parametrize(("columns", "now", "why"), [
    # renamed to c, then c retyped: the catalog has no such column
    ([("id", INT), ("c", TEXT)], [("id", INT, 1), ("c", INT, 2)], "c were renamed"),
    # renamed to c, then c renamed to d and a new c added: c is not column 3
    ([("id", INT), ("c", TEXT)], [("id", INT, 1), ("d", TEXT, 2), ("c", TEXT, 3)],
     "d exist but are not"),
    # b dropped and added again: before this change, or after?
    ([("id", INT), ("b", TEXT)], [("id", INT, 1), ("b", TEXT, 3)], "dropped and added again"),
    # b renamed to c, then c dropped and added again; or b dropped and c added
    ([("id", INT), ("c", TEXT)], [("id", INT, 1), ("c", TEXT, 3)], "a column of its type"),
])
def test_what_the_catalog_cannot_settle(columns, now, why):
    _, reason = column_identities(relation(*columns), catalog(*now), ANNOUNCED)
    assert reason is not None and why in reason


def test_swapped_names_are_not_taken_for_the_columns_they_were():
    announced = AnnouncedShape.of(catalog(("id", INT, 1), ("a", TEXT, 2), ("b", TEXT, 3)), "f")
    _, reason = column_identities(relation(("id", INT), ("a", TEXT), ("b", TEXT), ("x", INT)),
                                  catalog(("id", INT, 1), ("b", TEXT, 2), ("a", TEXT, 3),
                                          ("x", INT, 4)), announced)
    assert reason is not None and "no longer follow their order" in reason


def test_the_announced_shape_of_a_schema_event_is_the_shape_announced():
    schema = catalog(("id", INT, 1), ("b", TEXT, 2))
    event = {"schema_fingerprint": "f1", "relfilenode": 1, "table_schema": schema.to_wire()}
    read = AnnouncedShape.from_event(event)
    assert (read.fingerprint, read.storage) == ("f1", 1)
    assert [c.to_wire() for c in read.columns] == [c.to_wire() for c in ANNOUNCED.columns]
    event["table_schema"]["columns"][1]["type_oid"] = "text"
    with pytest.raises(ValueError):
        AnnouncedShape.from_event(event)


def test_a_columns_base_type_is_the_catalogs_or_else_what_the_types_resolve():
    score, scores = 16500, 16501  # a domain over float8, and its array type
    types = TypeRegistry()
    types.add_catalog_rows([(score, "score", "public", "d", "N", 0, 701, ",", scores),
                            (scores, "_score", "public", "b", "A", score, 0, ",", 0)])
    known = catalog(("id", INT, 1), ("s", score, 2))
    now = dataclasses.replace(known, columns=(
        known.columns[0], dataclasses.replace(known.columns[1], base_type_oid=701)))
    # s identified by the catalog; a (retyped again since, or never read) by the types alone
    found = schema_from_relation(relation(("id", INT), ("s", score), ("a", scores)), now,
                                 [1, 2, 0], types)
    assert [c.base_type_oid for c in found.columns] == [INT, 701, 1022]
    # without the types: a column the catalog does not identify is its own type
    found = schema_from_relation(relation(("id", INT), ("a", scores)), now, [1, 0])
    assert [c.base_type_oid for c in found.columns] == [INT, scores]
