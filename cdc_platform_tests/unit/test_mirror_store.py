"""The mirror's SQLite store on a real SQLite database: shapes, bootstrap, whole-transaction
apply with the position in the same commit, the cutover rule and the high-water mark."""

from __future__ import annotations

import json
import math
import sqlite3

import pytest

from cdc_platform.mirror.columns import BUILTIN_ARRAY_OIDS, TableShape, sqlite_type, to_sqlite
from cdc_platform.mirror.errors import DivergenceError, MirrorError
from cdc_platform.mirror.follower import Mirror, check_sqlite_names
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.stored_values import wire_value
from cdc_platform.mirror.tables import SchemaChange
from cdc_platform.protocol import values
from cdc_platform.settings import PlatformSettings
from cdc_platform_tests.fixtures.mirror_events import bootstrapped, event, schema, schema_event


@pytest.fixture
def store(tmp_path):
    opened = MirrorStore(tmp_path / "mirror.db")
    yield opened
    opened.close()


def rows(store, table="users"):
    return store._db.execute(f'SELECT * FROM "{table}" ORDER BY 1').fetchall()


def test_types_follow_the_wire_type_mapping():
    assert [sqlite_type(oid, name) for oid, name in [
        (23, "integer"), (16, "boolean"), (701, "double precision"), (17, "bytea"),
        (1700, "numeric(10,2)"), (3802, "jsonb"), (1007, "integer[]"), (98765, "mood")]] == [
        "INTEGER", "INTEGER", "", "BLOB", "TEXT", "TEXT", "TEXT", ""]
    assert to_sqlite(True) == 1 and to_sqlite(None) is None
    assert to_sqlite(float("nan")) == "NaN" and to_sqlite(float("inf")) == math.inf
    assert to_sqlite(2**64 - 1) == str(2**64 - 1) and to_sqlite(-(2**63)) == -(2**63)
    assert to_sqlite([1, None, [b"\x01", float("nan")]]) == '[1,null,["\\\\x01","NaN"]]'


def test_the_mirror_knows_the_builtin_array_types_the_platform_converts():
    assert BUILTIN_ARRAY_OIDS == set(values._BUILTIN_ARRAYS)


def test_a_domain_columns_base_type_is_kept_with_its_shape_and_turns_its_values_back(tmp_path):
    given = schema(columns=(("id", 23, "integer", True), ("f", 16500, "score", False),
                            ("fs", 16501, "score[]", False), ("ints", 16502, "ints", False),
                            ("moods", 16510, "moods", False)))
    # over float8; its array; over int4[]; over mood[] (an enum's array: no builtin)
    bases = {"f": 701, "fs": 1022, "ints": 1007, "moods": 16504}
    for column in given["columns"]:
        column["base_type_oid"] = bases.get(column["name"], column["type_oid"])
        column["is_array"] = column["name"] in ("fs", "ints", "moods")
    store = MirrorStore(tmp_path / "m.db")
    bootstrapped(store, given, loaded=[
        {"id": 1, "f": math.nan, "fs": [math.inf, -0.0, None], "ints": [[1, None], [3, 4]],
         "moods": [["sad", None], ["ok", "so, so"]]}])
    store.close()
    again = MirrorStore(tmp_path / "m.db")
    kept = again.shape("users")
    stored = again._db.execute("SELECT id, f, fs, ints, moods FROM users").fetchone()
    again.close()
    # declared by the type (a domain has no affinity), read back by the base type
    assert [(c.sqlite_type, c.type_oid, c.base_type_oid, c.holds_arrays)
            for c in kept.columns] == [
        ("INTEGER", 23, 23, False), ("", 16500, 701, False), ("TEXT", 16501, 1022, True),
        ("", 16502, 1007, True), ("", 16510, 16504, True)]
    back = [wire_value(value, column) for value, column in zip(stored, kept.columns,
                                                               strict=True)]
    assert back[0] == 1 and math.isnan(back[1]) and back[3] == [[1, None], [3, 4]]
    assert back[2] == [math.inf, -0.0, None] and math.copysign(1.0, back[2][1]) == -1.0
    assert back[4] == [["sad", None], ["ok", "so, so"]]


def test_values_keep_their_type_in_sqlite(store):
    shape = bootstrapped(store, schema("t", (
        ("id", 23, "integer", True), ("price", 1700, "numeric(10,2)", False),
        ("f", 701, "double precision", False), ("mood", 98765, "mood", False),
        ("doc", 3802, "jsonb", False), ("raw", 17, "bytea", False))))
    store.apply_transaction([
        event("INSERT", "0/200", 0, table="t", data={
            "id": 1, "price": "12.50", "f": float("nan"), "mood": "42", "doc": "123",
            "raw": b"\x00\xff"}),
        event("INSERT", "0/200", 1, table="t", data={
            "id": 2, "price": None, "f": -0.0, "mood": 42, "doc": None, "raw": None}),
    ], stream_seq=8)
    assert rows(store, shape.table) == [(1, "12.50", "NaN", "42", "123", b"\x00\xff"),
                                        (2, None, -0.0, 42, None, None)]
    assert math.copysign(1.0, rows(store, shape.table)[1][2]) == -1.0  # the sign is kept
    types = store._db.execute("SELECT typeof(price), typeof(mood), typeof(doc) FROM t").fetchone()
    assert types == ("text", "text", "text")  # no affinity turned "12.50" or "42" into numbers


