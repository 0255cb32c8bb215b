"""The digests the store keeps as it writes (mirror/digests.py) on real SQLite files: after
any stream of changes, schema changes and snapshot loads, by the pure path or the compiled
statements, the kept digest equals the one recomputed from the file's rows, and the file
holds it across a reopen."""

from __future__ import annotations

import contextlib
import random
import sqlite3

import msgpack
import pytest

from cdc_platform.cli import main
from cdc_platform.mirror import digests
from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.digests import (
    DIGESTS_TABLE,
    JOURNAL_TABLE,
    KEPT_TABLE,
    read_digest,
    scan_digest,
)
from cdc_platform.mirror.errors import DivergenceError
from cdc_platform.mirror.meetings import Meetings
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.verifications import parse_digest
from cdc_platform.wire.digest import (
    ALGORITHM,
    RowDigester,
    TableDigest,
    bucket_of,
    digest_rows,
    pack_totals,
)
from cdc_platform_tests.fixtures.mirror_events import event, schema_event

# (name, type oid, data_type); the key first
_COLUMNS = [("id", 20, "bigint"), ("name", 25, "text"), ("score", 701, "double precision"),
            ("raw", 17, "bytea"), ("tags", 1007, "integer[]"), ("flag", 16, "boolean"),
            ("doc", 3802, "jsonb")]


def _schema(columns, *, key=("id",), fingerprint="f1", missing=None):
    """``columns``: (name, type oid, data_type, attnum)."""
    return {"table": "t", "fingerprint": fingerprint, "primary_key": list(key),
            "columns": [{"name": name, "type_oid": oid, "data_type": data_type,
                         "attnum": attnum} | ({"missing_value": missing[name]}
                                              if missing and name in missing else {})
                        for name, oid, data_type, attnum in columns]}


def _value(rng: random.Random, oid: int):
    if rng.random() < 0.15:
        return None
    return {20: lambda: rng.randrange(-5, 10**12),
            25: lambda: rng.choice(["", "a", "é\U0001f600", "NaN", "x" * rng.randrange(50)]),
            701: lambda: rng.choice([0.0, -0.0, float("nan"), float("inf"), rng.random()]),
            17: lambda: rng.randbytes(rng.randrange(4)),
            1007: lambda: rng.choice([[], [1, None], [[1, 2], [3, 4]]]),
            16: lambda: rng.random() < 0.5,
            3802: lambda: rng.choice(["null", '{"a": 1}', "[]"])}[oid]()


def _open(path, *, pure: bool) -> MirrorStore:
    store = MirrorStore(path)
    if pure and store._writer.statements is not None:
        store._writer.statements.close()
        store._writer.statements = None
    return store


@pytest.fixture(params=["hook", "triggers"])
def recording(request, monkeypatch) -> str:
    """How the store records the rows it writes: SQLite's preupdate hook (compiled, where
    SQLite has it), or the TEMP triggers (the pure path, a SQLite without the hook)."""
    if request.param == "triggers":
        monkeypatch.setattr(digests, "has_preupdate_hook", lambda db: False)
    return request.param


def _hooked(store: MirrorStore, recording: str) -> MirrorStore:
    """``store``, recording as asked (skipped: the hook asked for, the twin not built)."""
    if (store._digests._rows is not None) != (recording == "hook"):
        store.close()
        assert recording == "hook"
        pytest.skip("the compiled store twin is not built: no preupdate hook")
    return store


def _assert_kept(store: MirrorStore, table: str = "t") -> TableDigest:
    kept = store.digest(table)
    assert kept is not None
    scanned = scan_digest(store._db, store.shape(table))
    assert kept.differing(scanned) == []
    assert read_digest(store._db, table) == kept  # what the file says, too
    return kept


