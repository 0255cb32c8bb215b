#!/usr/bin/env python
"""A mirror after a lost slot: resynchronised by verification and bucket repair, against a
full re-bootstrap of the same table in the same run (docs/verification.md Part 2, item 6):
the INIT bytes the mirror reads and the seconds until it holds the source's rows again.

    .venv/bin/python benchmarks/resync.py [--rows 200000] [--fractions 0.1,1,10]
                                          [--bits default,14] [--writes 20]

Starts its own PostgreSQL (``max_slot_wal_keep_size`` 1 MB, as integration/test_slot_resync.py)
and nats-server (temp dir), ``snapshot.py``'s 9-column table with ``--rows`` rows, a bridge
with ``CDC_ON_SLOT_LOST=resync`` and a mirror (the library of ``cdc-platform mirror``), both in
this process, and a snapshot responder answering the mirror's snapshot and repair requests as
the Dagster sensor does (cdc_platform_tests/fixtures/responder.py: tasks in this process, no
Spark, as for tables under ``CDC_SNAPSHOT_LOCAL_MAX_BYTES``). The mirror bootstraps, then for
each fraction (% of the rows) and each verification ``--bits`` (``default``: an ordinary
verification's, ``bucket_bits(rows)``; ``14``: what ``resync_sensor`` asks for,
``MAX_BUCKET_BITS``):

1. the bridge stops; a third of the changed rows are updated, a third deleted, a third
   inserted (random keys of the whole table; new keys after the highest, as a sequence
   gives them: buckets come from the key hash, so they spread like any others);
2. the slot is invalidated for real (WAL past ``max_slot_wal_keep_size``, a checkpoint);
3. the bridge starts again: it stores the resync marker and streams from a new slot;
4. a verification of the table (``verify_table``, what ``resync_sensor`` launches) at once;
   the mirror meets it ``differ`` and repairs the differing buckets (asked as a list when it
   fits a repair request's 4 KB body, ``wire.REQUEST_BODY_MAX_BYTES``, else as
   ``bucket_bitmap``), or bootstraps the table again when more than a quarter differ
   (mirror/repair.py ``MOST_REPAIRED_SHARE``);
5. measured: INIT chunk bytes the mirror read (``Mirror.init_bytes``) and seconds from the
   marker's store time to the mirror holding the source's rows (repair replaced, or the
   bootstrap swapped in), in phases: the bridge's new slot, the verification until the
   mirror met it, the (repair) snapshot run, the mirror asking and loading (the rest until
   its "loaded" line), the replacement or swap; meanwhile ``--writes`` one-row UPDATEs a
   second (a repair is replaced at the next commit; with ``--writes 0`` the source is idle and
   it waits ``IDLE_SWAP_SECONDS``, ~3 s); then, the writes stopped, asserted: a second
   verification is met ``equal`` and every row's key, status, note and qty equal the source's;
6. the baseline: the mirror stops, the table is marked stale in its file (as the mirror does
   for a table it must bootstrap again) and the mirror starts again: INIT bytes and seconds
   from its start to the table swapped in (a new snapshot is taken for it; the same writes
   meanwhile), rows asserted.

Not in the seconds: the sensors' ticks (``resync_sensor``, ``snapshot_request_sensor``: 30 s
apart at most) and Dagster's run launches. The verification and the snapshots are the
platform's, shared by every mirror of the table; the bytes are each mirror's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # snapshot.py's, repair.py's servers

from repair import provision_nats
from snapshot import PASSWORD, PUBLICATION, ROLE, TABLE, create_table, start_servers

from cdc_platform.dev.servers import LocalNatsServer, LocalPostgres
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.verifications import VerificationResult
from cdc_platform.settings import (
    BridgeSettings,
    MirrorSettings,
    NatsSettings,
    PlatformSettings,
    PostgresSettings,
)
from cdc_platform.verify.job import verify_table
from cdc_platform.wire import resync_subject
from cdc_platform.wire.digest import bucket_bits
from cdc_platform_tests.fixtures.bridge import bridge_ready, running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.slots import lose_slot

SLOT = "bench_slot"
FILLER = "bench_wal_filler"  # not published: WAL that takes the idle slot past its limit
COMPARED = "id, status, note, qty"  # the columns the lost changes write, compared row by row
WAIT = 300.0  # seconds any one step may take before the run is called failed


@dataclass
class Figure:
    fraction: float  # % of the rows the lost changes touched
    bits: int
    changed: int
    differing: int
    differing_share: float  # of the source's rows, those in the differing buckets
    bootstrapped_again: str | None  # why the mirror bootstrapped the table again (None: repaired)
    resync_bytes: int
    resync_seconds: float
    phases: dict[str, float]
    full_bytes: int = 0
    full_seconds: float = 0.0
    full_snapshot_seconds: float = 0.0  # of full_seconds, the platform's snapshot run


@dataclass
class Bench:
    """What every resync of the run shares."""

    admin: psycopg.Connection
    settings: PlatformSettings
    nats: Any  # a nats-py client
    conninfo: str  # the writes' (a superuser's)
    rate: float  # --writes
    db: Path  # the mirror's file
    changes: Changes
    taken: list[Any]  # the snapshots the responder took (SnapshotResult)
    running: RunningMirror | None = None


@dataclass
class RunningMirror:
    """The mirror task, what it reported (time.time(), line) and the verifications it met."""

    mirror: Mirror
    task: asyncio.Task
    stop: asyncio.Event
    started: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    met: dict[str, VerificationResult] = field(default_factory=dict)

    def tail(self, count: int = 20) -> str:
        return "\n".join(line for _, line in self.lines[-count:])

    def line_at(self, texts: tuple[str, ...], after: float) -> float | None:
        """When the first line holding each of ``texts`` from ``after`` on was reported."""
        return next((at for at, line in self.lines
                     if at >= after and all(text in line for text in texts)), None)

    def whole(self, table: str) -> bool:
        """Whether ``table`` streams with nothing of a resync, repair or bootstrap left."""
        if self.task.done():
            self.task.result()  # its error, if it stopped on one
            raise AssertionError(f"the mirror stopped:\n{self.tail()}")
        mirror = self.mirror
        return not (table in mirror.resyncing or mirror.repairs or mirror.bootstrapping)


def start_mirror(settings: PlatformSettings, db: Path) -> RunningMirror:
    stop = asyncio.Event()
    lines: list[tuple[float, str]] = []
    met: dict[str, VerificationResult] = {}

    def met_one(_: str, result: VerificationResult) -> None:
        met[result.verification_id] = result

    mirror = Mirror(settings, [TABLE], db, report=lambda line: lines.append((time.time(), line)),
                    options=MirrorSettings(status_interval_seconds=1.0,
                                           snapshot_wait_seconds=WAIT),
                    on_verification=met_one)
    return RunningMirror(mirror, asyncio.create_task(mirror.run(stop)), stop, time.time(),
                         lines, met)


async def until(running: RunningMirror, predicate, what: str) -> None:
    """Until ``predicate()``; failing, with what the mirror said last."""
    try:
        await wait_for(predicate, timeout=WAIT, interval=0.05, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the mirror said last:\n{running.tail()}") from None


async def stop_mirror(running: RunningMirror) -> None:
    running.stop.set()
    await asyncio.wait_for(running.task, 60)


async def caught_up(running: RunningMirror, nats_client) -> None:
    """Until the mirror has read the whole stream as it is now, its table streaming."""
    last = (await nats_client.jetstream().stream_info("CDC")).state.last_seq
    await until(running, lambda: running.whole(TABLE) and running.mirror.position >= last,
                f"the mirror to reach CDC seq {last}")


async def verification_met(running: RunningMirror, settings: PlatformSettings,
                           bits: int | None) -> VerificationResult:
    """A verification of the table now, as ``resync_sensor`` launches one; what the mirror
    found (``at``: when)."""
    verified = await verify_table(None, settings, TABLE, bits=bits)
    await until(running, lambda: verified.verification_id in running.met,
                f"verification {verified.verification_id} met")
    return running.met[verified.verification_id]


async def assert_equal(running: RunningMirror, settings: PlatformSettings,
                       admin: psycopg.Connection, db: Path, nats_client, *,
                       verify: bool) -> None:
    """The mirror's table is the source's: every row's compared columns and, with ``verify``,
    a verification met ``equal``."""
    target = admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    await until(running, lambda: admin.execute(
        "SELECT confirmed_flush_lsn >= %s FROM pg_replication_slots WHERE slot_name = %s",
        (target, SLOT)).fetchone()[0], "the bridge to confirm every change")
    await caught_up(running, nats_client)
    if verify:
        result = await verification_met(running, settings, None)
        assert result.status == "equal", f"{result.line()}\n{running.tail()}"
    source = admin.execute(f"SELECT {COMPARED} FROM {TABLE} ORDER BY id").fetchall()
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as local:
        held = local.execute(f'SELECT {COMPARED} FROM "{TABLE}" ORDER BY id').fetchall()
    if held != source:
        first = next(((h, s) for h, s in zip(held, source) if h != s), None)
        raise AssertionError(f"the mirror holds {len(held)} rows, the source {len(source)}; "
                             f"first difference (mirror, source): {first}")


class Changes:
    """The table's keys as they are, and the lost changes made to them."""

    def __init__(self, rows: int) -> None:
        self.keys = list(range(1, rows + 1))  # snapshot.py's create_table: ids 1..rows
        self.next_key = rows + 1
        self.random = random.Random(25)

    def make(self, admin: psycopg.Connection, fraction: float) -> int:
        """Update, delete and insert a third each of ``fraction`` of the rows; how many rows
        that touched."""
        changed = max(3, round(len(self.keys) * fraction))
        deletes = inserts = changed // 3
        picked = self.random.sample(self.keys, changed - inserts)
        updated, deleted = picked[deletes:], picked[:deletes]
        with admin.transaction():
            admin.execute(f"UPDATE {TABLE} SET note = 'lost change ' || md5(random()::text), "
                          "qty = qty + 1, status = 'lost' WHERE id = ANY(%s)", (updated,))
            admin.execute(f"DELETE FROM {TABLE} WHERE id = ANY(%s)", (deleted,))
            admin.execute(f"""
                INSERT INTO {TABLE}
                SELECT i, i %% 50000, 'inserted', (i %% 100000) / 100.0, 1 + i %% 9, now(),
                       'inserted while the slot was lost ' || md5(i::text), true, i / 7.0
                FROM generate_series(%s::bigint, %s::bigint) i""",
                          (self.next_key, self.next_key + inserts - 1))
        gone = set(deleted)
        self.keys = [key for key in self.keys if key not in gone]
        self.keys.extend(range(self.next_key, self.next_key + inserts))
        self.next_key += inserts
        return changed


