"""The exactness suite's workload and its check: mirror == source, row for row, value for value.

A seeded, randomized workload over tables a demanding user has: a composite key under a schema
and name that need escaping, every type of the type mapping with its edge values, a table
without a primary key (REPLICA IDENTITY FULL) that every transaction also writes (a transaction
applied twice shows there as a duplicate row), TOASTed values updated in other columns, primary
key changes, COPY, one large transaction, TRUNCATE, ADD COLUMN with a constant and with a
volatile default, DROP COLUMN. Used by ``integration/test_exactness.py`` (CI sizes; larger
by hand with ``CDC_EXACTNESS_TRANSACTIONS`` and ``CDC_EXACTNESS_SEED``) and
``integration/test_mirror_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql

from cdc_platform.mirror.columns import quote, to_sqlite
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.positions import STATE_TABLE
from cdc_platform.naming import wire_name
from cdc_platform_tests.fixtures.bridge import wait_for
from cdc_platform_tests.fixtures.snapshots import create_types_table, direct_rows
from cdc_platform_tests.fixtures.values import EDGES


@dataclass
class WorkloadSize:
    transactions: int = 300  # random transactions
    initial_rows: int = 200  # per table, before the mirror starts
    copy_rows: int = 5_000  # one COPY FROM
    big_transaction_rows: int = 100_000  # one INSERT of this many rows in one transaction
    toast_bytes: int = 12_000  # values stored out of line (TOAST)
    pace_seconds: float = 0.05  # between transactions: the workload outlasts the snapshots


@dataclass
class Workload:
    """Tables are named from ``prefix``; ``seed`` fixes every choice."""

    prefix: str
    seed: int = 1
    size: WorkloadSize = field(default_factory=WorkloadSize)

    def __post_init__(self) -> None:
        self.random = random.Random(self.seed)
        self.lines_schema = "Sales Dept"
        self.lines = f"Order-Lines {self.prefix}"  # composite key; needs escaping
        self.types = f"{self.prefix}_types"
        self.edges = f"{self.prefix}_edges"
        self.ledger = f"{self.prefix}_ledger"  # no primary key: REPLICA IDENTITY FULL
        self.lines_columns = ["order_id", "line", "qty", "price", "note", "doc", "at"]
        self.types_extra: list[str] = []
        self.edges_extra: list[str] = []
        self.next_id = 1_000_000
        self.done = 0  # transactions run so far
        self.stop = threading.Event()
        self.pause = threading.Event()  # held while a test restarts a server
        # fixed points of the workload, as fractions of ``transactions``
        self.ddl_at = {
            int(self.size.transactions * fraction): name for fraction, name in (
                (0.15, "add_constant_default"), (0.3, "copy"), (0.4, "big_transaction"),
                (0.5, "drop_column"), (0.6, "truncate"), (0.7, "add_volatile_default"),
                (0.85, "add_edges_column"))}

    # -- setup ---------------------------------------------------------------------------------
    @property
    def qualified_lines(self) -> sql.Composable:
        return sql.Identifier(self.lines_schema, self.lines)

    def wire_tables(self) -> list[str]:
        return [wire_name(self.lines_schema, self.lines), self.types, self.edges, self.ledger]

    def source_names(self) -> dict[str, str]:
        """wire name -> the table as SQL names it."""
        return {wire_name(self.lines_schema, self.lines):
                f'"{self.lines_schema}"."{self.lines}"',
                self.types: self.types, self.edges: self.edges, self.ledger: self.ledger}

    def create(self, admin: psycopg.Connection) -> list[str]:
        """Create and fill the tables; returns the names to publish."""
        admin.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
            sql.Identifier(self.lines_schema)))
        admin.execute(sql.SQL(
            "CREATE TABLE {} (order_id int, line int, qty int, price numeric(12,2), "
            "note text, doc text, at timestamptz, PRIMARY KEY (order_id, line))").format(
                self.qualified_lines))
        create_types_table(admin, self.types, self.size.initial_rows)
        columns = ", ".join(f"c{i} {kind}" for i, (kind, _, _) in enumerate(EDGES))
        admin.execute(f"CREATE TABLE {self.edges} (id int PRIMARY KEY, {columns})")
        admin.execute(f"CREATE TABLE {self.ledger} (tx int, k int, note text, f float8)")
        admin.execute(f"ALTER TABLE {self.ledger} REPLICA IDENTITY FULL")
        with admin.transaction():
            for order in range(self.size.initial_rows // 4):
                for line in range(4):
                    self._insert_line(admin, order, line)
            for key in range(self.size.initial_rows):
                self._insert_edges_row(admin, key)
                admin.execute(f"INSERT INTO {self.ledger} VALUES (-1, %s, 'initial', %s)",
                              (key % 50, key / 3))
        return [f'"{self.lines_schema}"."{self.lines}"', self.types, self.edges, self.ledger]

    # -- the workload -------------------------------------------------------------------------
    def run(self, conninfo: str, transactions: int) -> None:
        """The next ``transactions`` transactions (stops early when ``stop`` is set). A
        transaction the server cut off (a restart) is done again once it is back."""
        conn = None
        try:
            for _ in range(transactions):
                while True:
                    if self.stop.is_set():
                        return
                    while self.pause.is_set():
                        time.sleep(0.05)
                    saved = (list(self.lines_columns), list(self.types_extra),
                             list(self.edges_extra), self.next_id)
                    try:
                        if conn is None or conn.closed:
                            conn = psycopg.connect(conninfo)
                        self._transaction(conn)
                        break
                    except psycopg.OperationalError:
                        (self.lines_columns, self.types_extra, self.edges_extra,
                         self.next_id) = saved
                        conn = None
                        time.sleep(0.2)
                self.done += 1
                time.sleep(self.size.pace_seconds)
        finally:
            if conn is not None:
                conn.close()

    def _transaction(self, conn: psycopg.Connection) -> None:
        step = self.done
        with conn.transaction():
            special = self.ddl_at.get(step)
            if special is not None:
                getattr(self, f"_{special}")(conn)
            for _ in range(self.random.randint(1, 5)):
                self.random.choice((self._lines_op, self._types_op, self._edges_op,
                                    self._ledger_op))(conn)
            # every transaction leaves one ledger row: applied twice, it shows
            conn.execute(f"INSERT INTO {self.ledger} VALUES (%s, %s, 'tx', %s)",
                         (step, self.random.randint(0, 49), self.random.random()))

    def _insert_line(self, conn, order: int, line: int) -> None:
        big = self.random.random() < 0.1
        values = {"order_id": order, "line": line, "qty": self.random.randint(-5, 500),
                  "price": f"{self.random.randint(0, 10**8)}.{self.random.randint(0, 99):02d}",
                  "note": self.random.choice(["", None, "x", "ünï ✓", "tab\there"]),
                  "doc": (self.random.randbytes(self.size.toast_bytes // 2).hex() if big
                          else f"doc {order}/{line}"),
                  "at": self.random.choice(["2026-01-01 00:00:00+00", "infinity",
                                            "0001-01-01 00:00:00+00 BC", None])}
        if "flag" in self.lines_columns:
            values["flag"] = self.random.choice([None, 0, 9])
        names = [c for c in self.lines_columns if c in values]
        conn.execute(sql.SQL("INSERT INTO {} ({}) VALUES ({}) ON CONFLICT DO NOTHING").format(
            self.qualified_lines, sql.SQL(", ").join(map(sql.Identifier, names)),
            sql.SQL(", ").join(sql.Placeholder() * len(names))), [values[n] for n in names])

    def _lines_op(self, conn) -> None:
        order = self.random.randint(0, self.size.initial_rows // 4 + 50)
        choice = self.random.random()
        table = self.qualified_lines
        if choice < 0.35:
            self._insert_line(conn, order, self.random.randint(0, 8))
        elif choice < 0.6:  # other columns of (maybe TOASTed) rows: doc is unchanged TOAST
            conn.execute(sql.SQL("UPDATE {} SET qty = qty + 1 WHERE order_id = %s").format(
                table), (order,))
        elif choice < 0.75:  # a primary key change
            conn.execute(sql.SQL(
                "UPDATE {} SET line = line + 100 WHERE order_id = %s AND line < 100 AND NOT "
                "EXISTS (SELECT 1 FROM {} o WHERE o.order_id = %s AND o.line >= 100)").format(
                    table, table), (order, order))
        elif choice < 0.85:  # a new TOASTed value
            conn.execute(sql.SQL("UPDATE {} SET doc = %s WHERE order_id = %s").format(table),
                         (self.random.randbytes(self.size.toast_bytes // 2).hex(), order))
        else:
            conn.execute(sql.SQL("DELETE FROM {} WHERE order_id = %s AND line = %s").format(
                table), (order, self.random.randint(0, 8)))

    def _types_op(self, conn) -> None:
        """Rows copied and values swapped between rows: every edge value of the types
        table travels through INSERT and UPDATE."""
        source = self.random.randint(1, self.size.initial_rows)
        choice = self.random.random()
        if choice < 0.4:
            self.next_id += 1
            columns = ", ".join(c for c in _TYPES_COPY + self.types_extra)
            conn.execute(f"INSERT INTO {self.types} (id, {columns}) SELECT %s, {columns} "
                         f"FROM {self.types} WHERE id = %s", (self.next_id, source))
        elif choice < 0.85:
            column = self.random.choice(_TYPES_COPY)
            conn.execute(f"UPDATE {self.types} SET {column} = (SELECT {column} FROM "
                         f"{self.types} WHERE id = %s) WHERE id = %s",
                         (source, self.random.randint(1, self.size.initial_rows)))
        else:
            conn.execute(f"DELETE FROM {self.types} WHERE id = %s", (source,))

    def _insert_edges_row(self, conn, key: int) -> None:
        chosen = [literal if self.random.random() < 0.6 else "NULL"
                  for _, literal, _ in EDGES]
        literals = ", ".join(f"{literal}::{kind}" for literal, (kind, _, _)
                             in zip(chosen, EDGES, strict=True))
        extra = "".join(", 'e'" for _ in self.edges_extra)
        conn.execute(f"INSERT INTO {self.edges} VALUES ({key}, {literals}{extra}) "
                     "ON CONFLICT DO NOTHING")

    def _edges_op(self, conn) -> None:
        key = self.random.randint(0, self.size.initial_rows + 100)
        choice = self.random.random()
        if choice < 0.4:
            self._insert_edges_row(conn, key)
        elif choice < 0.85:
            index = self.random.randrange(len(EDGES))
            kind, literal, _ = EDGES[index]
            conn.execute(f"UPDATE {self.edges} SET c{index} = {literal}::{kind} "
                         f"WHERE id = {key}")
        else:
            conn.execute(f"DELETE FROM {self.edges} WHERE id = {key}")

    def _ledger_op(self, conn) -> None:
        """Keyless: updates and deletes name rows by every column's value."""
        k = self.random.randint(0, 49)
        choice = self.random.random()
        if choice < 0.5:
            conn.execute(f"UPDATE {self.ledger} SET note = note || '+' WHERE k = %s AND "
                         "ctid = (SELECT min(ctid) FROM " + self.ledger + " WHERE k = %s)",
                         (k, k))
        elif choice < 0.8:
            conn.execute(f"UPDATE {self.ledger} SET f = 'NaN' WHERE k = %s AND tx = -1", (k,))
        else:
            conn.execute(f"DELETE FROM {self.ledger} WHERE ctid = (SELECT min(ctid) FROM "
                         f"{self.ledger} WHERE k = %s)", (k,))

    # -- the fixed points ---------------------------------------------------------------------
    def _add_constant_default(self, conn) -> None:
        conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN flag int DEFAULT 7").format(
            self.qualified_lines))
        self.lines_columns.append("flag")
        self._insert_line(conn, 1, 50)  # the new shape goes out with the table's next change

    def _copy(self, conn) -> None:
        with conn.cursor().copy(f"COPY {self.ledger} (tx, k, note, f) FROM STDIN") as copy:
            for row in range(self.size.copy_rows):
                copy.write_row((-2, row % 50, f"copied\t{row}\\", row * 0.5))

    def _big_transaction(self, conn) -> None:
        conn.execute(f"INSERT INTO {self.ledger} SELECT -3, g % 50, 'big', g "
                     f"FROM generate_series(1, {self.size.big_transaction_rows}) g")

    def _drop_column(self, conn) -> None:
        conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN note").format(self.qualified_lines))
        self.lines_columns.remove("note")
        self._insert_line(conn, 2, 51)

    def _truncate(self, conn) -> None:
        conn.execute(f"TRUNCATE {self.ledger}")

    def _add_volatile_default(self, conn) -> None:
        # random() is volatile: PostgreSQL rewrites the table, which decoding does not emit
        conn.execute(f"ALTER TABLE {self.types} ADD COLUMN r float8 DEFAULT random()")
        self.types_extra.append("r")
        conn.execute(f"UPDATE {self.types} SET i2 = 1 WHERE id = 1")

    def _add_edges_column(self, conn) -> None:
        conn.execute(f"ALTER TABLE {self.edges} ADD COLUMN added text DEFAULT 'x y'")
        self.edges_extra.append("added")
        self._insert_edges_row(conn, 100_000 + self.done)