class _Stream:
    """Random transactions over the table ``t`` of a store, as the bridge would send them:
    the rows it holds follow along so that every change names a row the mirror holds."""

    def __init__(self, store: MirrorStore, rng: random.Random) -> None:
        self.store, self.rng = store, rng
        self.columns = [(name, oid, data_type, attnum)
                        for attnum, (name, oid, data_type) in enumerate(_COLUMNS, 1)]
        self.next_attnum = len(self.columns) + 1
        self.keys: set[int] = set()
        self.lsn = 0x200
        self.fingerprint = 1

    def row(self, key: int) -> dict:
        return {"id": key} | {name: _value(self.rng, oid)
                              for name, oid, _, _ in self.columns[1:]}

    def new_key(self) -> int:
        key = self.rng.randrange(1, 10**9)
        while key in self.keys:
            key += 1
        self.keys.add(key)
        return key

    def change(self, lsn: str, ordinal: int) -> dict:
        rng, keys = self.rng, sorted(self.keys)
        kind = rng.random()
        if not keys or kind < 0.35:
            return event("INSERT", lsn, ordinal, data=self.row(self.new_key()), table="t")
        key = rng.choice(keys)
        if kind < 0.55:
            return event("UPDATE", lsn, ordinal, data=self.row(key), table="t")
        if kind < 0.65:  # the key moves
            self.keys.discard(key)
            return event("UPDATE", lsn, ordinal, data=self.row(self.new_key()),
                         old={"id": key}, table="t")
        if kind < 0.8:  # unchanged TOAST values: those columns are not in ``data``
            kept = rng.sample([name for name, *_ in self.columns[1:]], 2)
            data = {name: value for name, value in self.row(key).items() if name not in kept}
            return event("UPDATE", lsn, ordinal, data=data, table="t", unchanged_toast=kept)
        self.keys.discard(key)
        return event("DELETE", lsn, ordinal, data={"id": key}, old={"id": key}, table="t")

    def schema_change(self, lsn: str, ordinal: int = 0) -> dict:
        rng = self.rng
        how = rng.choice(["add", "add_default", "drop", "rename"])
        others = self.columns[1:]
        missing = None
        if how.startswith("add") or len(others) < 2:
            name = f"c{self.next_attnum}"
            self.columns.append((name, 25, "text", self.next_attnum))
            self.next_attnum += 1
            missing = {name: "dflt"} if how == "add_default" else None
        elif how == "drop":
            self.columns.remove(rng.choice(others))
        else:
            index = self.columns.index(rng.choice(others))
            name, oid, data_type, attnum = self.columns[index]
            self.columns[index] = (f"{name}_r", oid, data_type, attnum)
        self.fingerprint += 1
        return schema_event(lsn, ordinal, _schema(
            self.columns, fingerprint=f"f{self.fingerprint}", missing=missing))

    def transaction(self, seq: int) -> None:
        self.lsn += 0x10
        lsn = f"0/{self.lsn:X}"
        if self.rng.random() < 0.05:
            events = [event("TRUNCATE", lsn, 0, table="t")]
            self.keys.clear()
        elif self.rng.random() < 0.1:
            events = [self.schema_change(lsn)]
        elif self.rng.random() < 0.1:  # changes before and after a schema change, in one
            before = [self.change(lsn, ordinal) for ordinal in range(3)]
            events = [*before, self.schema_change(lsn, 3),
                      *(self.change(lsn, ordinal) for ordinal in range(3, 6))]
        else:
            events = [self.change(lsn, ordinal) for ordinal in range(self.rng.randrange(1, 30))]
        applied = self.store.apply_transaction(events, stream_seq=seq)
        assert applied.stale == {}


@pytest.mark.parametrize("pure, recording", [(False, "hook"), (True, "hook"),
                                             (False, "triggers")], indirect=["recording"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_kept_digest_equals_a_recompute_after_a_random_stream(tmp_path, pure, recording,
                                                                   seed):
    rng = random.Random(seed)
    store = _hooked(_open(tmp_path / "m.db", pure=pure), recording)
    stream = _Stream(store, rng)
    shape = TableShape.from_schema(_schema(stream.columns))
    store.begin_bootstrap(shape, "snap1", 0x100)
    names = tuple(column.name for column in shape.columns)
    loaded = [stream.row(stream.new_key()) for _ in range(60)]
    for row in loaded[40:]:  # (what the compiled loader takes: no arrays, no NaN)
        row.update(tags=None, score=rng.choice([None, -0.0, 2.5]))
    store.load_rows("t", loaded[:20])
    tuples = [tuple(row.values()) for row in loaded[20:40]]
    # (hashed beforehand, as the follower does on a worker thread: not by the trigger)
    store.load_tuples("t", names, tuples[:10], has_nan=True,
                      hashes=store.loaded_hashes("t", tuples[:10]))
    store.load_tuples("t", names, tuples[10:], has_nan=True)
    with store.chunk_loader("t", names) as load:
        chunk = msgpack.packb({"chunk": 3, "data": loaded[40:]})
        if load is not None:  # (compiled) on its own connection: the follower adds them
            assert load(chunk, set()) == (3, 20)
            if not store.loads_digested:  # (else hashed as the loader stored them)
                store.digest_loaded(store.loaded_hashes(
                    "t", [tuple(row.values()) for row in loaded[40:]]))
        else:
            store.load_rows("t", loaded[40:])
    store.finish_bootstrap("t", stream_seq=1)
    assert _assert_kept(store).counts != TableDigest(14).counts
    for seq in range(2, 80):
        stream.transaction(seq)
        _assert_kept(store)
    kept = _assert_kept(store)
    store.close()
    again = _open(tmp_path / "m.db", pure=pure)
    assert again.digest("t") == kept  # as the file has it, no recompute
    again.close()


def test_a_keyless_table_and_a_rolled_back_transaction(tmp_path):
    """Without a key every column is the key; a transaction that does not fit is rolled back
    with its rows' hashes, and what follows is counted again."""
    store = MirrorStore(tmp_path / "m.db")
    columns = [("a", 23, "integer", 1), ("b", 25, "text", 2)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns, key=())), "s", 0x100)
    store.load_rows("t", [{"a": 1, "b": "x"}, {"a": 1, "b": "x"}, {"a": 2, "b": None}])
    store.finish_bootstrap("t", stream_seq=1)
    store.apply_transaction([event("UPDATE", "0/200", 0, data={"a": 1, "b": "y"},
                                   old={"a": 1, "b": "x"}, table="t")], stream_seq=2)
    before = _assert_kept(store)
    with pytest.raises(DivergenceError, match="does not hold"):
        store.apply_transaction([
            event("INSERT", "0/300", 0, data={"a": 9, "b": "z"}, table="t"),
            event("DELETE", "0/300", 1, data={"a": 7, "b": "gone"},
                  old={"a": 7, "b": "gone"}, table="t")], stream_seq=3)
    assert _assert_kept(store) == before
    store.apply_transaction([event("INSERT", "0/400", 0, data={"a": 9, "b": "z"}, table="t")],
                            stream_seq=4)
    assert _assert_kept(store) != before
    store.close()