def test_transaction_applies_whole_with_its_position(store):
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}])
    applied = store.apply_transaction([
        event("UPDATE", "0/200", 1, data={"id": 1, "name": "b"}),
        event("INSERT", "0/200", 0, data={"id": 2, "name": "x"}),
    ], stream_seq=9)
    assert applied.events == 2
    assert rows(store) == [(1, "b"), (2, "x")]
    state = store.state("users")
    assert (state.applied_commit_lsn, state.applied_ordinal) == (0x200, 1)
    assert store.state("users").stream_seq == 9
    # the same transaction again (a redelivery): nothing applied twice
    assert store.apply_transaction([event("INSERT", "0/200", 0, data={"id": 2, "name": "x"})],
                                   stream_seq=9).events == 0
    assert rows(store) == [(1, "b"), (2, "x")]


def test_cutover_skips_what_the_snapshot_holds(store):
    bootstrapped(store, lsn=0x300, loaded=[{"id": 1, "name": "a"}])
    assert store.apply_transaction([event("INSERT", "0/2FF", 0, data={"id": 1, "name": "a"})],
                                   stream_seq=3).events == 0
    assert store.apply_transaction([event("INSERT", "0/300", 0, data={"id": 2, "name": "b"})],
                                   stream_seq=4).events == 1
    assert rows(store) == [(1, "a"), (2, "b")]


def test_a_diverging_change_rolls_back_the_whole_transaction(store):
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}])
    with pytest.raises(DivergenceError, match="does not hold"):
        store.apply_transaction([
            event("INSERT", "0/200", 0, data={"id": 2, "name": "x"}),
            event("DELETE", "0/200", 1, data={"id": 99}, old={"id": 99}),
        ], stream_seq=5)
    assert rows(store) == [(1, "a")]
    assert store.state("users").applied_commit_lsn == 0
    with pytest.raises(DivergenceError, match="already mirrored"):
        store.apply_transaction([event("INSERT", "0/200", 0, data={"id": 1, "name": "x"})],
                                stream_seq=5)


def test_unchanged_toast_kept_and_key_changes_followed(store):
    bootstrapped(store, loaded=[{"id": 1, "name": "big"}])
    store.apply_transaction([
        event("UPDATE", "0/200", 0, data={"id": 1}, unchanged_toast=["name"]),
        event("UPDATE", "0/200", 1, data={"id": 5, "name": "big2"}, old={"id": 1},
              old_kind="K"),
    ], stream_seq=2)
    assert rows(store) == [(5, "big2")]
    store.apply_transaction([event("DELETE", "0/300", 0, data={"id": 5}, old={"id": 5}),
                             event("INSERT", "0/300", 1, data={"id": 6, "name": None})],
                            stream_seq=3)
    assert rows(store) == [(6, None)]
    store.apply_transaction([event("TRUNCATE", "0/400", 0)], stream_seq=4)
    assert rows(store) == []


def test_table_without_key_matches_the_whole_old_row(store):
    keyless = schema("log", (("a", 23, "integer", False), ("b", 25, "text", False)))
    bootstrapped(store, keyless, loaded=[{"a": 1, "b": None}, {"a": 1, "b": None},
                                         {"a": 2, "b": "x"}])
    store.apply_transaction([
        event("DELETE", "0/200", 0, table="log", data={"a": 1, "b": None},
              old={"a": 1, "b": None}),
        event("UPDATE", "0/200", 1, table="log", data={"a": 3, "b": "y"},
              old={"a": 2, "b": "x"}),
    ], stream_seq=2)
    assert sorted(rows(store, "log"), key=repr) == [(1, None), (3, "y")]


def test_names_that_need_quoting(store):
    odd = schema("sales/Order=20Lines", (("we\"ird id", 23, "integer", True),
                                          ("select", 25, "text", False)))
    bootstrapped(store, odd, loaded=[{"we\"ird id": 1, "select": "x"}])
    store.apply_transaction([event("UPDATE", "0/200", 0, table="sales/Order=20Lines",
                                   data={"we\"ird id": 1, "select": "y"})], stream_seq=2)
    assert rows(store, 'sales/Order=20Lines') == [(1, "y")]


