"""The compiled twin of the store's batched ``executemany`` (``_speedups/store.pyx``'s
``Statements``: INSERT and UPDATE batches bound straight from the event maps, on the SQLite
handle of the store's own connection) against the store's pure path, on real SQLite files:
the same rows, values and storage classes, or the same error, for any events."""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import ClassVar

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_platform.mirror.columns import TableShape, quote
from cdc_platform.mirror.errors import DivergenceError
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.speedups import compiled_twin
from cdc_platform_tests.msgpack_values import values

TWIN = compiled_twin("cdc_platform.mirror.store")
compiled = pytest.mark.skipif(TWIN is None, reason="the compiled twin is not built")

# (type oid, data_type): one of each kind of the type mapping's SQLite columns
TYPES = [(23, "integer"), (20, "bigint"), (16, "boolean"), (25, "text"), (1700, "numeric"),
         (701, "double precision"), (17, "bytea"), (1007, "integer[]"), (5069, "xid8"),
         (987654, "mood")]


class _Integer(int):
    """(not exactly an int: the pure path binds it)"""


def _schema(columns):
    return {"table": "t", "fingerprint": "f", "primary_key": ["id"],
            "columns": [{"name": name, "type_oid": oid, "data_type": data_type}
                        for name, (oid, data_type) in [("id", (20, "bigint")), *columns]]}


def _store(path, table_schema, *, pure=False, rows=3):
    store = MirrorStore(path)
    if pure and store._writer.statements is not None:
        store._writer.statements.close()
        store._writer.statements = None
    shape = TableShape.from_schema(table_schema)
    store.begin_bootstrap(shape, "snap1", 0x100)
    store.load_rows("t", [{"id": key} | {c.name: None for c in shape.columns[1:]}
                          for key in range(1, rows + 1)])
    store.finish_bootstrap("t", stream_seq=1)
    return store, shape


def _contents(store, shape):
    """Every row by key, each value with its storage class (repr: -0.0 != 0.0)."""
    selected = ", ".join(f"typeof({quote(c.name)}), {quote(c.name)}" for c in shape.columns)
    return repr(store._db.execute(f'SELECT {selected} FROM "t" ORDER BY id').fetchall())


def _event(operation, ordinal, data, old=None, commit_lsn=0x200):
    event = {"table": "t", "operation": operation, "commit_lsn": f"0/{commit_lsn:X}",
             "ordinal": ordinal, "msg_id": f"0/{commit_lsn:X}:{ordinal}", "data": data}
    if old is not None:
        event["old"] = old
    return event


def _outcome(store, events):
    try:
        store.apply_transaction(events, stream_seq=2)
        return None
    except Exception as exc:  # noqa: BLE001 - comparing behaviour
        return type(exc)


def test_the_store_runs_its_batches_on_its_own_handle(tmp_path):
    if os.environ.get("CDC_PLATFORM_PURE_PYTHON"):
        pytest.skip("pure Python asked for")
    assert TWIN is not None, "the twin of cdc_platform.mirror.store is not built: pip install -e ."
    store = MirrorStore(tmp_path / "m.db")
    assert store._writer.statements is not None
    store.close()


# any value, and more often the edges where binding differs between types
column_values = st.one_of(values, st.sampled_from([
    float("nan"), -0.0, float("inf"), True, False, 2**63 - 1, 2**63, -(2**63) - 1, "", b"",
    "\ud800", "é"]))
_int64 = st.integers(-(2**63), 2**63 - 1)
# what the bridge sends for each column type, edges included (most events apply)
TYPED = {23: _int64, 20: _int64, 16: st.booleans(), 25: st.text(), 1700: st.text(),
         701: st.one_of(st.floats(), st.sampled_from([float("nan"), -0.0])),
         17: st.binary(), 1007: st.lists(st.one_of(st.none(), _int64), max_size=3),
         5069: st.integers(0, 2**64 - 1), 987654: st.text()}


def _value(oid):
    return st.one_of(st.none(), *[TYPED[oid]] * 10, column_values)