@contextlib.contextmanager
def writes(conninfo: str, keys: list[int], rate: float) -> Iterator[None]:
    """One-row UPDATEs of random ``keys`` at ``rate`` a second (none at 0) in a thread, while
    inside: the source is not idle (a repair is replaced at the next commit, not after
    ``IDLE_SWAP_SECONDS`` with nothing to read)."""
    if rate <= 0:
        yield
        return
    stop = threading.Event()
    pick = random.Random(26).choice

    def write() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            while not stop.wait(1 / rate):
                conn.execute(f"UPDATE {TABLE} SET qty = qty + 1 WHERE id = %s", (pick(keys),))
    writer = threading.Thread(target=write, name="writes", daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join()


async def marker_stored_at(nats_client) -> float:
    """When JetStream stored the last resync marker of the slot (epoch seconds)."""
    marker = await nats_client.jetstream().get_last_msg("CDC", resync_subject(SLOT))
    assert marker.time is not None
    return marker.time.timestamp()


async def resync(bench: Bench, percent: float, bits: int | None) -> Figure:
    """One lost slot, its resync and the same run's full re-bootstrap (module doc, 1-6)."""
    admin, settings, running = bench.admin, bench.settings, bench.running
    assert running is not None
    changed = bench.changes.make(admin, percent / 100)
    lose_slot(admin, SLOT, FILLER)
    async with running_bridge(settings) as bridge:
        await wait_for(lambda: bridge.metrics.status()["slot_resyncs"] == 1, timeout=WAIT,
                       what="the resync marker")
        marker_at = await marker_stored_at(bench.nats)
        # (verify_table waits for the new slot too: its marker must be in the slot's stream)
        await wait_for(lambda: bridge.metrics.value(bridge.metrics.connected), timeout=WAIT,
                       what="the bridge streaming from its new slot")
        streaming_at = time.time()
        bytes_before, snapshots_before = running.mirror.init_bytes, len(bench.taken)
        with writes(bench.conninfo, bench.changes.keys, bench.rate):
            found = await verification_met(running, settings, bits)
            assert found.status == "differ", f"{found.line()}\n{running.tail()}"
            await until(running, lambda: running.whole(TABLE), "the mirror resynchronised")
            done_at = time.time()
        repaired = running.mirror.verified[TABLE].status == "repaired"
        again = next((line for at, line in running.lines
                      if at >= marker_at and line.endswith("; bootstrapping again")), None)
        assert repaired == (again is None), running.tail()
        loaded = running.line_at((": repair snapshot ", " loaded (") if repaired
                                 else ("; done (snapshot ",), marker_at)
        assert loaded is not None, running.tail()
        snapshot = sum(result.duration_seconds for result in bench.taken[snapshots_before:])
        phases = {"new slot": streaming_at - marker_at, "verification": found.at - streaming_at,
                  "snapshot": snapshot, "load": loaded - found.at - snapshot,
                  "replace" if repaired else "swap": done_at - loaded}
        in_differing = sum(source for _, source in found.buckets_differing.values())
        figure = Figure(percent, found.bits, changed, len(found.buckets_differing),
                        in_differing / len(bench.changes.keys),
                        again and again.removeprefix(f"{TABLE}: ").removesuffix(
                            "; bootstrapping again"),
                        running.mirror.init_bytes - bytes_before, done_at - marker_at, phases)
        await assert_equal(running, settings, admin, bench.db, bench.nats, verify=True)
        # the baseline: the same mirror bootstraps the table again from a new snapshot
        await stop_mirror(running)
        store = MirrorStore(bench.db)
        try:
            lsn = admin.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()[0]
            store.mark_stale(TABLE, "benchmark: a full re-bootstrap", int(lsn))
        finally:
            store.close()
        snapshots_before = len(bench.taken)
        with writes(bench.conninfo, bench.changes.keys, bench.rate):
            running = bench.running = start_mirror(settings, bench.db)
            await until(running, lambda: running.mirror.bootstraps == 1
                        and running.whole(TABLE), "the full re-bootstrap")
            figure.full_seconds = time.time() - running.started
        figure.full_snapshot_seconds = sum(
            result.duration_seconds for result in bench.taken[snapshots_before:])
        figure.full_bytes = running.mirror.init_bytes
        await assert_equal(running, settings, admin, bench.db, bench.nats, verify=False)
    return figure


def print_figure(figure: Figure) -> None:
    share = figure.differing / (1 << figure.bits)
    path = (f"repaired {figure.differing:,} buckets" if figure.bootstrapped_again is None
            else f"bootstrapped again: {figure.bootstrapped_again}; a repair of them would "
            f"read ~{figure.differing_share * figure.full_bytes / 1e6:.2f} MB (their "
            f"{figure.differing_share:.1%} of the rows)")
    phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in figure.phases.items())
    print(f"{figure.fraction:5g} % ({figure.changed:>6,} rows changed), {figure.bits:2d} bits: "
          f"{figure.differing:,} of {1 << figure.bits:,} buckets differ ({share:.1%}): {path}\n"
          f"    resync: {figure.resync_bytes / 1e6:8.2f} MB of INIT, "
          f"{figure.resync_seconds:6.2f} s from the marker ({phases})\n"
          f"    full re-bootstrap: {figure.full_bytes / 1e6:8.2f} MB, "
          f"{figure.full_seconds:6.2f} s (snapshot {figure.full_snapshot_seconds:.2f})\n"
          f"    resync / full: bytes {figure.resync_bytes / figure.full_bytes:.4f}, "
          f"seconds {figure.resync_seconds / figure.full_seconds:.2f}", flush=True)