def test_shape_changes(store):
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}])
    added = schema(columns=(("id", 23, "integer", True), ("name", 25, "text", False),
                            ("flag", 23, "integer", False)), fingerprint="f2")
    with store._transaction():
        assert store.apply_shape(TableShape.from_schema(added), {"flag": 7}) is \
            SchemaChange.ALTERED
    assert rows(store) == [(1, "a", 7)]
    dropped = schema(columns=(("id", 23, "integer", True), ("flag", 23, "integer", False)))
    with store._transaction():
        assert store.apply_shape(TableShape.from_schema(dropped)) is SchemaChange.ALTERED
    assert rows(store) == [(1, 7)]
    retyped = schema(columns=(("id", 23, "integer", True), ("flag", 25, "text", False)))
    assert store.apply_shape(TableShape.from_schema(retyped)) is SchemaChange.NEEDS_BOOTSTRAP
    assert store.apply_shape(TableShape.from_schema(dropped)) is SchemaChange.UNCHANGED


def test_positions_survive_reopening(tmp_path):
    store = MirrorStore(tmp_path / "m.db")
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}])
    store.apply_transaction([event("INSERT", "1/0", 0, data={"id": 2, "name": "b"})],
                            stream_seq=11)
    store.close()
    again = MirrorStore(tmp_path / "m.db")
    state = again.state("users")
    assert (state.status, state.applied_commit_lsn, again.state("users").stream_seq) == (
        "streaming", 1 << 32, 11)
    assert not state.wants(1 << 32, 0) and state.wants(1 << 32, 1)
    again.close()


@pytest.mark.parametrize("columns", [
    # as written now: name, SQLite type, in the key, type oid, attnum, base type oid, is_array
    ('[["id", "INTEGER", true, 23, 1, 23, false], ["name", "TEXT", false, 25, 2, 25, false], '
     '["f", "", false, 701, 3, 701, false]]'),
    # before is_array was kept
    ('[["id", "INTEGER", true, 23, 1, 23], ["name", "TEXT", false, 25, 2, 25], '
     '["f", "", false, 701, 3, 701]]'),
    # as 0.4.0 wrote it: name, SQLite type, in the key, type oid, attnum
    '[["id", "INTEGER", true, 23, 1], ["name", "TEXT", false, 25, 2], ["f", "", false, 701, 3]]',
    # before type oids and attnums were kept
    '[["id", "INTEGER", true], ["name", "TEXT", false], ["f", "", false]]',
])
def test_a_shape_written_by_an_earlier_version_opens(tmp_path, columns):
    store = MirrorStore(tmp_path / "m.db")
    bootstrapped(store, schema(columns=(("id", 23, "integer", True), ("name", 25, "text", False),
                                        ("f", 701, "double precision", False))))
    text = '{"table": "users", "fingerprint": "f1", "columns": ' + columns + '}'
    with store._db:
        store._db.execute("UPDATE _cdc_mirror_tables SET shape = ?", (text,))
    store.close()
    again = MirrorStore(tmp_path / "m.db")
    shape = again.shape("users")
    assert [(c.name, c.sqlite_type, c.is_primary_key) for c in shape.columns] == [
        ("id", "INTEGER", True), ("name", "TEXT", False), ("f", "", False)]
    assert shape.key_columns == ["id"]
    if "23" in columns:  # written back as it was (a type its own base type where none was,
        # not an array where nothing said so)
        assert json.loads(shape.to_json_text())["columns"] == [
            [*column[:5], column[3], False] for column in json.loads(columns)]
    again.apply_transaction([event("INSERT", "1/0", 0, data={"id": 2, "name": "b", "f": -0.0})],
                            stream_seq=11)
    assert rows(again) == [(2, "b", -0.0)]
    again.close()


def test_a_corrupt_database_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(MirrorError, match="not a usable mirror database"):
        MirrorStore(path)


def test_an_invalid_schema_value_is_a_clear_error():
    with pytest.raises(MirrorError, match="not a valid schemas value"):
        TableShape.from_schema({"table": "users"})
    with pytest.raises(MirrorError, match=r"column 1 \('id'\) cannot be mapped.*type_oid"):
        TableShape.from_schema({"table": "users", "columns": [{"name": "id"}]})


def test_interrupted_bootstrap_leaves_the_table_bootstrapping(store):
    shape = TableShape.from_schema(schema())
    store.begin_bootstrap(shape, "snap1", 0x100)
    store.load_rows("users", [{"id": 1, "name": "a"}])
    state = store.state("users")
    assert state.status == "bootstrapping"
    # a change of a table still bootstrapping is never applied
    assert store.apply_transaction([event("INSERT", "0/200", 0, data={"id": 2, "name": "b"})],
                                   stream_seq=3).events == 0
    assert isinstance(store._db, sqlite3.Connection)


def test_json_payload_values_are_restored_by_column_type():
    shape = TableShape.from_schema(schema("t", (
        ("id", 23, "integer", True), ("raw", 17, "bytea", False),
        ("f", 701, "double precision", False), ("fs", 1022, "double precision[]", False),
        ("txt", 25, "text", False))))
    assert shape.from_json({"id": 1, "raw": "AP8=", "f": "NaN", "fs": [1.5, "-Infinity", None],
                            "txt": "NaN"}) == {
        "id": 1, "raw": b"\x00\xff", "f": pytest.approx(math.nan, nan_ok=True),
        "fs": [1.5, -math.inf, None], "txt": "NaN"}
    assert shape.from_json(None) is None