@st.composite
def _cases(draw):
    """Column types and transactions of events: mostly ones that apply (keys the table
    holds, values of the column's type), sometimes anything."""
    types = draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=4))
    names = [f"c{index}" for index in range(len(types))]
    oids = {name: oid for name, (oid, _) in zip(names, types, strict=True)} | {"other": 25}
    held, fresh = [1, 2, 3], iter(range(10, 1000))
    transactions = []
    for number in range(draw(st.integers(1, 4))):
        events = []
        for ordinal in range(draw(st.integers(1, 4))):
            operation = draw(st.sampled_from(["INSERT", "UPDATE", "UPDATE", "DELETE"]))
            # mostly every column, sometimes fewer (unchanged TOAST) or other ones
            columns = draw(st.sampled_from([names] * 8 + [names[:1], [*names, "other"]]))
            old = None
            if operation == "INSERT" or not held:
                key = next(fresh)
                held.append(key)
            else:
                key = draw(st.sampled_from(held))
                if operation == "DELETE":
                    held.remove(key)
                elif draw(st.booleans()):  # a key change
                    old, key = {"id": key}, next(fresh)
                    held[held.index(old["id"])] = key
            if draw(st.integers(0, 9)) == 0:  # anything
                key = draw(st.one_of(st.sampled_from(held or [1]), column_values))
                old = draw(st.sampled_from([None, {}, {"c0": 1}, {"id": key}]))
            data = {"id": key} | {name: draw(_value(oids[name])) for name in columns}
            events.append(_event(operation, ordinal, data, old, commit_lsn=0x200 + number))
        transactions.append(events)
    return types, transactions


@compiled
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(_cases())
def test_applied_events_equal_the_pure_path_for_any_events(tmp_path_factory, case):
    """Whatever the events (values of the column's type or not: NaN, 2^64-1, arrays, maps,
    bytes; rows of other columns, key changes, missing keys, rows the mirror does not hold),
    the store with its compiled statements leaves the table the pure path leaves, or fails
    the same way, transaction after transaction."""
    types, transactions = case
    columns = [(f"c{index}", kind) for index, kind in enumerate(types)]
    directory = tmp_path_factory.mktemp("apply")
    fast, shape = _store(directory / "fast.db", _schema(columns))
    pure, _ = _store(directory / "pure.db", _schema(columns), pure=True)
    assert fast._writer.statements is not None and pure._writer.statements is None
    for events in transactions:
        assert _outcome(fast, events) == _outcome(pure, events)
        assert _contents(fast, shape) == _contents(pure, shape)
        assert fast.state("t") == pure.state("t")
    fast.close()
    pure.close()


@compiled
def test_scalar_values_are_bound_by_the_statements(tmp_path):
    """The values events carry for their columns are all taken (the statements are not a
    refusal that always passes the test above): every width, edges included."""
    columns = [("flag", (16, "boolean")), ("name", (25, "text")),
               ("score", (701, "double precision")), ("raw", (17, "bytea")),
               ("mood", (987654, "mood"))]
    rows = [(1, True, "", 0.0, b"", "happy"),
            (-1, False, "é" * 200, -0.0, b"\x00" * 300, None),
            (2**63 - 1, None, "x" * 70000, float("inf"), None, ""),
            (-(2**63), True, "nul\x00inside", 1e-300, b"z" * 70000, 7),
            (127, False, "\U0010ffff\ud7ff\ue000", -1.5, b"\xff", 2.5)]
    names = ("id", *(name for name, _ in columns))
    fast, shape = _store(tmp_path / "fast.db", _schema(columns), rows=0)
    pure, _ = _store(tmp_path / "pure.db", _schema(columns), pure=True, rows=0)
    statements = fast._writer.statements
    assert statements is not None
    inserts = [dict(zip(names, row, strict=True)) for row in rows]
    updates = [_event("UPDATE", 0, {"id": row["id"], "name": "u", "score": -0.0})
               for row in inserts]
    fast._db.execute("BEGIN")
    assert statements.run_rows(f'INSERT INTO "t" VALUES ({", ".join("?" * len(names))})',
                               inserts, names) == len(rows)
    assert statements.run_updates('UPDATE "t" SET "name" = ?, "score" = ? WHERE "id" = ?',
                                  updates[:2], ("name", "score"), ("id",), False) == 2
    fast._db.execute("COMMIT")
    pure.apply_transaction([_event("INSERT", index, row) for index, row in enumerate(inserts)]
                           + [{**update, "ordinal": 10 + index}
                              for index, update in enumerate(updates[:2])], stream_seq=2)
    assert _contents(fast, shape) == _contents(pure, shape)