async def run(args: argparse.Namespace, pg: LocalPostgres, nats: LocalNatsServer,
              work: Path) -> None:
    with psycopg.connect(pg.superuser_conninfo(), autocommit=True) as admin:
        for setting in ("max_slot_wal_keep_size = '1MB'", "max_wal_size = '32MB'",
                        "min_wal_size = '32MB'"):
            admin.execute(f"ALTER SYSTEM SET {setting}")
        admin.execute("SELECT pg_reload_conf()")
        admin.execute(f"CREATE TABLE {FILLER} (id bigserial PRIMARY KEY, note text)")
    await provision_nats(nats)
    started = time.perf_counter()
    create_table(pg, args.rows)
    print(f"{args.rows:,} rows of {TABLE} (created in {time.perf_counter() - started:.0f}s); "
          f"default verification bits: {bucket_bits(args.rows)}", flush=True)
    settings = PlatformSettings(
        postgres=PostgresSettings(host=pg.host, port=pg.port, database="postgres", user=ROLE,
                                  password=PASSWORD, publication=PUBLICATION, slot=SLOT,
                                  sslmode="disable"),
        nats=NatsSettings(url=nats.url),
        bridge=BridgeSettings(http_port=0, on_slot_lost="resync", heartbeat_interval_seconds=1.0,
                              status_interval_seconds=0.5))
    admin = psycopg.connect(pg.superuser_conninfo(), autocommit=True)
    client = await connect_nats(settings.nats)
    figures = []
    try:
        async with snapshot_responder(settings) as taken:
            bench = Bench(admin, settings, client, pg.superuser_conninfo(), args.writes,
                            work / "mirror.db", Changes(args.rows), taken)
            async with running_bridge(settings):
                await bridge_ready(admin, SimpleNamespace(slot=SLOT), settings, [TABLE])
                running = bench.running = start_mirror(settings, bench.db)
                await caught_up(running, client)
            print(f"bootstrapped: {running.mirror.init_bytes / 1e6:.1f} MB of INIT",
                  flush=True)
            for fraction in args.fractions:
                for bits in args.bits:
                    figure = await resync(bench, fraction, bits)
                    print_figure(figure)
                    figures.append(figure)
            await stop_mirror(bench.running)
    finally:
        await client.close()
        admin.close()
    print("\nfraction  bits  buckets differing  path       resync MB   full MB  bytes   "
          "resync s  full s  seconds")
    for f in figures:
        print(f"{f.fraction:6g} %  {f.bits:4d}  {f.differing:>7,} of {1 << f.bits:<6,}  "
              f"{'bootstrap' if f.bootstrapped_again else 'repair':9s}  {f.resync_bytes / 1e6:9.2f}  "
              f"{f.full_bytes / 1e6:8.2f}  {f.resync_bytes / f.full_bytes:6.4f}  "
              f"{f.resync_seconds:8.2f}  {f.full_seconds:6.2f}  "
              f"{f.resync_seconds / f.full_seconds:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--fractions", default="0.1,1,10",
                        help="%% of the rows the lost changes touch, comma-separated")
    parser.add_argument("--bits", default="default,14",
                        help="the verification's bits, comma-separated: 'default' "
                             "(bucket_bits(rows), an ordinary verification's) or a number "
                             "(14: what resync_sensor asks)")
    parser.add_argument("--writes", type=float, default=20.0,
                        help="one-row UPDATEs a second while the mirror resyncs and "
                             "bootstraps again (0: the source idle)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args()
    args.fractions = [float(f) for f in args.fractions.split(",")]
    args.bits = [None if b == "default" else int(b) for b in args.bits.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-resync-"))
    pg, nats = start_servers(work)
    try:
        asyncio.run(run(args, pg, nats, work))
    finally:
        nats.stop()
        pg.stop("immediate")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