def test_a_schema_event_adds_columns_with_what_existing_rows_read(store, tmp_path):
    """ADD COLUMN flag int DEFAULT 7: rows that existed read 7 (attmissingval), the change
    after the event carries its own value; the shape survives a restart."""
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}, {"id": 2, "name": "b"}])
    wider = schema(columns=(("id", 23, "integer", True), ("name", 25, "text", False),
                            ("flag", 23, "integer", False)), fingerprint="f2")
    wider["columns"][2]["missing_value"] = 7
    applied = store.apply_transaction([
        event("INSERT", "0/300", 0, data={"id": 3, "name": "c", "flag": 1}),
        schema_event("0/300", 0, wider),
    ], stream_seq=10)
    assert (applied.events, applied.stale) == (1, {})
    assert rows(store) == [(1, "a", 7), (2, "b", 7), (3, "c", 1)]
    assert store.state("users").fingerprint == "f2"
    store.close()
    again = MirrorStore(tmp_path / "mirror.db")
    assert again.shape("users").fingerprint == "f2"  # the stream's shape, kept with the rows
    # a redelivered copy of the event and its change changes nothing
    assert again.apply_transaction([schema_event("0/300", 0, wider), event(
        "INSERT", "0/300", 0, data={"id": 3, "name": "c", "flag": 1})], 11).events == 0
    narrower = schema(columns=(("id", 23, "integer", True), ("flag", 23, "integer", False)),
                      fingerprint="f3")
    again.apply_transaction([schema_event("0/400", 0, narrower),
                             event("DELETE", "0/400", 0, data={"id": 1}, old={"id": 1})], 12)
    assert rows(again) == [(2, 7), (3, 1)]
    again.close()


@pytest.mark.parametrize("how", ["needs_snapshot", "type_change", "key_change"])
def test_a_change_no_alter_can_follow_makes_the_table_stale(store, how):
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}])
    extra = {}
    if how == "needs_snapshot":
        changed = schema(fingerprint="f2")
        extra = {"needs_snapshot": True, "reason": "the table was rewritten"}
    elif how == "type_change":
        changed = schema(columns=(("id", 23, "integer", True), ("name", 17, "bytea", False)),
                         fingerprint="f2")
    else:
        changed = schema(columns=(("id", 23, "integer", False), ("name", 25, "text", True)),
                         fingerprint="f2")
    applied = store.apply_transaction([
        schema_event("0/300", 0, changed, **extra),
        event("UPDATE", "0/300", 0, data={"id": 1, "name": "b"}),
        event("INSERT", "0/300", 1, data={"id": 2, "name": "c"}),
    ], stream_seq=10)
    assert applied.events == 0 and list(applied.stale) == ["users"]
    state = store.state("users")
    assert state.status == "stale" and state.reason == applied.stale["users"]
    if how == "needs_snapshot":
        assert state.reason == "the table was rewritten"
    assert rows(store) == [(1, "a")]  # nothing of the transaction applied to it


def test_resume_seq_is_the_least_position_of_the_streaming_tables(store):
    bootstrapped(store)  # users at 7
    bootstrapped(store, schema("orders"))
    store.apply_transaction([event("INSERT", "0/300", 0, data={"id": 1, "name": "a"})],
                            stream_seq=20, followed=["users"])
    assert store.resume_seq(["users", "orders"]) == 8  # orders still at 7
    store.advance(["users", "orders"], 30)
    assert store.resume_seq(["users", "orders"]) == 31
    store.mark_stale("orders", "retention")
    assert store.resume_seq(["users", "orders"]) == 31 and store.state("orders").status == \
        "stale"


def test_an_unmappable_schema_names_its_column():
    bad = schema(columns=(("id", 23, "integer", True), ("weird", "not-an-oid", "x", False)))
    with pytest.raises(MirrorError, match=r"column 2 \('weird'\) cannot be mapped"):
        TableShape.from_schema(bad)


