"""A repair's SQLite side on a real SQLite database (mirror/repair.py, the store's
``replace_buckets`` and tolerant apply): which rows a bucket holds, changes of rows under
repair made to fit, and exactly the buckets' rows replaced in one transaction."""

from __future__ import annotations

import contextlib
import sqlite3

import pytest

from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.digests import read_digest, scan_digest
from cdc_platform.mirror.errors import DivergenceError
from cdc_platform.mirror.repair import (
    RepairedBuckets,
    fine_buckets,
    repair_shadow_name,
    rowids_in_buckets,
)
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.verifications import VerificationResult, record
from cdc_platform.wire.digest import RowDigester, bucket_of, table_digest
from cdc_platform_tests.fixtures.mirror_events import bootstrapped, event, schema

BITS = 4


def _bucket(key: int) -> int:
    return bucket_of(RowDigester(["id"]).key_hash({"id": key}), BITS)


@pytest.fixture
def store(tmp_path):
    opened = MirrorStore(tmp_path / "mirror.db")
    yield opened
    opened.close()


def _rows(store, table="users"):
    return {key: (rowid, name) for rowid, key, name in store._db.execute(
        f'SELECT rowid, id, name FROM "{table}"')}


def test_changes_of_rows_under_repair_are_made_to_fit(store):
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}, {"id": 2, "name": "b"}])
    lacking = [event("UPDATE", "0/200", 0, data={"id": 9, "name": "new"}),
               event("INSERT", "0/200", 1, data={"id": 1, "name": "again"}),
               event("DELETE", "0/200", 2, old={"id": 7}),
               event("UPDATE", "0/200", 3, data={"id": 8}, old={"id": 6})]
    for change in lacking:  # each one a divergence as it is
        store.begin()
        with pytest.raises(DivergenceError):
            store.apply(change)
            store.commit(8)
        store.rollback()
    store.begin()
    for change in lacking:
        store.apply(change, tolerant=True)
    store.commit(8)
    # an UPDATE of a row it lacks with every column: the row; an INSERT of a key it holds:
    # the new row; a DELETE of a row it lacks: nothing; an UPDATE without every column of
    # a row whose new key it lacks: left (the repair replaces it)
    assert {key: name for key, (_, name) in _rows(store).items()} == {
        1: "again", 2: "b", 9: "new"}
    assert read_digest(store._db, "users") == scan_digest(store._db, store.shape("users"))


def test_the_rows_of_the_buckets_and_only_they_are_replaced(store, tmp_path):
    source = {key: f"v{key}" for key in range(1, 201)}
    bootstrapped(store, loaded=[{"id": key, "name": name} for key, name in source.items()])
    repaired = sorted({_bucket(3), _bucket(50)})
    # the damage: in the buckets (a row gone, one altered, one extra) and, unrepaired here,
    # outside them
    # outside them, behind the store's back (its kept digest does not see it)
    outside_key = next(key for key in source if _bucket(key) not in repaired)
    extra = next(key for key in range(1000, 2000) if _bucket(key) in repaired)
    with contextlib.closing(sqlite3.connect(tmp_path / "mirror.db")) as other, other:
        other.execute("DELETE FROM users WHERE id = 3")
        other.execute("UPDATE users SET name = 'altered' WHERE id = 50")
        other.execute("INSERT INTO users VALUES (?, 'extra')", (extra,))
        other.execute("UPDATE users SET name = 'outside' WHERE id = ?", (outside_key,))
    before = _rows(store)
    # the repair snapshot: the source's rows of the buckets, and a row a key change moved
    # out of them while it followed
    shadow = repair_shadow_name("users")
    moved_out = next(key for key in range(2000, 3000) if _bucket(key) not in repaired)
    bootstrapped(store, schema(shadow), loaded=[
        {"id": key, "name": name} for key, name in source.items() if _bucket(key) in repaired
    ] + [{"id": moved_out, "name": "moved"}])
    result = VerificationResult("verify-1", "users", 0x300, "differ", bits=BITS,
                                buckets_differing={bucket: (0, 0) for bucket in repaired})
    record(store._db, result)

    deleted, inserted = store.replace_buckets("users", shadow, BITS, repaired, "verify-1",
                                              0x300)

    after = _rows(store)
    in_buckets = {key for key in source if _bucket(key) in repaired}
    assert (deleted, inserted) == (len(in_buckets), len(in_buckets))
    assert {key: row for key, row in after.items() if _bucket(key) not in repaired} == {
        key: row for key, row in before.items() if _bucket(key) not in repaired}
    assert {key: name for key, (_, name) in after.items() if _bucket(key) in repaired} == {
        key: source[key] for key in in_buckets}
    assert after[outside_key][1] == "outside"  # (not this repair's)
    assert rowids_in_buckets(store._db, store.shape("users"), BITS, repaired) == sorted(
        after[key][0] for key in in_buckets)
    # the buckets' digests are those of the rows inserted (the kept ones did not match the
    # damaged rows); elsewhere the digest is as kept
    kept, scanned = read_digest(store._db, "users"), scan_digest(store._db, store.shape("users"))
    assert kept is not None
    fine = set(fine_buckets(BITS, repaired, kept.bits))
    assert [bucket for bucket in kept.differing(scanned) if bucket in fine] == []
    assert kept.differing(scanned) == [bucket_of(RowDigester(["id"]).key_hash(
        {"id": outside_key}), kept.bits)]
    assert store.state(shadow) is None
    assert store._db.execute("SELECT count(*) FROM sqlite_master WHERE name = ?",
                             (shadow,)).fetchone() == (0,)
    assert store._db.execute("SELECT status, rows_repaired FROM _cdc_mirror_verifications"
                             ).fetchone() == ("repaired", len(in_buckets))