@compiled
def test_what_they_do_not_take_is_refused_and_the_statement_runs_again(tmp_path):
    """-1 for what the pure path must bind or refuse, a missing key, an SQLite error; the
    statement is reset (it runs the next batch), and the rows before the refused one are the
    caller's to roll back (the store rolls back to its savepoint)."""
    store, _ = _store(tmp_path / "m.db", _schema([("n", (20, "bigint"))]), rows=0)
    statements = store._writer.statements
    insert = 'INSERT INTO "t" VALUES (?, ?)'
    store._db.execute("BEGIN")
    for refused in ([{"id": 1, "n": float("nan")}], [{"id": 1, "n": 2**63}], [{"id": 1}],
                    [{"id": 1, "n": 1, "x": 2}], [{"id": 1, "n": [1]}], [{"id": 1, "n": "\ud800"}],
                    [{"id": 1, "n": 1}, {"id": 1, "n": 2}], [("id", 1)],
                    [{"id": 1, "n": _Integer(3)}], [{"id": 2, "n": {}}]):
        assert statements.run_rows(insert, refused, ("id", "n")) == -1, refused
    store._db.execute("ROLLBACK")
    store._db.execute("BEGIN")
    assert statements.run_rows(insert, [{"id": 5, "n": 5}], ("id", "n")) == 1
    update = 'UPDATE "t" SET "n" = ? WHERE "id" = ?'
    assert statements.run_updates(update, [_event("UPDATE", 0, {"id": 5})], ("n",), ("id",),
                                  False) == -1  # (no "n")
    assert statements.run_updates(update, [_event("UPDATE", 0, {"id": 9, "n": 1},
                                                  old={"n": 5})], ("n",), ("id",), False) == -1
    assert statements.run_updates(update, [_event("UPDATE", 0, {"id": 9, "n": 1})], ("n",),
                                  ("id",), False) == 0  # (no such row: the caller says so)
    assert statements.run_rows('INSERT INTO "nowhere" VALUES (?)', [{"id": 1}], ("id",)) == -1
    assert statements.run_rows(insert, [{"id": 6, "n": 6}], ("id",)) == -1  # (two parameters)
    store._db.execute("COMMIT")
    assert store._db.execute('SELECT id, n FROM "t"').fetchall() == [(5, 5)]


@compiled
def test_a_divergence_in_a_batch_is_found_and_nothing_of_it_stays(tmp_path):
    store, shape = _store(tmp_path / "m.db", _schema([("n", (20, "bigint"))]), rows=2)
    before = _contents(store, shape)
    with pytest.raises(DivergenceError, match="already mirrored"):
        store.apply_transaction([_event("INSERT", 0, {"id": 3, "n": 3}),
                                 _event("INSERT", 1, {"id": 1, "n": 1})], stream_seq=2)
    with pytest.raises(DivergenceError, match=r"does not hold: \{'id': 9\}"):
        store.apply_transaction([_event("UPDATE", 0, {"id": 1, "n": 3}),
                                 _event("UPDATE", 1, {"id": 9, "n": 1})], stream_seq=2)
    with pytest.raises(DivergenceError, match="does not carry key column 'id'"):
        store.apply_transaction([_event("UPDATE", 0, {"id": 1, "n": 3}),
                                 _event("UPDATE", 1, {"id": 2, "n": 1}, old={"n": 1})],
                                stream_seq=2)
    assert _contents(store, shape) == before
    store.close()


@compiled
def test_the_handle_is_the_connections_own_while_other_threads_open_theirs(tmp_path):
    """Connections opened by other threads at the same moment are not taken for the
    store's: every statement lands in the store's own file and transaction."""
    stop = threading.Event()

    def open_others(number):
        while not stop.is_set():
            sqlite3.connect(tmp_path / f"other{number}.db").close()
    others = [threading.Thread(target=open_others, args=(n,)) for n in range(2)]
    for thread in others:
        thread.start()
    try:
        for attempt in range(30):
            connection, statements = TWIN.connect(str(tmp_path / f"m{attempt}.db"),
                                                  isolation_level=None)
            assert statements is not None
            connection.execute("CREATE TABLE t (id INTEGER)")
            connection.execute("BEGIN")
            assert statements.run_rows("INSERT INTO t VALUES (?)", [{"id": attempt}],
                                       ("id",)) == 1
            assert connection.in_transaction  # (its transaction: not committed on its own)
            connection.execute("COMMIT")
            assert connection.execute("SELECT id FROM t").fetchall() == [(attempt,)]
            statements.close()
            connection.close()
    finally:
        stop.set()
        for thread in others:
            thread.join()