def test_runs_of_updates_go_together_and_still_refuse_a_row_the_mirror_does_not_hold(store):
    bootstrapped(store, loaded=[{"id": i, "name": f"r{i}"} for i in range(1, 6)])
    store.apply_transaction([
        event("UPDATE", "0/200", 0, data={"id": 1, "name": "u1"}),
        event("UPDATE", "0/200", 1, data={"id": 2, "name": "u2"}),
        event("INSERT", "0/200", 2, data={"id": 6, "name": "new"}),
        event("UPDATE", "0/200", 3, data={"id": 6, "name": "u6"}),  # after its insert
        event("UPDATE", "0/200", 4, data={"id": 7, "name": "k"}, old={"id": 3}),  # key change
        event("UPDATE", "0/200", 5, data={"id": 7, "name": "k2"}),
    ], stream_seq=8)
    assert rows(store) == [(1, "u1"), (2, "u2"), (4, "r4"), (5, "r5"), (6, "u6"), (7, "k2")]
    with pytest.raises(DivergenceError, match=r"does not hold: \{'id': 99\}"):
        store.apply_transaction([
            event("UPDATE", "0/300", 0, data={"id": 1, "name": "x"}),
            event("UPDATE", "0/300", 1, data={"id": 99, "name": "x"}),
            event("UPDATE", "0/300", 2, data={"id": 2, "name": "x"}),
        ], stream_seq=9)
    with pytest.raises(DivergenceError, match="already mirrored"):
        store.apply_transaction([
            event("UPDATE", "0/300", 0, data={"id": 1, "name": "x"}),
            event("UPDATE", "0/300", 1, data={"id": 2, "name": "y"}, old={"id": 4}),
        ], stream_seq=9)
    assert rows(store) == [(1, "u1"), (2, "u2"), (4, "r4"), (5, "r5"), (6, "u6"), (7, "k2")]
    assert store.state("users").applied_commit_lsn == 0x200


def test_an_update_without_its_key_is_a_divergence_also_once_its_statement_is_prepared(store):
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}, {"id": 2, "name": "b"}])
    with pytest.raises(DivergenceError, match="does not carry key column 'id'"):
        store.apply_transaction([
            event("UPDATE", "0/200", 0, data={"id": 10, "name": "x"}, old={"id": 1}),
            event("UPDATE", "0/200", 1, data={"id": 20, "name": "y"}, old={"name": "b"}),
        ], stream_seq=8)
    assert rows(store) == [(1, "a"), (2, "b")]


def test_an_integer_beyond_64_bits_in_an_update_is_stored_as_an_insert_stores_it(store):
    """(PostgreSQL's integer types never send one; a forged event must not stop the mirror)"""
    columns = (("id", 20, "bigint", True), ("n", 20, "bigint", False))
    bootstrapped(store, schema("big", columns), loaded=[{"id": 1, "n": 1}, {"id": 2, "n": 2}])
    store.apply_transaction([
        event("UPDATE", "0/200", 0, table="big", data={"id": 1, "n": 2**70}),
        event("UPDATE", "0/200", 1, table="big", data={"id": 2, "n": 5}),
        event("INSERT", "0/200", 2, table="big", data={"id": 3, "n": 2**70}),
    ], stream_seq=8)
    stored = rows(store, "big")
    assert stored[0][1] == stored[2][1] and stored[1] == (2, 5)  # as the insert stores it
    with pytest.raises(DivergenceError):  # a key SQLite cannot hold: the table bootstraps
        store.apply_transaction([event("UPDATE", "0/300", 0, table="big",
                                       data={"id": 2**70, "n": 6}, old={"id": 2})],
                                stream_seq=9)


def test_batched_updates_keeping_or_moving_a_composite_key(store):
    """An UPDATE without ``old`` sets only the columns outside the key (its key did not
    change); one with ``old`` moves the row; a table of key columns only still updates."""
    columns = (("a", 23, "integer", True), ("b", 25, "text", True), ("v", 25, "text", False))
    bootstrapped(store, schema("pairs", columns),
                 loaded=[{"a": 1, "b": "x", "v": "one"}, {"a": 2, "b": "y", "v": "two"}])
    keys_only = (("a", 23, "integer", True), ("b", 25, "text", True))
    bootstrapped(store, schema("keys", keys_only), loaded=[{"a": 1, "b": "x"}])
    store.apply_transaction([
        event("UPDATE", "0/200", 0, table="pairs", data={"a": 1, "b": "x", "v": "uno"}),
        event("UPDATE", "0/200", 1, table="pairs", data={"v": "dos", "b": "y", "a": 2}),
        event("UPDATE", "0/200", 2, table="pairs", data={"a": 3, "b": "z", "v": "tres"},
              old={"a": 1, "b": "x"}),
        event("UPDATE", "0/200", 3, table="pairs", data={"a": 3, "b": "z", "v": "drei"}),
        event("UPDATE", "0/200", 4, table="keys", data={"a": 1, "b": "x"}),
        event("UPDATE", "0/200", 5, table="keys", data={"a": 5, "b": "w"},
              old={"a": 1, "b": "x"}),
    ], stream_seq=8)
    assert rows(store, "pairs") == [(2, "y", "dos"), (3, "z", "drei")]
    assert rows(store, "keys") == [(5, "w")]
    with pytest.raises(DivergenceError, match="does not hold"):
        store.apply_transaction([
            event("UPDATE", "0/300", 0, table="pairs", data={"a": 1, "b": "x", "v": "gone"})],
            stream_seq=9)