def test_an_event_is_of_the_buckets_by_its_old_key_or_its_new_one(store):
    shape = bootstrapped(store)
    buckets = RepairedBuckets(shape, BITS, [_bucket(5)])
    outside = next(key for key in range(100) if _bucket(key) != _bucket(5))
    assert buckets.holds(event("INSERT", "0/200", 0, data={"id": 5, "name": "x"}))
    assert not buckets.holds(event("INSERT", "0/200", 0, data={"id": outside, "name": "x"}))
    assert buckets.holds(event("DELETE", "0/200", 0, old={"id": 5}))
    assert buckets.holds(event("UPDATE", "0/200", 0, data={"id": outside}, old={"id": 5}))
    assert buckets.holds(event("TRUNCATE", "0/200", 0))
    assert not buckets.holds(event("UPDATE", "0/200", 0, data={"name": "no key"}))


def _repaired_after_learning(tmp_path, shaped, rows) -> TableShape:
    """``rows`` bootstrapped as an earlier mirror shaped the table (``shaped(table, False)``:
    the values of keys 3 and 17 read back otherwise than the source's), the buckets that
    differ repaired from a shadow shaped as now (``shaped(shadow, True)``); the file reopened
    keeps a digest equal to a scan and to the source's. The table's shape, as kept."""
    store = MirrorStore(tmp_path / "mirror.db")
    bootstrapped(store, shaped("users", False), loaded=rows)
    names = [column["name"] for column in shaped("users", False)["columns"]]
    expected = table_digest(rows, RowDigester(names, ["id"]), BITS)
    differing = read_digest(store._db, "users").folded(BITS).differing(expected)
    assert differing == sorted({_bucket(3), _bucket(17)})  # read back as text
    shadow = repair_shadow_name("users")
    bootstrapped(store, shaped(shadow, True),
                 loaded=[row for row in rows if _bucket(row["id"]) in differing])
    record(store._db, VerificationResult("verify-1", "users", 0x300, "differ", bits=BITS,
                                         buckets_differing={b: (0, 0) for b in differing}))
    store.replace_buckets("users", shadow, BITS, differing, "verify-1", 0x300)
    store.close()

    again = MirrorStore(tmp_path / "mirror.db")
    try:
        shape = again.shape("users")
        kept = read_digest(again._db, "users")
        assert kept == scan_digest(again._db, shape)
        assert kept.folded(BITS) == expected
        return shape
    finally:
        again.close()


def test_a_table_shaped_before_base_types_were_kept_learns_them_from_its_repair(tmp_path):
    def scored(table: str, learned: bool) -> dict:
        given = schema(table, (("id", 23, "integer", True), ("f", 16500, "score", False)))
        if learned:  # (an earlier mirror kept none: the domain read as itself)
            given["columns"][1]["base_type_oid"] = 701
        return given

    rows = [{"id": key, "f": float("nan") if key in (3, 17) else float(key)}
            for key in range(1, 41)]
    shape = _repaired_after_learning(tmp_path, scored, rows)
    assert [c.base_type_oid for c in shape.columns] == [23, 701]  # kept in the file


def test_a_table_shaped_before_is_array_was_kept_learns_it_from_its_repair(tmp_path):
    def moods(table: str, learned: bool) -> dict:
        # a domain over mood[] (16510), whose base type (16504) is an enum's array type
        given = schema(table, (("id", 23, "integer", True), ("mo", 16510, "moods", False)))
        given["columns"][1]["base_type_oid"] = 16504
        if learned:  # (an earlier mirror kept none: the arrays read as text)
            given["columns"][1]["is_array"] = True
        return given

    rows = [{"id": key, "mo": ["sad", None] if key in (3, 17) else None}
            for key in range(1, 41)]
    shape = _repaired_after_learning(tmp_path, moods, rows)
    assert [(c.base_type_oid, c.holds_arrays) for c in shape.columns] == [
        (23, False), (16504, True)]  # kept in the file