_TYPES_COPY = ["i2", "i4", "f4", "f8", "num", "num_fixed", "flag", "txt", "vc", "ch", "u", "j",
               "jb", "arr_i", "arr_t", "d", "tm", "tz", "ts", "ttz", "iv", "by", "ip", "mood"]


def source_rows(conninfo: str, source: str, columns: list[str]) -> list[tuple]:
    """The source table (``source`` as SQL names it) as the mirror stores it: wire values
    through ``to_sqlite``, sorted."""
    return sorted((tuple(_comparable(to_sqlite(row[c])) for c in columns)
                   for row in direct_rows(conninfo, source, columns)), key=repr)


def mirror_rows(db_path: str | Path, table: str, columns: list[str]) -> list[tuple]:
    """The mirrored table, the same columns, sorted."""
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        return sorted((tuple(_comparable(v) for v in row) for row in db.execute(
            f"SELECT {', '.join(quote(c) for c in columns)} FROM {quote(table)}")), key=repr)


def differences(conninfo: str, workload: Workload, db_path: str | Path) -> dict[str, str]:
    """Each mirrored table that differs from its source, and how (empty: exact)."""
    found: dict[str, str] = {}
    for table, source in workload.source_names().items():
        with psycopg.connect(conninfo) as conn:
            columns = [row[0] for row in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                "AND NOT attisdropped ORDER BY attnum", (source,))]
        want = source_rows(conninfo, source, columns)
        got = mirror_rows(db_path, table, columns)
        if got != want:
            got_set, want_set = set(got), set(want)
            missing = [row for row in want if row not in got_set][:3]
            extra = [row for row in got if row not in want_set][:3]
            found[table] = (f"{len(want)} rows in the source, {len(got)} mirrored; missing "
                            f"e.g. {missing}; extra e.g. {extra}")
    return found