def test_rows_loaded_as_tuples_equal_rows_loaded_as_maps(tmp_path):
    """The compiled decoder's tuples and the pure path's maps load the same table: NaN kept
    apart from NULL, -0.0 kept, arrays as JSON, an integer beyond 64 bits as text."""
    columns = (("id", 20, "bigint", True), ("score", 701, "double precision", False),
               ("tags", 1007, "integer[]", False), ("n", 1700, "numeric", False),
               ("big", 5069, "xid8", False))
    rows = [(1, float("nan"), [1, None], "1.5", 2**64 - 1), (2, -0.0, None, None, 7),
            (3, None, [], "NaN", None)]
    names = tuple(name for name, *_ in columns)
    loaded = []
    for index, as_tuples in enumerate((True, False)):
        store = MirrorStore(tmp_path / f"m{index}.db")
        shape = TableShape.from_schema(schema("t", columns))
        store.begin_bootstrap(shape, "snap1", 0x100)
        if as_tuples:
            store.load_tuples("t", names, rows[:2], has_nan=True)
            store.load_tuples("t", names, rows[2:], has_nan=False)
        else:
            store.load_rows("t", [dict(zip(names, row, strict=True)) for row in rows])
        loaded.append(store._db.execute(
            'SELECT id, typeof(score), score, tags, n, big FROM "t" ORDER BY id').fetchall())
        with pytest.raises(DivergenceError, match="already mirrored"):
            if as_tuples:
                store.load_tuples("t", names, rows[:1], has_nan=True)
            else:
                store.load_rows("t", [dict(zip(names, rows[0], strict=True))])
        store.close()
    assert repr(loaded[0]) == repr(loaded[1])  # (repr: -0.0 is not 0.0)
    assert loaded[0][0] == (1, "text", "NaN", "[1,null]", "1.5", "18446744073709551615")
    assert repr(loaded[0][1][1:3]) == "('real', -0.0)"


def test_a_divergence_found_when_another_tables_event_flushes_a_batch_stales_its_own_table(
        tmp_path):
    """Consecutive inserts go to SQLite together when an event of another kind or table
    comes: the divergence found then is the batch's table's, not that event's."""
    from cdc_platform.mirror.follower import Mirror, _Following
    from cdc_platform.mirror.transactions import TransactionCollector
    from cdc_platform.settings import PlatformSettings

    store = MirrorStore(tmp_path / "mirror.db")
    bootstrapped(store, schema("a"), loaded=[{"id": 1, "name": "held"}])
    bootstrapped(store, schema("b"))
    mirror = Mirror(PlatformSettings(), ["a", "b"], tmp_path / "mirror.db",
                    report=lambda line: None)
    follow = _Following(mirror, None, store, TransactionCollector(["a", "b"],
                                                                  keep_events=False), ["a", "b"])
    follow.event(event("INSERT", "0/200", 0, table="a", data={"id": 1, "name": "again"}), 8,
                 False)
    assert not follow.stale  # (batched: not in SQLite yet)
    follow.event(event("INSERT", "0/200", 1, table="b", data={"id": 1, "name": "new"},
                       tx_tables={"a": 1, "b": 1}), 9, False)
    assert list(follow.stale) == ["a"]
    assert store.state("a").status == "stale" and store.state("b").status == "streaming"
    assert rows(store, "b") == []
    store.close()


def test_a_keyless_table_drops_a_column_its_row_lookup_index_holds(store):
    """(SQLite drops no indexed column: the lookup index is made again for the new shape)"""
    keyless = schema("bag", columns=(("a", 23, "integer", False), ("b", 25, "text", False),
                                     ("c", 23, "integer", False)))
    bootstrapped(store, keyless, loaded=[{"a": 1, "b": "x", "c": 3}, {"a": 2, "b": "y", "c": 4}])
    narrower = schema("bag", columns=(("a", 23, "integer", False), ("c", 23, "integer", False),
                                      ("d", 25, "text", False)), fingerprint="f2")
    applied = store.apply_transaction([
        schema_event("0/200", 0, narrower),
        event("DELETE", "0/200", 0, table="bag", data={"a": 1, "c": 3, "d": None},
              old={"a": 1, "c": 3, "d": None}),
    ], stream_seq=8)
    assert (applied.events, applied.stale) == (1, {})
    assert rows(store, "bag") == [(2, 4, None)]
    indexed = store._db.execute("SELECT name FROM pragma_index_info('bag (row lookup)')")
    assert [name for (name,) in indexed] == ["a", "c", "d"]


def test_an_update_of_unchanged_values_only_changes_nothing_and_one_naming_no_row_diverges(
        store):
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}])
    # every column an unchanged TOAST value: data is empty
    assert store.apply_transaction([event("UPDATE", "0/200", 0, data={})], 8).events == 1
    assert rows(store) == [(1, "a")] and store.state("users").applied_commit_lsn == 0x200
    bootstrapped(store, schema("bag", columns=(("a", 23, "integer", False),)),
                 loaded=[{"a": 1}])
    with pytest.raises(DivergenceError, match="names no row"):
        store.apply_transaction([event("DELETE", "0/300", 0, table="bag", data={}, old={})], 9)
    assert rows(store, "bag") == [(1,)]