@compiled
def test_closed_statements_refuse_to_run(tmp_path):
    connection, statements = TWIN.connect(str(tmp_path / "m.db"), isolation_level=None)
    connection.execute("CREATE TABLE t (id INTEGER)")
    assert statements.run_rows("INSERT INTO t VALUES (?)", [{"id": 1}], ("id",)) == 1
    statements.close()
    connection.close()
    with pytest.raises(ValueError, match="closed"):
        statements.run_rows("INSERT INTO t VALUES (?, ?)", [{"id": 1}], ("id",))


class _KeyThatDropsAValue(str):
    """A key whose comparison runs Python code that replaces an already bound value of its
    row (nothing msgpack makes; an event built in Python could)."""

    row: ClassVar[dict] = {}

    def __hash__(self):
        return hash("id")

    def __eq__(self, other):
        self.row["v"] = "dropped"
        garbage = ["Z" * 4000 for _ in range(200)]  # (reuses the freed memory, if it was)
        del garbage
        return True


@compiled
def test_a_bound_value_lives_until_its_row_is_stepped(tmp_path):
    connection, statements = TWIN.connect(str(tmp_path / "m.db"), isolation_level=None)
    connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v)")
    connection.execute("INSERT INTO t VALUES (1, 'a')")
    data = {"id": 1, "v": "".join(["B"] * 4000)}  # (its only reference: no constant)
    _KeyThatDropsAValue.row = data
    event = {"data": data, "old": {_KeyThatDropsAValue("id"): 1}}
    assert statements.run_updates('UPDATE t SET id = ?, v = ? WHERE id = ?', [event],
                                  ("id", "v"), ("id",)) == 1
    assert connection.execute("SELECT v FROM t").fetchone() == ("B" * 4000,)
    statements.close()
    connection.close()


@compiled
def test_a_store_in_a_reference_cycle_is_collected_with_its_connection(tmp_path):
    """(Cython's GC clearing would empty the statements before they were finalized: the
    connection a zombie for good, with its file)"""
    import gc
    import sys

    table_schema = _schema([])
    unraisable: list = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        before = len(os.listdir("/proc/self/fd"))
        for number in range(20):
            store, _ = _store(tmp_path / f"m{number}.db", table_schema)
            cycle = [store, store._writer.statements]
            cycle.append(cycle)
            del store, cycle
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert unraisable == []
    assert len(os.listdir("/proc/self/fd")) <= before


@compiled
@pytest.mark.parametrize("operation", ["INSERT", "UPDATE"])
def test_an_error_that_ends_the_transaction_is_raised_as_itself(tmp_path, operation):
    """A full disk mid-batch: SQLite rolls back the whole transaction, no savepoint is left
    for the pure path, so SQLite's own error is what the caller sees (as on the pure
    path)."""
    for pure in (False, True):
        store, _ = _store(tmp_path / f"{operation}{pure}.db", _schema([("v", (25, "text"))]),
                          pure=pure, rows=20)
        pages = store._db.execute("PRAGMA page_count").fetchone()[0]
        store._db.execute(f"PRAGMA max_page_count = {pages + 3}")
        events = [_event(operation, index, {"id": index + (100 if operation == "INSERT" else 1),
                                            "v": "x" * 3000}) for index in range(20)]
        with pytest.raises(sqlite3.OperationalError) as raised:
            store.apply_transaction(events, stream_seq=2)
        # (raised by the statement itself, or by the next one once SQLite ended the
        # transaction: with the digests' triggers SQLite may undo just the statement)
        assert "database or disk is full" in f"{raised.value} {raised.value.__context__}", pure
        assert store._db.execute('SELECT count(*) FROM "t"').fetchone() == (20,)
        store.close()


@compiled
def test_values_python_would_adapt_are_left_to_the_pure_path(tmp_path):
    """An application that registers an sqlite3 adapter for a type the statements bind gets
    it applied as on the pure path (the chunk loader steps aside too)."""
    columns = [("x", (701, "double precision"))]
    sqlite3.register_adapter(float, lambda number: round(number, 2))
    try:
        for pure in (False, True):
            store, shape = _store(tmp_path / f"m{pure}.db", _schema(columns), pure=pure, rows=0)
            store.apply_transaction([_event("INSERT", 0, {"id": 1, "x": 1.23456})],
                                    stream_seq=2)
            assert _contents(store, shape) == repr([("integer", 1, "real", 1.23)]), pure
            chunk = msgpack.packb({"chunk": 1, "data": [{"id": 2, "x": 1.5}]})
            with store.chunk_loader("t", ("id", "x")) as load:
                assert load is not None and load(chunk, set()) is None
            store.close()
    finally:
        del sqlite3.adapters[(float, sqlite3.PrepareProtocol)]
