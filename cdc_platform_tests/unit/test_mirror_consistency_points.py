"""Consistency across tables on a real SQLite file: a shadow follows the stream and is swapped
in only where it and the streaming tables meet at one LSN, recorded with the rows."""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3

from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.consistency import (
    consistent_point,
    joining,
    shadow_event,
    shadow_name,
    table_point,
)
from cdc_platform.mirror.follower import Mirror, _Following
from cdc_platform.mirror.positions import CONSISTENT_TABLE
from cdc_platform.mirror.status import status_lines
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.transactions import TransactionCollector
from cdc_platform.settings import PlatformSettings
from cdc_platform_tests.fixtures.mirror_events import bootstrapped, event, schema


def test_points():
    assert table_point(0x300, 0) == 0x300  # fresh from its snapshot
    assert table_point(0x300, 0x400) == 0x401  # after its last applied transaction
    assert consistent_point([], None) is None
    assert consistent_point([0x300], None) == 0x300  # one table: its own point
    assert consistent_point([0x300, 0x300], None) == 0x300
    assert consistent_point([0x100, 0x300], None) is None  # nothing read between them
    assert consistent_point([0x100, 0x300], 0x2ff) == 0x300  # the pass read up to there
    assert consistent_point([0x100, 0x300], 0x500) == 0x501
    assert consistent_point([0x100, 0x300], 0x200) is None


def test_joining_keeps_the_streaming_tables_consistent():
    # nothing streams yet: the first shadow joins alone, the other waits
    assert joining({}, {"a": 0x100, "b": 0x300}, None) == (["a"], 0x100)
    assert joining({"a": 0x201}, {"b": 0x300}, 0x200) == ([], 0x201)
    assert joining({"a": 0x201}, {"b": 0x300}, 0x2ff) == (["b"], 0x300)
    assert joining({"a": 0x401}, {"b": 0x300, "c": 0x900}, 0x400) == (["b"], 0x401)


def test_a_shadow_event_names_the_shadow_in_its_schema_too():
    rewritten = shadow_event({"table": "t", "operation": "SCHEMA",
                              "table_schema": {"table": "t", "columns": []}}, "_cdc_bootstrap t")
    assert rewritten["table"] == rewritten["table_schema"]["table"] == "_cdc_bootstrap t"


def _read(path, sql):
    with contextlib.closing(sqlite3.connect(path)) as reader:
        return reader.execute(sql).fetchall()


def test_a_shadow_is_swapped_in_where_it_meets_the_streaming_tables(tmp_path):
    """``a`` streams from a snapshot at 0/100; ``b`` (no primary key) was loaded into its
    shadow from a snapshot at 0/300. A transfer committed at 0/200 is in b's snapshot: b waits
    (a reader sees no b, and a at 0/201). The next transfer, at 0/300, reaches both: b is
    swapped in, with its lookup index, and the file records 0/301."""
    path = tmp_path / "mirror.db"
    store = MirrorStore(path)
    bootstrapped(store, schema("a"), lsn=0x100, loaded=[{"id": 1, "name": "10"}])
    keyless = TableShape.from_schema(schema("b", columns=(("id", 23, "integer", False),
                                                          ("name", 25, "text", False))))
    shadow = shadow_name("b")
    store.begin_bootstrap(dataclasses.replace(keyless, table=shadow), "snap2", 0x300)
    store.load_rows(shadow, [{"id": 1, "name": "5"}])  # (the transfer at 0/200 included)
    store.finish_bootstrap(shadow, stream_seq=3)
    lines: list[str] = []
    mirror = Mirror(PlatformSettings(), ["a", "b"], path, report=lines.append)
    follow = _Following(mirror, None, store, TransactionCollector(["a", "b"],
                                                                  keep_events=False),
                        {"a": "a", "b": shadow})

    def transfer(commit_lsn, seq, before, after):
        follow.event(event("UPDATE", commit_lsn, 0, table="a",
                           data={"id": 1, "name": after[0]}, tx_tables={"a": 1, "b": 1}),
                     seq, False)
        follow.event(event("UPDATE", commit_lsn, 1, table="b", data={"id": 1, "name": after[1]},
                           old={"id": 1, "name": before[1]}, tx_tables={"a": 1, "b": 1}),
                     seq + 1, False)
        follow.commit()
        follow.swap_shadows()

    transfer("0/200", 4, ("10", "0"), ("5", "5"))
    assert _read(path, "SELECT name FROM a") == [("5",)]
    assert _read(path, f"SELECT lsn FROM {CONSISTENT_TABLE}") == [("0/201",)]
    assert follow.shadowed == {"b": shadow}
    assert not _read(path, "SELECT name FROM sqlite_master WHERE name = 'b'")

    transfer("0/300", 6, ("5", "5"), ("4", "6"))
    assert follow.shadowed == {} and follow.local == {"a": "a", "b": "b"}
    assert _read(path, "SELECT name FROM a") == [("4",)]
    assert _read(path, "SELECT name FROM b") == [("6",)]
    assert _read(path, f"SELECT lsn, lsn_int FROM {CONSISTENT_TABLE}") == [("0/301", 0x301)]
    assert _read(path, "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'b'"
                 ) == [("b (row lookup)",)]
    assert [row[0] for row in _read(path, "SELECT wire_table FROM _cdc_mirror_tables")] == [
        "a", "b"]
    assert store.state("b").status == "streaming" and store.state("b").cutover_lsn == 0x300
    assert any("b: swapped in; every table consistent at lsn 0/301" in line for line in lines)
    assert status_lines(path)[-1] == "consistent lsn (every streaming table): 0/301"

    # b follows as itself from now on, by its lookup index
    transfer("0/400", 8, ("4", "6"), ("3", "7"))
    assert _read(path, "SELECT name FROM b") == [("7",)]
    assert _read(path, f"SELECT lsn FROM {CONSISTENT_TABLE}") == [("0/401",)]
    store.close()