@pytest.mark.parametrize(("forged", "why"), [
    ({"operation": "INSERT", "data": {}}, "an INSERT without values"),
    ({"operation": "UPDATE", "data": None}, "UPDATE without a data map"),
    ({"operation": "MERGE"}, "unknown operation"),
    ({"ordinal": -1}, "ordinal -1"),
    ({"ordinal": 1 << 63}, "ordinal 9223372036854775808"),
    ({"commit_lsn": "FFFFFFFF/FFFFFFFF"}, "beyond any PostgreSQL LSN"),
    ({"tx_tables": [1, 2]}, "not a map of tables to counts"),
    ({"tx_tables": {"users": "1"}}, "not a map of tables to counts"),
    ({"table": "orders"}, "an event of table 'orders' on subject cdc.users.insert"),
])
def test_what_is_not_an_event_of_the_contract_is_refused_before_the_database(forged, why):
    from cdc_platform.mirror.follower import _check_event

    good = event("INSERT", "0/200", 0, data={"id": 1, "name": "a"})
    prefixes = {"users": "cdc.users.", "orders": "cdc.orders."}
    _check_event(good, "cdc.users.insert", prefixes)
    with pytest.raises(ValueError, match=why):
        _check_event(good | forged, "cdc.users.insert", prefixes)


def _with_attnums(value, attnums):
    for column, attnum in zip(value["columns"], attnums, strict=True):
        column["attnum"] = attnum
    return value


def test_renamed_columns_keep_their_values_swaps_and_reused_names_too(store, tmp_path):
    """Columns are matched by attnum: a rename is done in place (the key column too), two
    names swapped, and a name taken from a dropped column; the shape survives a restart."""
    columns = (("id", 23, "integer", True), ("a", 25, "text", False), ("b", 25, "text", False),
               ("c", 23, "integer", False))
    bootstrapped(store, _with_attnums(schema(columns=columns), [1, 2, 3, 4]),
                 loaded=[{"id": 1, "a": "x", "b": "y", "c": 5}])
    # id renamed to key, a and b swapped
    swapped = _with_attnums(schema(columns=(
        ("key", 23, "integer", True), ("b", 25, "text", False), ("a", 25, "text", False),
        ("c", 23, "integer", False)), fingerprint="f2"), [1, 2, 3, 4])
    applied = store.apply_transaction([schema_event("0/300", 0, swapped)], stream_seq=10)
    assert applied.stale == {}
    assert store._db.execute('SELECT "key", a, b, c FROM users').fetchall() == [(1, "y", "x", 5)]
    store.close()
    store = MirrorStore(tmp_path / "mirror.db")
    reused = _with_attnums(schema(columns=(
        ("key", 23, "integer", True), ("b", 25, "text", False), ("c", 25, "text", False)),
        fingerprint="f3"), [1, 2, 3])  # a renamed to c, the old c (attnum 4) dropped
    applied = store.apply_transaction([schema_event("0/400", 0, reused)], stream_seq=11)
    assert applied.stale == {}
    assert store._db.execute('SELECT "key", b, c FROM users').fetchall() == [(1, "x", "y")]
    store.close()


def test_a_column_dropped_and_added_again_under_its_name_reads_its_missing_value(store):
    """int4 dropped, int8 added under the same name: the same SQLite type, another column
    (attnum); existing rows read the new column's missing value, not the old values."""
    columns = (("id", 23, "integer", True), ("n", 23, "integer", False))
    bootstrapped(store, _with_attnums(schema(columns=columns), [1, 2]),
                 loaded=[{"id": 1, "n": 5}])
    again = _with_attnums(schema(columns=(("id", 23, "integer", True),
                                          ("n", 20, "bigint", False)), fingerprint="f2"), [1, 3])
    again["columns"][1]["missing_value"] = 9
    assert store.apply_transaction([schema_event("0/300", 0, again)], stream_seq=10).stale == {}
    assert rows(store) == [(1, 9)]


def test_a_snapshot_asked_for_by_a_schema_event_starts_at_its_min_snapshot_lsn(store):
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}])
    store.apply_transaction([schema_event("0/300", 0, schema(fingerprint="f2"),
                                          needs_snapshot=True, reason="rewritten",
                                          min_snapshot_lsn="0/500")], stream_seq=10)
    assert store.state("users").stale_lsn == 0x500