@pytest.mark.parametrize("pure", [False, True])
def test_a_batch_rolled_back_to_its_savepoint_takes_its_hashes_back(tmp_path, pure,
                                                                    recording):
    """Batches of INSERTs and UPDATEs with a value past 64 bits in their middle: the compiled
    statements and then sqlite3 give up on them halfway and they are rolled back to their
    savepoint and written again row by row: the rows written before count once (SQLite's
    preupdate hook is not told of a ROLLBACK TO: the savepoint tells the keeper)."""
    store = _hooked(_open(tmp_path / "m.db", pure=pure), recording)
    columns = [("id", 20, "bigint", 1), ("n", 20, "bigint", 2)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns)), "s", 0x100)
    store.load_rows("t", [{"id": key, "n": key} for key in range(5)])
    store.finish_bootstrap("t", stream_seq=1)
    wide = [2**64, *range(4)]  # (the row past 64 bits fourth)
    store.apply_transaction(
        [*(event("INSERT", "0/200", ordinal, data={"id": 10 + ordinal, "n": wide[ordinal - 3]},
                 table="t") for ordinal in range(5)),
         *(event("UPDATE", "0/200", ordinal, data={"id": ordinal - 5, "n": -wide[ordinal - 8]},
                 table="t") for ordinal in range(5, 10))], stream_seq=2)
    assert sum(_assert_kept(store).counts) == 10
    store.close()


def test_a_transaction_past_the_hooks_pending_bytes_keeps_its_digest(tmp_path, recording):
    """The hook keeps rows' canonical bytes to hash two at a time, and hashes what it holds
    once that passes 1 MiB: a transaction of ~6 MiB of rows (inserts, updates that keep
    their key and that change it, deletes, and a batch that gives up on a value past 64 bits
    after the limit was passed, rolled back to its savepoint and written again row by row)
    keeps the digest a recompute finds."""
    store = _hooked(_open(tmp_path / "m.db", pure=False), recording)
    columns = [("id", 20, "bigint", 1), ("n", 20, "bigint", 2), ("body", 25, "text", 3)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns)), "s", 0x100)
    store.load_rows("t", [{"id": key, "n": key, "body": "b"} for key in range(10)])
    store.finish_bootstrap("t", stream_seq=1)

    def row(key: int, n: int) -> dict:
        return {"id": key, "n": n, "body": f"{key}:{n}:" + "x" * 600}

    keys = range(100, 2100)
    changes = [*(("INSERT", row(key, key), None) for key in keys),
               *(("UPDATE", row(key, -key), None) for key in keys),  # (the key kept)
               *(("UPDATE", row(key + 10_000, 1), {"id": key}) for key in keys[:500]),
               *(("DELETE", {"id": key}, {"id": key}) for key in keys[500:1000]),
               # (~1.3 MB: the limit is passed before the batch gives up)
               *(("INSERT", row(key, 2**64 if key == 21_900 else key), None)
                 for key in range(20_000, 22_000))]
    store.apply_transaction([event(operation, "0/200", ordinal, data=data, old=old, table="t")
                             for ordinal, (operation, data, old) in enumerate(changes)],
                            stream_seq=2)
    assert sum(_assert_kept(store).counts) == 10 + 2000 - 500 + 2000
    store.close()


@pytest.mark.parametrize("alone", [False, True])
def test_a_row_that_cannot_be_hashed_is_its_tables_divergence(tmp_path, recording, alone):
    """A row written behind the mirror's back that cannot be hashed (text that is not UTF-8:
    Python's sqlite3 refuses it) makes the transaction changing it that table's divergence
    (with the preupdate hook, found at commit), rolled back with its hashes; also when it is
    the transaction's only change (the hook logs nothing for it)."""
    store = _hooked(MirrorStore(tmp_path / "m.db"), recording)
    columns = [("id", 20, "bigint", 1), ("name", 25, "text", 2)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns)), "s", 0x100)
    store.load_rows("t", [{"id": key, "name": "x"} for key in range(3)])
    store.finish_bootstrap("t", stream_seq=1)
    with contextlib.closing(sqlite3.connect(tmp_path / "m.db")) as other, other:
        other.execute("UPDATE t SET name = CAST(x'ff' AS TEXT) WHERE id = 1")
    before = store.digest("t")
    with pytest.raises(DivergenceError, match="^t: ") as raised:
        store.apply_transaction([
            *([] if alone else [event("INSERT", "0/200", 0, data={"id": 7, "name": "y"},
                                      table="t")]),
            event("UPDATE", "0/200", 1, data={"id": 1, "name": "z"}, table="t")], stream_seq=2)
    assert raised.value.table == "t"
    assert store.digest("t") == before
    assert store._db.execute("SELECT count(*) FROM t").fetchone()[0] == 3
    store.apply_transaction([event("INSERT", "0/300", 0, data={"id": 8, "name": "y"},
                                   table="t")], stream_seq=3)
    assert sum(store.digest("t").counts) == 4
    store.close()