def _comparable(value):
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and value == 0.0:
        return ("-0.0" if str(value).startswith("-") else "0.0")  # keep the sign visible
    return value


# -- waiting for the parts -------------------------------------------------------------------
def reporter(lines: list[str]):
    """Keep the mirror's lines for assertions, and log them (shown when a test fails)."""
    log = logging.getLogger("mirror")

    def report(line: str) -> None:
        lines.append(line)
        log.warning("%s", line)
    return report


async def bridge_caught_up(pg_admin, slot: str, timeout: float = 120.0) -> None:
    """Until the bridge has confirmed all the WAL written so far (a slot not there, such as
    between a lost slot's drop and the new one's creation, has not)."""
    target = pg_admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    await wait_for(lambda: pg_admin.execute(
        "SELECT coalesce((SELECT confirmed_flush_lsn >= %s FROM pg_replication_slots "
        "WHERE slot_name = %s), false)", (target, slot)).fetchone()[0],
        timeout=timeout, what="the bridge to confirm everything")


async def mirror_caught_up(mirror: Mirror, task: asyncio.Task, nats_client,
                           stream: str = "CDC", timeout: float = 180.0) -> None:
    """Until the mirror (running as ``task``) has read the whole stream as it is now, every
    table streaming in its file (none waiting in a shadow)."""
    last = (await nats_client.jetstream().stream_info(stream)).state.last_seq

    def reached() -> bool:
        if task.done():
            task.result()  # the mirror's error, if it stopped on one
            raise AssertionError("the mirror stopped")
        return mirror.position >= last and not mirror.bootstrapping
    await wait_for(reached, timeout=timeout, what=f"the mirror to reach sequence {last}")


