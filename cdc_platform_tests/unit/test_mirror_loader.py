"""The compiled chunk loader (``_speedups/store.pyx``: msgpack chunk bytes straight into SQLite)
against the store's pure path (decode, then ``executemany``), on real SQLite files: the same
rows, values and storage classes for any values; what it does not take (a chunk already
loaded too) handed back with nothing written."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_platform.mirror.columns import TableShape, quote
from cdc_platform.mirror.errors import DivergenceError
from cdc_platform.mirror.snapshots import decode_chunk
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.speedups import compiled_twin
from cdc_platform_tests.msgpack_values import values

LOADER = compiled_twin("cdc_platform.mirror.store")
compiled = pytest.mark.skipif(LOADER is None, reason="the compiled loader is not built")

# (type oid, data_type): one of each kind of the type mapping's SQLite columns
TYPES = [(23, "integer"), (20, "bigint"), (16, "boolean"), (25, "text"), (1700, "numeric"),
         (701, "double precision"), (17, "bytea"), (1007, "integer[]"), (5069, "xid8"),
         (987654, "mood")]


def _schema(table, columns, key=()):
    return {"table": table, "fingerprint": "f", "primary_key": list(key),
            "columns": [{"name": name, "type_oid": oid, "data_type": data_type}
                        for name, (oid, data_type) in columns]}


def _store(path, table_schema):
    store = MirrorStore(path)
    shape = TableShape.from_schema(table_schema)
    store.begin_bootstrap(shape, "snap1", 0x100)
    return store, shape, tuple(c.name for c in shape.columns)


def _contents(store, shape):
    """Every row in insertion order, each value with its storage class (repr: -0.0 != 0.0)."""
    selected = ", ".join(f"typeof({quote(c.name)}), {quote(c.name)}" for c in shape.columns)
    return repr(store._db.execute(
        f"SELECT {selected} FROM {quote(shape.table)} ORDER BY rowid").fetchall())


def _pure_load(store, table, columns, data):
    chunk = decode_chunk(data, columns)
    if chunk.as_tuples:
        store.load_tuples(table, columns, chunk.rows, has_nan=chunk.has_nan)
    else:
        store.load_rows(table, chunk.rows)


def _outcome(load):
    try:
        load()
        return None
    except Exception as exc:  # noqa: BLE001 - comparing behaviour
        return type(exc)


def _chunk(number, columns, rows):
    return msgpack.packb({"table": "t", "operation": "snapshot", "chunk": number,
                          "data": [dict(zip(columns, row, strict=True)) for row in rows],
                          "partition": 0}, use_bin_type=True)


def test_the_loader_is_built():
    if os.environ.get("CDC_PLATFORM_PURE_PYTHON"):
        pytest.skip("pure Python asked for")
    assert LOADER is not None, "the twin of cdc_platform.mirror.store is not built: pip install -e ."


column_sets = st.lists(st.sampled_from(TYPES), min_size=1, max_size=6)


@compiled
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(column_sets.flatmap(lambda types: st.tuples(
    st.just(types), st.lists(st.tuples(*[values] * len(types)), max_size=5))))
def test_loaded_rows_equal_the_pure_path_for_any_values(tmp_path_factory, case):
    """Whatever the values (of the column's type or not: NaN, 2^64-1, arrays, maps, bytes,
    text of any size), the loader leaves the table the pure path leaves, or hands the chunk
    back and the pure path loads it (or fails the same way)."""
    types, rows = case
    columns = [(f"c{index}", kind) for index, kind in enumerate(types)]
    directory = tmp_path_factory.mktemp("load")
    fast, shape, names = _store(directory / "fast.db", _schema("t", columns))
    pure, _, _ = _store(directory / "pure.db", _schema("t", columns))
    data = _chunk(3, names, rows)
    with fast.chunk_loader("t", names) as load:
        assert load is not None
        taken = load(data, set())
        fast_error = None if taken else _outcome(lambda: _pure_load(fast, "t", names, data))
    pure_error = _outcome(lambda: _pure_load(pure, "t", names, data))
    assert fast_error == pure_error
    assert _contents(fast, shape) == _contents(pure, shape)
    if taken:
        assert taken == (3, len(rows))
    fast.close()
    pure.close()


@compiled
def test_scalar_rows_are_taken_and_equal_the_pure_path(tmp_path):
    """The values a snapshot carries for its columns are all taken (the loader is not a
    refusal that always passes the test above): every msgpack width, edges included."""
    columns = [("id", (20, "bigint")), ("flag", (16, "boolean")), ("name", (25, "text")),
               ("score", (701, "double precision")), ("raw", (17, "bytea")),
               ("mood", (987654, "mood")), ("big", (5069, "xid8"))]
    rows = [(1, True, "", 0.0, b"", "happy", 2**63 - 1),
            (-1, False, "é" * 200, -0.0, b"\x00" * 300, None, 0),
            (2**63 - 1, None, "x" * 70000, float("inf"), None, "", -(2**63)),
            (-(2**63), True, "nul\x00inside", 1e-300, b"z" * 70000, "ok", 255),
            (127, False, "\U0010ffff\ud7ff\ue000", -1.5, b"\xff", "é", 65536),
            (-33, True, "x" * 31, float("-inf"), b"x" * 255, "x" * 32, 2**32)]
    fast, shape, names = _store(tmp_path / "fast.db", _schema("t", columns, key=["id"]))
    pure, _, _ = _store(tmp_path / "pure.db", _schema("t", columns, key=["id"]))
    chunks = [_chunk(number, names, rows[number::2]) for number in range(2)]
    seen: set[int] = set()
    with fast.chunk_loader("t", names) as load:
        assert load is not None
        for data in chunks:
            number, count = load(data, seen)
            seen.add(number)
            assert count == 3
        for data in chunks:  # a chunk stored twice: nothing written, the pure path skips it
            assert load(data, seen) is None
    for data in chunks:
        _pure_load(pure, "t", names, data)
    assert _contents(fast, shape) == _contents(pure, shape)
    assert fast._db.execute('SELECT count(*) FROM "t"').fetchone() == (6,)
    assert (tmp_path / "fast.db-wal").stat().st_size == 0  # checkpointed when it closed


@compiled
def test_a_reader_in_the_way_does_not_hold_up_closing(tmp_path):
    """The closing checkpoint gives up after a short wait; the rows are committed anyway."""
    store, _, names = _store(tmp_path / "m.db", _schema("t", [("id", (20, "bigint"))]))
    reader = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
    reader.execute("BEGIN")
    reader.execute('SELECT count(*) FROM "t"').fetchone()  # a read transaction stays open
    started = time.monotonic()
    with store.chunk_loader("t", names) as load:
        assert load is not None
        assert load(_chunk(1, names, [(1,), (2,)]), set()) == (1, 2)
    assert time.monotonic() - started < 2
    reader.execute("COMMIT")
    assert store._db.execute('SELECT count(*) FROM "t"').fetchone() == (2,)
    reader.close()


@compiled
def test_what_it_does_not_take_is_handed_back_with_nothing_written(tmp_path):
    columns = [("id", (20, "bigint")), ("name", (25, "text"))]
    store, shape, names = _store(tmp_path / "m.db", _schema("t", columns, key=["id"]))
    good = _chunk(1, names, [(1, "a"), (2, "b")])
    refused = [
        *(good[:cut] for cut in range(len(good))),  # every truncation
        good + b"\xc0",  # bytes after the chunk
        msgpack.packb({"chunk": 1, "data": [{"name": "a", "id": 1}]}),  # another order
        msgpack.packb({"chunk": 1, "data": [{"id": 1}]}),  # other columns
        msgpack.packb({"chunk": 1, "data": [{"id": 1, "name": "a"}, {"id": float("nan"),
                                                                     "name": "b"}]}),
        msgpack.packb({"chunk": 1, "data": [{"id": 2**64 - 1, "name": "a"}]}),
        msgpack.packb({"chunk": 1, "data": [{"id": 1, "name": ["a"]}]}),
        msgpack.packb({"chunk": 1, "data": [{"id": 1, "name": msgpack.ExtType(1, b"x")}]}),
        msgpack.packb({"data": [{"id": 1, "name": "a"}]}),  # no chunk number
        msgpack.packb({"chunk": "1", "data": [{"id": 1, "name": "a"}]}),
        msgpack.packb({"chunk": [1], "data": [{"id": 1, "name": "a"}]}),  # (unhashable)
        b"\xde\x00\x10\x91\x01\x01",  # a list as a map key
        msgpack.packb({"chunk": 1}),  # no rows
        msgpack.packb({"chunk": 1, "data": [{"id": 1, "name": "a"}, {"id": 1, "name": "b"}]}),
        b'{"chunk": 1, "data": [{"id": 1, "name": "a"}]}',  # JSON
    ]
    with store.chunk_loader("t", names) as load:
        assert load is not None
        for data in refused:
            assert load(data, set()) is None, data
            assert _contents(store, shape) == "[]"
        data_first = msgpack.packb({"data": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}],
                                    "chunk": 1})
        assert load(data_first, {1}) is None  # loaded before: rolled back, the pure path skips
        assert _contents(store, shape) == "[]"
        assert load(good, set()) == (1, 2)
        assert load(good, set()) is None  # its keys are mirrored: the pure path's error
        with pytest.raises(DivergenceError, match="already mirrored"):
            _pure_load(store, "t", names, good)
    assert store._db.execute('SELECT id, name FROM "t" ORDER BY id').fetchall() == [
        (1, "a"), (2, "b")]


@compiled
@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=12) | st.lists(st.integers(0, 0x10FFFF), max_size=4).map(
    lambda points: "".join(map(chr, points)).encode("utf-8", "surrogatepass")))
def test_text_is_taken_exactly_when_python_decodes_it(tmp_path_factory, raw):
    """Strict UTF-8, as Python's decoder: no overlong form, surrogate or cut sequence."""
    try:
        raw.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    directory = tmp_path_factory.mktemp("utf8")
    store, _, names = _store(directory / "m.db", _schema("t", [("s", (25, "text"))]))
    data = b"\x82\xa5chunk\x01\xa4data\x91\x81\xa1s\xd9" + bytes([len(raw)]) + raw
    with store.chunk_loader("t", names) as load:
        assert load is not None
        assert (load(data, set()) is not None) == valid
    if valid:
        assert store._db.execute('SELECT s FROM "t"').fetchone() == (raw.decode(),)
    store.close()