def test_digests_off_keeps_none_and_on_again_computes_them(tmp_path):
    store = MirrorStore(tmp_path / "m.db")
    store.begin_bootstrap(TableShape.from_schema(_schema([("id", 20, "bigint", 1)])), "s",
                          0x100)
    store.load_rows("t", [{"id": 1}, {"id": 2}])
    store.finish_bootstrap("t", stream_seq=1)
    store.close()
    off = MirrorStore(tmp_path / "m.db", digests=False)
    off.apply_transaction([event("INSERT", "0/200", 0, data={"id": 3}, table="t")], 2)
    assert off.digest("t") is None
    assert off._db.execute(f"SELECT count(*) FROM {DIGESTS_TABLE}").fetchone() == (0,)
    assert off._db.execute(f"SELECT count(*) FROM {KEPT_TABLE}").fetchone() == (0,)
    off.close()
    on = MirrorStore(tmp_path / "m.db")
    assert sum(_assert_kept(on).counts) == 3
    on.close()


def _key_bucket(key: int) -> int:
    return bucket_of(RowDigester(["id"]).key_hash({"id": key}), 14)


def test_mirror_verify_finds_the_buckets_of_rows_changed_behind_the_mirrors_back(
        tmp_path, capsys):
    path = tmp_path / "m.db"
    store = MirrorStore(path)
    store.begin_bootstrap(TableShape.from_schema(_schema(
        [("id", 20, "bigint", 1), ("name", 25, "text", 2)])), "s", 0x100)
    store.load_rows("t", [{"id": key, "name": f"n{key}"} for key in range(1, 201)])
    store.finish_bootstrap("t", stream_seq=1)
    store.close()
    assert main(["mirror", "verify", "--sqlite", str(path)]) == 0
    assert capsys.readouterr().out == "t: equal (200 rows); last source verification: none\n"
    with sqlite3.connect(path) as db:  # another writer: no digest triggers here
        db.execute("DELETE FROM t WHERE id = 7")
        db.execute("UPDATE t SET name = 'changed' WHERE id = 50")
        db.execute("INSERT INTO t VALUES (1000, 'added')")
    db.close()
    assert main(["mirror", "verify", "--sqlite", str(path), "--tables", "t"]) == 1
    out = capsys.readouterr().out
    damaged = sorted({_key_bucket(key) for key in (7, 50, 1000)})
    assert f"t: {len(damaged)} of 16384 buckets differ: " in out
    assert [int(part.split(" (")[0]) for part in out.split("differ: ")[1].split("; ")[0]
            .split("), ")] == damaged
    assert "(kept 1 rows, file 0)" in out  # the deleted row's bucket (a bucket of its own)


@pytest.mark.parametrize("content, says", [
    (None, "no such file"), (b"not a database at all" * 100, "is not a mirror database"),
    (b"", "is not a mirror database")])
def test_mirror_verify_of_what_is_not_a_mirror_is_one_clear_error(tmp_path, capsys, content,
                                                                   says):
    path = tmp_path / "m.db"
    if content is not None:
        path.write_bytes(content)
    assert main(["mirror", "verify", "--sqlite", str(path)]) == 2
    captured = capsys.readouterr()
    assert says in captured.err and len(captured.err.strip().splitlines()) == 1


def test_mirror_verify_says_when_digests_are_not_kept(tmp_path, capsys):
    path = tmp_path / "m.db"
    store = MirrorStore(path, digests=False)
    store.begin_bootstrap(TableShape.from_schema(_schema([("id", 20, "bigint", 1)])), "s",
                          0x100)
    store.finish_bootstrap("t", stream_seq=1)
    store.close()
    assert main(["mirror", "verify", "--sqlite", str(path)]) == 0
    assert "not compared: its digest is not kept" in capsys.readouterr().out
    assert main(["mirror", "verify", "--sqlite", str(path), "--tables", "nope"]) == 2
    assert "not mirrored in this file: nope" in capsys.readouterr().err


def _digest_message(vid: str, lsn: int, rows: list[dict], bits: int, fingerprint: str,
                    **changed) -> dict:
    digest = TableDigest(14)
    digest_rows(digest, RowDigester(["id", "name"], ["id"]), rows)
    folded = digest.folded(bits)
    return {"type": "digest", "verification_id": vid, "table": "t",
            "lsn": f"0/{lsn:X}", "marker_subject": f"cdc.cdc-platform.watermark.{vid}",
            "schema_fingerprint": fingerprint, "algorithm": ALGORITHM, "bits": bits,
            "row_count": len(rows), "totals": pack_totals(folded.totals),
            "counts": folded.counts, "buckets": None, "duration_seconds": 0.1,
            "msg_id": f"verify:{vid}:digest"} | changed