# -- transfers between two account tables: a reader never sees one half done -------------
ACCOUNTS = 500
BALANCE = 1_000


def mirror_statuses(db: sqlite3.Connection) -> dict[str, str]:
    try:
        return dict(db.execute(f"SELECT wire_table, status FROM {STATE_TABLE}").fetchall())
    except sqlite3.OperationalError:  # (not created yet)
        return {}


class InvariantReader(threading.Thread):
    """Reads the file as a reader would (its own connection, one read transaction per look):
    whenever both account tables stream, their balances must sum to the total."""

    def __init__(self, path, tables: list[str], total: int) -> None:
        super().__init__(daemon=True)
        self.path, self.tables, self.total = path, tables, total
        self.stop = threading.Event()
        self.checks = 0
        self.broken: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set() and not self.path.exists():
            time.sleep(0.01)
        with contextlib.closing(sqlite3.connect(self.path, isolation_level=None)) as db:
            while not self.stop.is_set():
                db.execute("BEGIN")
                try:
                    statuses = mirror_statuses(db)
                    if all(statuses.get(table) == "streaming" for table in self.tables):
                        total = sum(db.execute(
                            f"SELECT coalesce(sum(balance), 0) FROM {quote(table)}"
                        ).fetchone()[0] for table in self.tables)
                        self.checks += 1
                        if total != self.total:
                            self.broken.append(f"{total} (at check {self.checks})")
                finally:
                    db.execute("COMMIT")
                time.sleep(0.002)