def test_no_loader_for_an_in_memory_database_or_a_closed_one(tmp_path):
    store = MirrorStore(":memory:")
    store.begin_bootstrap(TableShape.from_schema(_schema("t", [("id", (20, "bigint"))])),
                          "snap1", 0x100)
    with store.chunk_loader("t", ("id",)) as load:
        assert load is None  # (a second connection would open another, empty, database)
    store.close()
    if LOADER is None:
        return
    file = tmp_path / "m.db"
    sqlite3.connect(file).execute("CREATE TABLE t (id)").connection.close()
    loader = LOADER.ChunkLoader(str(file), "INSERT INTO t (id) VALUES (?)", ("id",))
    loader.close()
    with pytest.raises(ValueError, match="closed"):
        loader.load(_chunk(1, ("id",), [(1,)]), set())
    with pytest.raises(ValueError, match="no such table"):
        LOADER.ChunkLoader(str(file), "INSERT INTO nope (id) VALUES (?)", ("id",))
    with pytest.raises(ValueError, match="one value per column"):
        LOADER.ChunkLoader(str(file), "INSERT INTO t (id) VALUES (?)", ("id", "other"))


@compiled
def test_a_lock_held_by_another_thread_is_waited_for_not_deadlocked(tmp_path):
    """SQLite waits for a lock without the GIL, so the thread holding it can let it go."""
    store, _, names = _store(tmp_path / "m.db", _schema("t", [("id", (20, "bigint"))]))
    locked, release = threading.Event(), threading.Event()

    def hold_the_write_lock():
        other = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        locked.set()
        time.sleep(0.3)
        other.execute("COMMIT")
        other.close()
        release.set()

    holder = threading.Thread(target=hold_the_write_lock)
    with store.chunk_loader("t", names) as load:
        assert load is not None
        holder.start()
        locked.wait(5)
        started = time.monotonic()
        assert load(_chunk(1, names, [(1,), (2,)]), set()) == (1, 2)
        assert release.is_set() and time.monotonic() - started < 3
    holder.join()