@pytest.mark.parametrize("scan", [True, False])
async def test_meeting_a_verification_compares_the_digest_at_its_lsn(tmp_path, scan):
    """Marker at 0/300, digest lsn 0/500: the transaction at 0/400 is in the source's digest,
    the one at 0/600 not. A row deleted from the file behind the mirror's back before the
    marker: found (changed outside, and differing from the source) only by the scan."""
    store = MirrorStore(tmp_path / "m.db")
    store.begin_bootstrap(TableShape.from_schema(_schema(
        [("id", 20, "bigint", 1), ("name", 25, "text", 2)])), "s", 0x100)
    source = {key: {"id": key, "name": f"n{key}"} for key in range(1, 60)}
    store.load_rows("t", list(source.values()))
    store.finish_bootstrap("t", stream_seq=1)
    results = []
    meetings = Meetings(store, scan=scan, report=lambda line: None,
                        on_verification=lambda table, result: results.append(result))
    store.apply_transaction([event("INSERT", "0/200", 0, data={"id": 100, "name": "a"},
                                   table="t")], 2)
    source[100] = {"id": 100, "name": "a"}
    with sqlite3.connect(tmp_path / "m.db") as other:  # another writer: not counted
        other.execute("DELETE FROM t WHERE id = 5")
    other.close()
    meetings.marker("verify-a", "t", 0x300, streaming=True, inside_transaction=False)
    store.apply_transaction([
        event("UPDATE", "0/400", 0, data={"id": 7, "name": "changed"}, table="t"),
        event("DELETE", "0/400", 1, data={"id": 9}, old={"id": 9}, table="t")], 3)
    source[7] = {"id": 7, "name": "changed"}
    del source[9]
    store.apply_transaction([event("INSERT", "0/600", 0, data={"id": 200, "name": "late"},
                                   table="t")], 4)
    assert store.logging
    message = _digest_message("verify-a", 0x500, list(source.values()), 4,
                              store.state("t").fingerprint)
    result = await meetings.digest(message, "t", "verify-a")
    assert results == [result] and not store.logging
    if scan:
        assert result.status == "differ"
        assert result.buckets_differing == {_key_bucket(5) >> 10: (
            message["counts"][_key_bucket(5) >> 10] - 1,
            message["counts"][_key_bucket(5) >> 10])}
        assert result.changed_outside == [_key_bucket(5)]
        assert _assert_kept(store)  # the kept digest reset from the rows
    else:
        assert (result.status, result.changed_outside) == ("equal", [])
    assert store.verification_recorded("verify-a", "t")
    assert await meetings.digest(message, "t", "verify-a") is None  # met once
    unmet = await meetings.digest({**message, "verification_id": "verify-b"}, "t", "verify-b")
    assert (unmet.status, unmet.why) == ("not_comparable", "the marker was not seen")
    store.close()


@pytest.mark.parametrize("changed, why", [
    ({"totals": b"\x00" * 7}, "need"), ({"counts": [1, -1]}, "types"),
    ({"table": "other"}, "not its subject's"), ({"verification_id": "x"}, "not its subject's"),
    ({"bits": "4"}, "types"), ({"type": "watermark"}, "not a digest message"),
    ({"lsn": "nope"}, "LSN"), ({"buckets": [0, 0]}, "distinct")])
def test_a_digest_message_that_is_not_one_is_refused_saying_why(changed, why):
    message = _digest_message("verify-a", 0x500, [{"id": 1, "name": "a"}], 1, "f") | changed
    with pytest.raises((ValueError, TypeError), match=why):
        parse_digest(message, "t", "verify-a")


async def test_a_verification_whose_log_passes_its_limit_is_not_comparable(tmp_path):
    store = MirrorStore(tmp_path / "m.db")
    store.begin_bootstrap(TableShape.from_schema(_schema(
        [("id", 20, "bigint", 1), ("name", 25, "text", 2)])), "s", 0x100)
    store.finish_bootstrap("t", stream_seq=1)
    store.most_logged = 3
    meetings = Meetings(store, scan=False, report=lambda line: None)
    meetings.marker("verify-a", "t", 0x300, streaming=True, inside_transaction=False)
    store.apply_transaction([event("INSERT", "0/400", ordinal, data={"id": key, "name": "x"},
                                   table="t") for ordinal, key in enumerate(range(1, 9))], 2)
    assert not store.logging  # (stopped logging: nothing more to keep)
    message = _digest_message("verify-a", 0x500, [], 0, store.state("t").fingerprint)
    result = await meetings.digest(message, "t", "verify-a")
    assert result.status == "not_comparable" and "CDC_MIRROR_VERIFY_LOG_ROWS" in result.why
    with contextlib.closing(sqlite3.connect(tmp_path / "m.db")) as db:
        assert db.execute("SELECT count(*) FROM _cdc_mirror_digest_log").fetchone() == (0,)
    store.close()


def test_a_table_whose_columns_the_file_orders_otherwise_keeps_its_digest(tmp_path):
    """SQLite appends an added column where the source's shape may list it elsewhere: the
    same values, the same digest."""
    store = MirrorStore(tmp_path / "m.db")
    columns = [("id", 20, "bigint", 1), ("name", 25, "text", 2)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns)), "s", 0x100)
    store.load_rows("t", [{"id": 1, "name": "a"}])
    store.finish_bootstrap("t", stream_seq=1)
    wider = _schema([columns[0], ("extra", 23, "integer", 3), columns[1]], fingerprint="f2",
                    missing={"extra": 4})
    store.apply_transaction([schema_event("0/200", 0, wider), event(
        "INSERT", "0/200", 0, data={"id": 2, "name": "b", "extra": 5}, table="t")], 2)
    assert sum(_assert_kept(store).counts) == 2
    store.close()