def _a_streaming_and_b_loaded_aside(path, report=lambda line: None):
    """``a`` streams; ``b``'s snapshot is loaded into its shadow, not swapped in yet."""
    store = MirrorStore(path)
    bootstrapped(store, schema("a"), lsn=0x100)
    shadow = shadow_name("b")
    store.begin_bootstrap(TableShape.from_schema(schema(shadow)), "snap2", 0x300)
    store.finish_bootstrap(shadow, stream_seq=3)
    mirror = Mirror(PlatformSettings(), ["a", "b"], path, report=report)
    follow = _Following(mirror, None, store, TransactionCollector(["a", "b"],
                                                                  keep_events=False),
                        {"a": "a", "b": shadow})
    return store, shadow, follow


def test_an_idle_source_gets_its_shadows_swapped_in_with_the_point_not_known(tmp_path):
    path = tmp_path / "mirror.db"
    store, shadow, follow = _a_streaming_and_b_loaded_aside(path)
    follow.swap_shadows()
    assert follow.shadowed == {"b": shadow}
    follow.swap_shadows(idle=True)
    assert follow.shadowed == {}
    assert _read(path, f"SELECT lsn FROM {CONSISTENT_TABLE}") == [(None,)]
    assert status_lines(path)[-1] == "consistent lsn (every streaming table): not known"
    store.close()


def test_mirror_status_prints_each_table_and_the_consistent_lsn(tmp_path, capsys):
    from cdc_platform import cli

    path = tmp_path / "mirror.db"
    store = MirrorStore(path)
    bootstrapped(store, schema("a"), lsn=0x100)
    store.record_consistent_lsn(0x100)
    shadow = shadow_name("b")
    store.begin_bootstrap(TableShape.from_schema(schema(shadow)), "snap2", 0x300)
    store.close()
    assert cli.main(["mirror", "status", "--sqlite", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "a: streaming; snapshot snap1 at lsn 0/100; applied through -; CDC sequence 7",
        ("b: (shadow) loading its snapshot; snapshot snap2 at lsn 0/300; applied through -; "
         "CDC sequence 0"),
        "consistent lsn (every streaming table): 0/100"]
    assert cli.main(["mirror", "--sqlite", str(path)]) == 2
    assert "--tables is required" in capsys.readouterr().err
    assert cli.main(["mirror", "status", "--sqlite", str(tmp_path / "none.db")]) == 2


def test_a_divergence_in_a_shadow_makes_its_table_bootstrap_again(tmp_path):
    lines: list[str] = []
    store, shadow, follow = _a_streaming_and_b_loaded_aside(tmp_path / "mirror.db",
                                                            lines.append)
    follow.event(event("DELETE", "0/400", 0, table="b", data={"id": 9}, old={"id": 9},
                       tx_tables={"b": 1}), 4, False)
    assert list(follow.stale) == ["b"]
    assert store.state(shadow).status == "stale" and store.state(shadow).stale_lsn == 0x401
    assert any(line.startswith("b: ") and "bootstrapping again" in line for line in lines)
    store.close()