def test_no_loader_inside_a_transaction_or_for_a_file_name_sqlite_cannot_name(tmp_path):
    """(inside one, each chunk would wait out the busy timeout before the pure path)"""
    store, _, names = _store(tmp_path / "m.db", _schema("t", [("id", (20, "bigint"))]))
    store._db.execute("BEGIN")
    with store.chunk_loader("t", names) as load:
        assert load is None
    store._db.execute("ROLLBACK")
    store.close()
    odd = tmp_path / "p\udcff"  # not UTF-8: PRAGMA database_list cannot return it
    odd.mkdir()
    store, _, names = _store(odd / "m.db", _schema("t", [("id", (20, "bigint"))]))
    with store.chunk_loader("t", names) as load:
        assert load is None
    store.load_tuples("t", names, [(1,)], has_nan=False)  # the pure path loads it
    store.close()


@compiled
def test_another_sqlite_copy_in_the_process_keeps_the_loader_out(tmp_path):
    """A SQLite of another soname preloaded: ``_sqlite3`` binds to it (the global scope comes
    first), so the loader must not use the one ``_sqlite3`` depends on (two copies in one
    process can drop each other's file locks)."""
    import _sqlite3
    import subprocess
    import sys

    maps = Path("/proc/self/maps")
    system = next((line.split()[-1] for line in maps.read_text().splitlines()
                   if "/libsqlite3.so" in line), None) if maps.exists() else None
    if system is None:
        pytest.skip(f"no shared libsqlite3 behind {_sqlite3.__file__}")
    image = Path(system).read_bytes()
    if image.count(b"libsqlite3.so.0\x00") != 1:
        pytest.skip("cannot rename this libsqlite3's soname")
    other = tmp_path / "libsqlite3.so.9"  # the same library under another soname
    other.write_bytes(image.replace(b"libsqlite3.so.0\x00", b"libsqlite3.so.9\x00"))
    probe = ("import cdc_platform.mirror.store as store; "
             "print('twin' if store._twin else 'pure')")
    env = {**os.environ, "LD_PRELOAD": str(other)}
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, check=True).stdout.strip() == "pure"
    env.pop("LD_PRELOAD")
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, check=True).stdout.strip() == "twin"