@pytest.mark.parametrize("change", ["altered", "unchanged"])
def test_a_schema_that_turns_a_columns_values_back_otherwise_recomputes_the_digest(
        tmp_path, change):
    """A table shaped before base types and is_array were kept (a domain over float8, a
    domain over an enum's array: NaN and arrays read back as text) learns them from a
    schema event: its rows hash otherwise from then on, so its kept digest is recomputed
    (else the upkeep would take out hashes it never added)."""
    store = MirrorStore(tmp_path / "m.db")
    columns = [("id", 20, "bigint", 1), ("f", 16500, "score", 2), ("mo", 16510, "moods", 3)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns)), "s", 0x100)
    store.load_rows("t", [{"id": 1, "f": float("nan"), "mo": ["sad", None]},
                          {"id": 2, "f": 1.5, "mo": [["ok"], ["sad"]]}])
    store.finish_bootstrap("t", stream_seq=1)
    before = _assert_kept(store)
    known = _schema(columns + [("extra", 23, "integer", 4)] * (change == "altered"),
                    fingerprint="f2" if change == "altered" else "f1")
    for column, base in zip(known["columns"][1:3], (701, 16504), strict=True):
        column.update(base_type_oid=base, is_array=column["name"] == "mo")
    store.apply_transaction([schema_event("0/200", 0, known), event(
        "UPDATE", "0/200", 1, data={"id": 1, "f": 2.5, "mo": ["ok"]}, table="t")], 2)
    assert _assert_kept(store) != before
    assert [c.holds_arrays for c in store.shape("t").columns][:3] == [False, False, True]
    store.close()


def test_a_commits_buckets_are_journaled_and_compacted_once_the_journal_fills(
        tmp_path, monkeypatch):
    """A commit appends the buckets it touched to the table's journal (one row) instead of
    rewriting them in the buckets table; a full journal is compacted into one row of the
    non-empty buckets. The file's digest is the kept one throughout, also after a reopen."""
    monkeypatch.setattr(digests, "JOURNAL_ENTRIES", 20)
    store = MirrorStore(tmp_path / "m.db")
    store.begin_bootstrap(TableShape.from_schema(_schema([("id", 20, "bigint", 1)])), "s",
                          0x100)
    store.load_rows("t", [{"id": key} for key in range(5)])
    store.finish_bootstrap("t", stream_seq=1)
    db = store._db

    def journaled() -> list[int]:  # each row's entries
        return [length // digests._ENTRY.size for (length,) in db.execute(
            f"SELECT length(buckets) FROM {JOURNAL_TABLE} ORDER BY rowid")]
    lsn = 0x200
    for key in (100, 105):  # (the loaded chunk made 5 entries) 10, then 15
        lsn += 0x10
        store.apply_transaction([event("INSERT", f"0/{lsn:X}", ordinal,
                                       data={"id": key + ordinal}, table="t")
                                 for ordinal in range(5)], lsn)
        _assert_kept(store)
    assert journaled() == [5, 5, 5]
    store.apply_transaction([event("DELETE", "0/400", ordinal, data={"id": key},
                                   old={"id": key}, table="t")
                             for ordinal, key in enumerate(range(100, 108))], 3)
    kept = _assert_kept(store)  # (23 entries: compacted into the 7 rows' buckets)
    assert journaled() == [sum(1 for count in kept.counts if count)] == [7]
    assert db.execute(f"SELECT count(*) FROM {DIGESTS_TABLE}").fetchone() == (0,)
    store.apply_transaction([event("INSERT", "0/500", 0, data={"id": 999}, table="t")], 4)
    assert journaled() == [7, 1]
    kept = _assert_kept(store)
    store.close()
    again = MirrorStore(tmp_path / "m.db")
    assert again.digest("t") == kept
    assert sum(kept.counts) == 8
    again.close()


def test_a_file_whose_buckets_were_written_back_reads_and_compacts_them(tmp_path,
                                                                          monkeypatch):
    """A file written before compaction holds its buckets in the buckets table and what
    changed since in the journal: read together; compacted, a bucket emptied since has no
    entry, so the table's rows in the buckets table go (else they would say it is not)."""
    store = MirrorStore(tmp_path / "m.db")
    store.begin_bootstrap(TableShape.from_schema(_schema([("id", 20, "bigint", 1)])), "s",
                          0x100)
    store.load_rows("t", [{"id": key} for key in range(6)])
    store.finish_bootstrap("t", stream_seq=1)
    kept = _assert_kept(store)
    db = store._db
    with db:  # (as a mirror before compaction wrote the buckets back)
        db.execute(f"DELETE FROM {JOURNAL_TABLE}")
        db.executemany(f"INSERT INTO {DIGESTS_TABLE} VALUES ('t', ?, ?, ?)",
                       [(bucket, total - (1 << 64) if total >> 63 else total, count)
                        for bucket, (total, count) in enumerate(zip(kept.totals, kept.counts))
                        if count])
    store.close()
    monkeypatch.setattr(digests, "JOURNAL_ENTRIES", 3)
    store = MirrorStore(tmp_path / "m.db")
    assert store.digest("t") == kept
    store.apply_transaction([event("DELETE", "0/200", ordinal, data={"id": key},
                                   old={"id": key}, table="t")
                             for ordinal, key in enumerate(range(4))], 2)
    assert store._db.execute(f"SELECT count(*) FROM {JOURNAL_TABLE}").fetchone() == (1,)
    assert sum(_assert_kept(store).counts) == 2
    store.close()


