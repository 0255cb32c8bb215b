"""The exactness suite under schema changes: a seeded, randomized DML workload interleaved with
every kind of DDL a user runs on published tables (RENAME, ALTER TYPE with and without USING,
twice on one table, ADD COLUMN with a constant and a volatile default, DROP COLUMN, TRUNCATE,
VACUUM FULL, a table published mid-stream), on tables with and without a primary key (-0.0,
NaN and duplicate rows), while `cdc-platform mirror` is SIGKILLed and started again and a
reader checks a cross-table invariant in the file. At the end every table equals the source
value for value, and the reader never saw the invariant broken, through the bootstraps and
re-bootstraps the DDL causes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest

from cdc_platform.mirror.positions import STATE_TABLE
from cdc_platform.postgres.admin import provision_database
from cdc_platform.replication.slots import read_slot
from cdc_platform_tests.exactness import (
    ACCOUNTS,
    BALANCE,
    InvariantReader,
    bridge_caught_up,
    mirror_rows,
    source_rows,
)
from cdc_platform_tests.fixtures.bridge import running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import CLI, bridge_env, platform_settings, random_name

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major

TRANSACTIONS = 240
FLOATS = [0.0, -0.0, float("nan"), 1.5, -2.25, float("inf")]


class SchemaChangeWorkload:
    """Tables named from ``prefix``; ``seed`` fixes every choice. The DDL runs at random
    points (seeded), in an order where each step finds what it changes."""

    def __init__(self, prefix: str, seed: int) -> None:
        self.random = random.Random(seed)
        self.keyed, self.keyless = f"{prefix}_keyed", f"{prefix}_keyless"
        self.accounts = [f"{prefix}_acct_a", f"{prefix}_acct_b"]
        self.late = f"{prefix}_late"  # published mid-stream
        self.text_column = "b"  # keyed's text column: renamed on the way
        self.keyless_text = "t"
        self.next_id = 1_000
        self.done = 0
        self.ddl = ["rename_keyed_text", "retype_keyed_a_using", "add_constant_default",
                    "retype_keyed_n_without_using", "truncate_keyless", "publish_late",
                    "add_volatile_default", "rename_keyless_text", "vacuum_full_keyed",
                    "retype_account_balance", "drop_constant_default",
                    "retype_keyed_a_using_again", "add_keyless_column"]
        points = sorted(self.random.sample(range(10, TRANSACTIONS - 10), len(self.ddl)))
        self.ddl_at = dict(zip(points, self.ddl, strict=True))

    def create(self, admin: psycopg.Connection) -> None:
        admin.execute(f"CREATE TABLE {self.keyed} (id int PRIMARY KEY, a int, b text, "
                      "f float8, n numeric)")
        admin.execute(f"CREATE TABLE {self.keyless} (a int, f float8, t text)")
        admin.execute(f"ALTER TABLE {self.keyless} REPLICA IDENTITY FULL")
        for table in self.accounts:
            admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, balance int)")
            admin.execute(f"INSERT INTO {table} SELECT g, {BALANCE} "
                          f"FROM generate_series(1, {ACCOUNTS}) g")
        admin.execute(f"CREATE TABLE {self.late} (id int PRIMARY KEY, v text)")
        admin.execute(f"INSERT INTO {self.late} SELECT g, 'early ' || g "
                      "FROM generate_series(1, 50) g")
        with admin.transaction():
            for _ in range(100):
                self._insert_keyed(admin)
                self._insert_keyless(admin)

    @property
    def published_at_start(self) -> list[str]:
        return [self.keyed, self.keyless, *self.accounts]

    # -- the transactions ------------------------------------------------------------------
    def run(self, conninfo: str, publish_late, stop: threading.Event) -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            while self.done < TRANSACTIONS and not stop.is_set():
                step = self.ddl_at.get(self.done)
                if step == "publish_late":
                    publish_late()
                elif step is not None:
                    getattr(self, step)(conn)
                with conn.transaction():
                    for _ in range(self.random.randint(1, 4)):
                        self.random.choice(self._changes)(conn)
                self.done += 1
                time.sleep(0.01)

    @property
    def _changes(self):
        changes = [self._insert_keyed, self._update_keyed, self._delete_keyed,
                   self._insert_keyless, self._update_keyless, self._delete_keyless,
                   self._transfer]
        if self.done > self.ddl_index("publish_late"):
            changes.append(self._change_late)
        return changes

    def ddl_index(self, name: str) -> int:
        return next(point for point, step in self.ddl_at.items() if step == name)

    def _float(self) -> float:
        return self.random.choice(FLOATS)

    def _insert_keyed(self, conn) -> None:
        self.next_id += 1
        conn.execute(f"INSERT INTO {self.keyed} (id, a, {self.text_column}, f, n) "
                     "VALUES (%s, %s, %s, %s, %s)",
                     (self.next_id, self.random.randint(-100, 100), f"row {self.next_id}",
                      self._float(), self.random.randint(0, 10**6) / 100))

    def _update_keyed(self, conn) -> None:
        conn.execute(f"UPDATE {self.keyed} SET a = a + 1, {self.text_column} = "
                     f"{self.text_column} || '+', f = %s WHERE id = "
                     f"(SELECT id FROM {self.keyed} ORDER BY random() LIMIT 1)", (self._float(),))

    def _delete_keyed(self, conn) -> None:
        conn.execute(f"DELETE FROM {self.keyed} WHERE id = "
                     f"(SELECT id FROM {self.keyed} ORDER BY random() LIMIT 1)")

    def _insert_keyless(self, conn) -> None:
        # duplicates on purpose, 0.0 and -0.0 among them: only an exact lookup changes the
        # right one
        value = (self.random.randint(0, 5), self._float(), f"t{self.random.randint(0, 3)}")
        for _ in range(self.random.randint(1, 3)):
            conn.execute(f"INSERT INTO {self.keyless} (a, f, {self.keyless_text}) "
                         "VALUES (%s, %s, %s)", value)

    def _update_keyless(self, conn) -> None:
        conn.execute(f"UPDATE {self.keyless} SET a = a + 1, f = %s WHERE ctid = "
                     f"(SELECT ctid FROM {self.keyless} ORDER BY random() LIMIT 1)",
                     (self._float(),))

    def _delete_keyless(self, conn) -> None:
        conn.execute(f"DELETE FROM {self.keyless} WHERE ctid = "
                     f"(SELECT ctid FROM {self.keyless} ORDER BY random() LIMIT 1)")

    def _transfer(self, conn) -> None:
        amount = self.random.randint(1, 50)
        source, target = self.random.sample(self.accounts, 2)
        conn.execute(f"UPDATE {source} SET balance = balance - %s WHERE id = %s",
                     (amount, self.random.randint(1, ACCOUNTS)))
        conn.execute(f"UPDATE {target} SET balance = balance + %s WHERE id = %s",
                     (amount, self.random.randint(1, ACCOUNTS)))

    def _change_late(self, conn) -> None:
        self.next_id += 1
        conn.execute(f"INSERT INTO {self.late} VALUES (%s, 'late')", (self.next_id,))
        conn.execute(f"UPDATE {self.late} SET v = v || '.' WHERE id = "
                     f"(SELECT id FROM {self.late} ORDER BY random() LIMIT 1)")

    # -- the DDL -----------------------------------------------------------------------------
    def rename_keyed_text(self, conn) -> None:
        conn.execute(f"ALTER TABLE {self.keyed} RENAME COLUMN b TO b_renamed")
        self.text_column = "b_renamed"

    def retype_keyed_a_using(self, conn) -> None:
        conn.execute(f"ALTER TABLE {self.keyed} ALTER COLUMN a TYPE bigint USING a * 10")

    def retype_keyed_a_using_again(self, conn) -> None:  # same type, new values
        conn.execute(f"ALTER TABLE {self.keyed} ALTER COLUMN a TYPE bigint USING a + 7")

    def retype_keyed_n_without_using(self, conn) -> None:
        conn.execute(f"ALTER TABLE {self.keyed} ALTER COLUMN n TYPE numeric(20, 4)")

    def add_constant_default(self, conn) -> None:
        conn.execute(f"ALTER TABLE {self.keyed} ADD COLUMN c_const int DEFAULT 7")

    def drop_constant_default(self, conn) -> None:
        conn.execute(f"ALTER TABLE {self.keyed} DROP COLUMN c_const")

    def add_volatile_default(self, conn) -> None:
        conn.execute(f"ALTER TABLE {self.keyed} ADD COLUMN c_vol float8 DEFAULT random()")

    def vacuum_full_keyed(self, conn) -> None:
        conn.execute(f"VACUUM FULL {self.keyed}")

    def truncate_keyless(self, conn) -> None:
        conn.execute(f"TRUNCATE {self.keyless}")

    def rename_keyless_text(self, conn) -> None:
        conn.execute(f"ALTER TABLE {self.keyless} RENAME COLUMN t TO t_renamed")
        self.keyless_text = "t_renamed"

    def add_keyless_column(self, conn) -> None:
        conn.execute(f"ALTER TABLE {self.keyless} ADD COLUMN extra text DEFAULT 'x'")

    def retype_account_balance(self, conn) -> None:  # a table of the invariant bootstraps again
        conn.execute(f"ALTER TABLE {self.accounts[0]} ALTER COLUMN balance TYPE bigint")

    def tables(self) -> list[str]:
        return [*self.published_at_start, self.late]


def _columns(conninfo: str, table: str) -> list[str]:
    with psycopg.connect(conninfo) as conn:
        return [row[0] for row in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum", (table,))]


def _statuses(db: Path) -> dict[str, str]:
    if not db.exists():
        return {}
    with contextlib.closing(sqlite3.connect(db)) as local:
        try:
            return dict(local.execute(f"SELECT wire_table, status FROM {STATE_TABLE}"))
        except sqlite3.OperationalError:
            return {}


async def test_the_mirror_stays_exact_through_every_schema_change(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    seed = int(os.environ.get("CDC_EXACTNESS_SEED", "23"))  # (another seed: another order)
    workload = SchemaChangeWorkload(random_name("ddl"), seed=seed)
    workload.create(pg_admin)
    cdc_database.add_tables(pg_admin, *workload.published_at_start)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    conninfo = cdc_database.server.superuser_conninfo()
    env = {**bridge_env(cdc_database, provisioned_nats.url), "CDC_SLOT": cdc_database.slot,
           "CDC_PUBLICATION": cdc_database.publication, "CDC_MIRROR_STATUS_INTERVAL": "1s"}
    db = tmp_path / "mirror.db"
    log_path = tmp_path / "mirror.log"

    def command(tables: list[str]) -> list[str]:
        return [CLI, "mirror", "--tables", ",".join(tables), "--sqlite", str(db)]

    def publish_late() -> None:
        with psycopg.connect(conninfo, autocommit=True) as admin:
            provision_database(admin, publication=cdc_database.publication,
                               role=cdc_database.role, tables=[workload.late])

    reader = InvariantReader(db, workload.accounts, 2 * ACCOUNTS * BALANCE)
    stop = threading.Event()
    with open(log_path, "wb") as output:
        async with running_bridge(settings), snapshot_responder(settings, max_age_seconds=0):
            await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
            mirror = subprocess.Popen(command(workload.published_at_start), env=env,
                                      stdout=output, stderr=subprocess.STDOUT)
            reader.start()
            running = asyncio.create_task(asyncio.to_thread(workload.run, conninfo,
                                                            publish_late, stop))
            try:
                # SIGKILLed twice mid-stream; from the first restart on it also mirrors the
                # table published mid-stream
                for fraction in (0.3, 0.65):
                    await wait_for(lambda f=fraction: workload.done >= TRANSACTIONS * f
                                   or running.done(), timeout=120, what="the workload")
                    mirror.send_signal(signal.SIGKILL)
                    mirror.wait()
                    await wait_for(lambda: workload.done > workload.ddl_index("publish_late")
                                   or running.done(), timeout=120, what="late published")
                    mirror = subprocess.Popen(command(workload.tables()), env=env,
                                              stdout=output, stderr=subprocess.STDOUT)
                await running
            finally:
                stop.set()
                with contextlib.suppress(Exception):
                    await running
            await bridge_caught_up(pg_admin, cdc_database.slot)
            mirror.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(mirror.wait, 60) == 0, log_path.read_text()[-3000:]
            finished = await asyncio.to_thread(
                subprocess.run, [*command(workload.tables()), "--once"], env=env,
                stdout=output, stderr=subprocess.STDOUT, timeout=300)
    reader.stop.set()
    reader.join(10)
    log_text = log_path.read_text()
    assert finished.returncode == 0, log_text[-3000:]
    assert _statuses(db) == {table: "streaming" for table in workload.tables()}, log_text[-3000:]
    for table in workload.tables():
        columns = _columns(conninfo, table)
        assert mirror_rows(db, table, columns) == source_rows(conninfo, table, columns), (
            table, log_text[-3000:])
    assert reader.broken == [], (reader.broken[:10], log_text[-3000:])
    assert reader.checks > 50, reader.checks