def test_a_keyless_table_tells_zero_from_minus_zero_and_ints_from_floats(store):
    """SQLite's ``IS`` holds 0.0 equal to -0.0 (and 1 to 1.0): a REPLICA IDENTITY FULL change
    of the -0.0 row of two otherwise equal rows changed the 0.0 row."""
    keyless = schema("zeros", (("f", 701, "double precision", False), ("v", 25, "text", False),
                               ("u", 98765, "mood", False)))
    bootstrapped(store, keyless, loaded=[
        {"f": 0.0, "v": "a", "u": 1}, {"f": -0.0, "v": "a", "u": 1},
        {"f": 0.0, "v": "a", "u": 1.0}, {"f": float("nan"), "v": "a", "u": 1}])
    store.apply_transaction([
        event("UPDATE", "0/200", 0, table="zeros", data={"f": -0.0, "v": "b", "u": 1},
              old={"f": -0.0, "v": "a", "u": 1}),
        event("DELETE", "0/200", 1, table="zeros", data={"f": 0.0, "v": "a", "u": 1.0},
              old={"f": 0.0, "v": "a", "u": 1.0}),
        event("UPDATE", "0/200", 2, table="zeros", data={"f": float("nan"), "v": "c", "u": 1},
              old={"f": float("nan"), "v": "a", "u": 1}),
    ], stream_seq=2)
    held = {(repr(f), v, repr(u)) for f, v, u in rows(store, "zeros")}
    assert held == {("0.0", "a", "1"), ("-0.0", "b", "1"), ("'NaN'", "c", "1")}


@pytest.mark.parametrize(("change", "why"), [
    (event("INSERT", "0/200", 0, data={"id": 9, "nope": 1}), "has no column named nope"),
    (event("UPDATE", "0/200", 0, data={"id": 1, "nope": 1}), "no such column: nope"),
    (event("INSERT", "0/200", 0, data={"id": 9, 7: "a"}), "AttributeError"),
    (event("INSERT", "0/200", 0, data={"id": 9, "name": object()}),
     "not supported|no SQLite mapping"),
    (event("UPDATE", "0/200", 0, data={"id": 1, "name": "x"}, old=[1]), "TypeError"),
    (event("DELETE", "0/200", 0, data=None), "TypeError"),
    (schema_event("0/200", 0, {"table": "users", "columns": "nope"}),
     "not a valid schemas value"),
    (event("SCHEMA", "0/200", 0, table_schema=None), "not a valid schemas value"),
    (event("SCHEMA", "0/200", 0), "KeyError"),
    (schema_event("0/200", 0, schema("orders")) | {"table": "users"},
     "carries the schema of 'orders'"),
])
def test_a_change_the_table_cannot_hold_is_a_divergence_of_its_table(store, change, why):
    """What a change holds (a column the table lacks, a value no type maps, a malformed
    field or schema) never escapes as another error: the change does not fit its table,
    which is bootstrapped again, and nothing of the transaction is kept."""
    bootstrapped(store, loaded=[{"id": 1, "name": "a"}])
    with pytest.raises(DivergenceError, match=why) as raised:
        store.apply_transaction([event("INSERT", "0/200", 1, data={"id": 2, "name": "b"}),
                                 change], stream_seq=9)
    assert raised.value.table == "users"
    assert rows(store) == [(1, "a")]
    assert store._db.execute("SELECT name FROM sqlite_master WHERE name = 'orders'"
                             ).fetchall() == []


def test_tables_whose_names_sqlite_takes_for_one_are_refused_before_anything_is_written(
        tmp_path):
    """SQLite's names ignore ASCII case: mirrored into one file, ``Users`` would replace
    ``users``' rows (what the store did before the check). Asked together, or one asked of a
    file that holds the other: a clear error. Non-ASCII case is SQLite's own business (it does
    not fold it), and a table asked again under its own name is no clash."""
    store = MirrorStore(tmp_path / "m.db")
    bootstrapped(store, schema("users"), loaded=[{"id": 1, "name": "a"}])
    with pytest.raises(MirrorError, match="'users' and 'Users' differ only in case"):
        Mirror(PlatformSettings(), ["users", "Users"], tmp_path / "other.db")
    with pytest.raises(MirrorError, match="'users' and 'Users' differ only in case"):
        check_sqlite_names(["Users"], store.tables())
    check_sqlite_names(["users", "sales/Users", "é", "É"], store.tables())
    for reserved in ("sqlite_stat1", "_CDC_mirror_tables", "_cdc_bootstrap users"):
        with pytest.raises(MirrorError, match="cannot be mirrored"):
            check_sqlite_names([reserved], ())
    assert store._db.execute("SELECT id, name FROM users").fetchall() == [(1, "a")]


def test_columns_whose_names_sqlite_takes_for_one_make_a_clear_error():
    clashing = schema("t", (("id", 23, "integer", True), ("z", 25, "text", False),
                            ("Z", 25, "text", False)))
    with pytest.raises(MirrorError, match="t: columns 'z' and 'Z' differ only in case"):
        TableShape.from_schema(clashing)
    TableShape.from_schema(schema("t", (("id", 23, "integer", True), ("é", 25, "text", False),
                                        ("É", 25, "text", False))))