def test_the_compiled_row_hashes_are_the_python_ones(tmp_path, monkeypatch, recording):
    """The store's compiled ``Statements`` hash the rows it writes in C, from SQLite's
    preupdate hook or in the triggers' function: the same hashes as the Python function for
    every kind of stored value, the Python function called only for text that ``wire_value``
    turns back (a float's ``NaN``, an xid8's digits, an array's JSON)."""
    store = _hooked(MirrorStore(tmp_path / "m.db"), recording)
    if store._writer.statements is None:
        store.close()
        pytest.skip("the store's compiled twin is not in use")
    columns = [("id", 20, "bigint", 1), ("t", 25, "text", 2), ("f", 701, "double precision", 3),
               ("b", 17, "bytea", 4), ("x", 5069, "xid8", 5), ("a", 1007, "integer[]", 6),
               ("n", 1700, "numeric", 7), ("flag", 16, "boolean", 8)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns)), "s", 0x100)
    plain = [{"id": -(2**63), "t": "", "f": -0.0, "b": b"", "x": 0, "a": None, "n": "1.50",
              "flag": True},
             {"id": 2**63 - 1, "t": "é\U0001f600\x00z", "f": float("inf"), "b": b"\x00\xff",
              "x": 2**63 - 1, "a": None, "n": "NaN", "flag": False},
             {"id": 0, "t": None, "f": None, "b": None, "x": None, "a": None, "n": None,
              "flag": None},
             {"id": 7, "t": "NaN", "f": 1e-320, "b": b"x" * 3000, "x": 5, "a": None,
              "n": "-0", "flag": None},
             {"id": 11, "t": "a", "f": 3.0, "b": None, "x": 1, "a": None, "n": None,
              "flag": None}]
    turned_back = [{"id": 8, "t": "a", "f": float("nan"), "b": None, "x": 1, "a": None,
                    "n": None, "flag": None},
                   {"id": 9, "t": "a", "f": 2.5, "b": None, "x": 2**64 - 1, "a": None,
                    "n": None, "flag": None},
                   {"id": 10, "t": "a", "f": 2.5, "b": None, "x": 1, "a": [[1, None], [3, 4]],
                    "n": None, "flag": None}]
    hasher, table_id = store._digests._hasher, store._digests._ids["t"]
    python_calls = []
    python_call = type(hasher).__call__
    monkeypatch.setattr(type(hasher), "__call__",
                        lambda self, *stored: python_calls.append(stored[0]) or python_call(
                            self, *stored))
    store.load_rows("t", plain + turned_back)
    store.finish_bootstrap("t", stream_seq=1)
    assert len(python_calls) == len(turned_back)  # (the others hashed in C)
    names = ", ".join(f'"{name}"' for name, *_ in columns)
    by_python = [(row[0], python_call(hasher, table_id, *row)) for row in store._db.execute(
        f"SELECT {names} FROM t ORDER BY id")]
    if recording == "triggers":
        assert store._db.execute(f"SELECT id, cdc_row_hashes({table_id}, {names}) FROM t "
                                 "ORDER BY id").fetchall() == by_python
    by_python_digest = TableDigest(digests.BITS)
    for _, packed in by_python:
        by_python_digest.add(*digests._pair.unpack(packed))
    assert _assert_kept(store) == by_python_digest
    store.close()


def test_a_utf16_files_text_is_hashed_as_the_text_it_holds(tmp_path):
    """The preupdate hook reads a UTF-8 file's text as stored (no copy); a file made UTF-16
    elsewhere holds text the hook must read as UTF-8 (SQLite converts it): the kept digest
    is the recomputed one either way, for the store's writes and the chunk loader's."""
    with contextlib.closing(sqlite3.connect(tmp_path / "m.db")) as made:
        made.execute("PRAGMA encoding = 'UTF-16le'")
        made.execute("CREATE TABLE made_elsewhere (x)")
    store = _hooked(MirrorStore(tmp_path / "m.db"), "hook")
    assert store._db.execute("PRAGMA encoding").fetchone()[0] == "UTF-16le"
    columns = [("id", 20, "bigint", 1), ("name", 25, "text", 2)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns)), "s", 0x100)
    with store.chunk_loader("t", ("id", "name")) as load:
        rows = [{"id": key, "name": f"é{key}\U0001f600"} for key in range(10)]
        if load is not None:
            assert load(msgpack.packb({"chunk": 0, "data": rows}), set()) == (0, 10)
        else:
            store.load_rows("t", rows)
    store.finish_bootstrap("t", stream_seq=1)
    store.apply_transaction([
        event("INSERT", "0/200", 0, data={"id": 20, "name": "ünï"}, table="t"),
        event("UPDATE", "0/200", 1, data={"id": 3, "name": "ça"}, table="t"),
        event("UPDATE", "0/200", 2, data={"id": 30, "name": "z"}, old={"id": 4}, table="t")],
        stream_seq=2)
    assert sum(_assert_kept(store).counts) == 11
    store.close()


def test_chunks_the_compiled_loader_stores_are_hashed_as_it_stores_them(tmp_path,
                                                                         monkeypatch):
    """With the preupdate hook, the compiled chunk loader hashes each row as its own
    connection stores it, and a loaded chunk is in the table's digest when ``load`` returns
    (not decoded again and hashed by the follower); the Python function only for the rows
    whose text ``wire_value`` turns back."""
    store = _hooked(MirrorStore(tmp_path / "m.db"), "hook")
    columns = [("id", 20, "bigint", 1), ("name", 25, "text", 2),
               ("f", 701, "double precision", 3), ("x", 5069, "xid8", 4), ("b", 17, "bytea", 5)]
    shape = TableShape.from_schema(_schema(columns))
    store.begin_bootstrap(shape, "s", 0x100)
    rows = [{"id": key, "name": f"n{key}" if key % 3 else None, "f": key / 3, "x": key,
             "b": bytes([key % 256])} for key in range(200)]
    rows[7]["x"] = "not digits"  # (stored as text: wire_value looks at it)
    hasher = store._digests._hasher
    python_calls = []
    python_call = type(hasher).__call__
    monkeypatch.setattr(type(hasher), "__call__",
                        lambda self, *stored: python_calls.append(stored[0]) or python_call(
                            self, *stored))
    with store.chunk_loader("t", tuple(name for name, *_ in columns)) as load:
        assert load is not None and store.loads_digested
        assert load(msgpack.packb({"chunk": 0, "data": rows[:150]}), set()) == (0, 150)
        assert load(msgpack.packb({"chunk": 1, "data": rows[150:]}), set()) == (1, 50)
        assert load(msgpack.packb({"chunk": 2, "data": rows[:1]}), set()) is None  # (a dup)
    assert len(python_calls) == 1
    store.finish_bootstrap("t", stream_seq=1)
    assert sum(_assert_kept(store).counts) == 200
    store.close()


def test_a_loaders_chunks_after_a_rollback_of_the_store_are_still_counted(tmp_path):
    """The store rolling back (the follower abandoning a pass: another table's bootstrap
    ended) follows its tables again; a chunk loader opened before adds its later chunks
    under the id it was given, which must still be the table's (a new id dropped them)."""
    store = _hooked(MirrorStore(tmp_path / "m.db"), "hook")
    columns = [("id", 20, "bigint", 1), ("name", 25, "text", 2)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns)), "s", 0x100)
    rows = [{"id": key, "name": f"n{key}"} for key in range(100)]
    with store.chunk_loader("t", ("id", "name")) as load:
        assert load is not None and store.loads_digested
        assert load(msgpack.packb({"chunk": 0, "data": rows[:60]}), set()) == (0, 60)
        store.begin()
        store.rollback()
        assert load(msgpack.packb({"chunk": 1, "data": rows[60:]}), set()) == (1, 40)
    store.finish_bootstrap("t", stream_seq=1)
    assert sum(_assert_kept(store).counts) == 100
    store.close()


@pytest.mark.parametrize("pure", [False, True])
def test_a_transaction_truncating_and_changing_shape_between_changes_folds_its_deltas(
        tmp_path, pure):
    """Changes, a TRUNCATE, changes, a schema change (the table's triggers under a new id),
    changes, in one transaction: the kept digest is the recomputed one, and the deltas the
    fold gives (those a verification logs) are exactly the buckets' moves."""
    store = _open(tmp_path / "m.db", pure=pure)
    columns = [("id", 20, "bigint", 1), ("name", 25, "text", 2)]
    store.begin_bootstrap(TableShape.from_schema(_schema(columns)), "s", 0x100)
    store.load_rows("t", [{"id": key, "name": f"n{key}"} for key in range(50)])
    store.finish_bootstrap("t", stream_seq=1)
    before = store.digest("t")
    wider = _schema([*columns, ("extra", 23, "integer", 3)], fingerprint="f2")
    events = [event("INSERT", "0/200", 0, data={"id": 100, "name": "a"}, table="t"),
              event("DELETE", "0/200", 1, data={"id": 3}, old={"id": 3}, table="t"),
              event("TRUNCATE", "0/200", 2, table="t"),
              *(event("INSERT", "0/200", ordinal, data={"id": ordinal, "name": "b"}, table="t")
                for ordinal in range(3, 8)),
              schema_event("0/200", 8, wider),
              *(event("INSERT", "0/200", ordinal, data={"id": ordinal, "name": "c", "extra": 1},
                      table="t") for ordinal in range(8, 12)),
              event("UPDATE", "0/200", 12, data={"id": 4, "name": "d", "extra": 2}, table="t")]
    store.begin()
    for change in events:
        store.apply(change)
    store._writer.flush()
    deltas = store._digests.fold({"t"})["t"]
    store.commit(2)
    after = _assert_kept(store)
    assert before is not None and sum(after.counts) == 9
    moved = {bucket: ((after.totals[bucket] - before.totals[bucket]) % 2**64,
                      after.counts[bucket] - before.counts[bucket])
             for bucket in range(len(after.counts))
             if (after.totals[bucket], after.counts[bucket])
             != (before.totals[bucket], before.counts[bucket])}
    assert {bucket: delta for bucket, delta in deltas.items() if delta != (0, 0)} == moved
    store.close()
