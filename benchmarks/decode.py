"""In-process decode throughput: CopyData -> pgoutput message -> typed ChangeRecord.

    .venv/bin/python benchmarks/decode.py [--rows 500000] [--loop in-place|via-payload|all]
                                          [--profile] [--stand-in]

Input: the 100 Insert messages of a 5-column table (int8 id, text, int4, numeric(12,2),
timestamptz) captured from PostgreSQL 15 by COPY (cdc_platform_tests/data/pgoutput/pg15/
copy_multi_insert.jsonl), each framed as the XLogData CopyData message a walsender sends,
repeated to ``--rows`` distinct objects, memoryviews as psycopg's ``get_copy_data`` hands
them over. Timed, per loop (all printed; the best is compared with the receive rate):

* ``runs``: the bridge's loop (``SlotReader.read``): runs of row changes through
  ``TransactionAssembler.take_changes``, one compiled call per run, in batches of 4096
  messages (the reader's ``read_limit``);
* ``in-place``: per message ``parse_copy_data`` + ``decode_message`` + ``feed``, the general
  path every other message takes;
* ``via-payload``: the same through ``XLogData.payload``.

With the value converters of ``cdc_platform.protocol.values`` (or, with ``--stand-in``,
int/str/int/Decimal/datetime.fromisoformat). Target: 300K rows/s per core.

Where the time goes (2-vCPU VM, Python 3.11, compiled twins built), 2026-11-22:
``runs`` ~2.0 us per row, ~500K rows/s = 1.7x the target: TupleData read 0.25 us, typed
row 0.4 (timestamptz 0.15 of it), ChangeRecord 0.35, the rest list and loop work. The
general path is ~3.5 us per row (~270-290K rows/s that day): parse_copy_data 0.6, decode_message
0.8 (+0.2 copying a memoryview to bytes), feed 1.1. Pure Python
(CDC_PLATFORM_PURE_PYTHON=1) is ~190K rows/s. The VM's speed varies from run to run
(the general path measured 270-440K rows/s on one day), so compare only within a run.

The receive rate is set by the walsender (~100-150K rows/s here). When the data is only
counted, a dedicated reader thread (select + libpq, bounded queue) receives up to a third
faster than the asyncio reader on the same WAL (asyncio / thread 0.67-1.00 over 8 runs).
With the batches decoded on the event loop, as the bridge does, the two are within noise
(asyncio / thread 0.86-1.13 over 6 runs, ~114-153K rows/s): the walsender is the limit
either way. The bridge keeps the asyncio reader: no cross-thread hand-off, no lock around
libpq for the status updates it sends, no GIL contention with decoding.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import struct
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, ClassVar

from cdc_platform.lsn import parse_lsn
from cdc_platform.protocol.changes import ChangeRecord, TransactionAssembler
from cdc_platform.protocol.pgoutput import (
    Begin,
    Insert,
    Relation,
    RelationColumn,
    decode_message,
)
from cdc_platform.protocol.streaming import XLOGDATA_HEADER_SIZE, parse_copy_data

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "cdc_platform_tests" / "data" / "pgoutput" / "pg15" / "copy_multi_insert.jsonl"
TARGET_ROWS_PER_SECOND = 300_000
READ_LIMIT = 4096  # CopyData messages per SlotReader.read (its read_limit)


class StandInConverters:
    """int8/int4 -> int, numeric -> Decimal, timestamptz -> datetime, else str."""

    BY_OID: ClassVar[dict[int, Callable[[str], Any]]] = {
        20: int, 23: int, 1700: Decimal, 1184: datetime.fromisoformat}

    def for_columns(self, columns: Sequence[RelationColumn]) -> list[Callable[[str], Any]]:
        return [self.BY_OID.get(c.type_oid, str) for c in columns]


def converters(stand_in: bool) -> tuple[object, str]:
    """The converter factory to benchmark, and its name."""
    if not stand_in:
        try:
            from cdc_platform.protocol.values import TypeRegistry
        except ImportError:
            pass
        else:
            return TypeRegistry(), "cdc_platform.protocol.values.TypeRegistry"
    return StandInConverters(), "stand-in (int/str/int/Decimal/datetime.fromisoformat)"


def load_fixture() -> tuple[int, bytes, bytes, list[bytes]]:
    """(lsn, Begin bytes, Relation bytes, Insert payloads) of the captured COPY."""
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()[1:]]
    begin = relation = None
    inserts = []
    for row in rows:
        data = bytes.fromhex(row["data"])
        message = decode_message(data)
        if isinstance(message, Begin):
            begin = data
        elif isinstance(message, Relation):
            relation = data
        elif isinstance(message, Insert):
            inserts.append(data)
    assert begin is not None and relation is not None and len(inserts) == 100
    return parse_lsn(rows[0]["lsn"]), begin, relation, inserts


def xlogdata(lsn: int, payload: bytes) -> bytes:
    """The CopyData message a walsender sends for one pgoutput message."""
    return struct.pack(">cQQq", b"w", lsn, lsn, 0) + payload


def build_copy_data(rows: int) -> tuple[list[bytes], list[bytes]]:
    """(preamble: Begin + Relation, ``rows`` distinct Insert CopyData buffers)."""
    lsn, begin, relation, inserts = load_fixture()
    preamble = [xlogdata(lsn, begin), xlogdata(lsn, relation)]
    framed = [xlogdata(lsn, p) for p in inserts]
    # Distinct objects, as from the network, not 100 hot ones; memoryviews, as psycopg's
    # get_copy_data hands them over.
    return preamble, [memoryview(bytes(bytearray(framed[i % len(framed)])))
                      for i in range(rows)]


def decode_stream(assembler: TransactionAssembler, buffers: Sequence[bytes]) -> int:
    """The timed loop, decoding in place (no payload slice or copy): rows produced."""
    feed = assembler.feed
    count = 0
    for buf in buffers:
        message = parse_copy_data(buf)
        for _event in feed(message.wal_start, decode_message(buf, XLOGDATA_HEADER_SIZE)):
            count += 1
    return count


def decode_stream_via_payload(assembler: TransactionAssembler, buffers: Sequence[bytes]) -> int:
    """The same through ``XLogData.payload`` (a memoryview, copied to bytes by the
    decoder), as ``cdc_platform.replication.reader`` does it today."""
    feed = assembler.feed
    count = 0
    for buf in buffers:
        message = parse_copy_data(buf)
        for _event in feed(message.wal_start, decode_message(message.payload)):
            count += 1
    return count


def assemble_batch(assembler: TransactionAssembler, raw: list) -> int:
    """One reader batch through the bridge's loop (``SlotReader.read``): runs of row
    changes in one compiled call (``TransactionAssembler.take_changes``), anything else
    as in :func:`decode_stream`. Returns the change records produced."""
    events: list = []
    index, count = 0, len(raw)
    while index < count:
        if assembler.in_transaction:
            taken, _ = assembler.take_changes(raw, index, events)
            if taken > index:
                index = taken
                continue
        buf = raw[index]
        index += 1
        if buf[0] != 0x77:
            continue  # a keepalive
        message = parse_copy_data(buf)
        events.extend(assembler.feed(message.wal_start,
                                     decode_message(buf, XLOGDATA_HEADER_SIZE)))
    return sum(1 for event in events if type(event) is ChangeRecord)


def decode_stream_runs(assembler: TransactionAssembler, buffers: Sequence[bytes]) -> int:
    """The bridge's loop, in the reader's batches of ``READ_LIMIT`` messages."""
    return sum(assemble_batch(assembler, list(buffers[first:first + READ_LIMIT]))
               for first in range(0, len(buffers), READ_LIMIT))


LOOPS = {"runs": decode_stream_runs, "in-place": decode_stream,
         "via-payload": decode_stream_via_payload}


def bench_decode(rows: int, *, stand_in: bool = False, profile: bool = False,
                 loop: str = "in-place", out=sys.stdout) -> float:
    """Rows per second of CopyData -> ChangeRecord; prints a summary (and a profile)."""
    factory, name = converters(stand_in)
    preamble, buffers = build_copy_data(rows)
    run = LOOPS[loop]
    assembler = TransactionAssembler(factory)  # type: ignore[arg-type]
    run(assembler, preamble)
    run(assembler, buffers[:1000])  # warm up
    profiler = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    produced = run(assembler, buffers)
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - started
    assert produced == rows, (produced, rows)
    rate = rows / elapsed
    print(f"decode+assemble ({loop}): {rows:,} rows in {elapsed:.2f}s = {rate:,.0f} rows/s "
          f"({rate / TARGET_ROWS_PER_SECOND:.2f}x the {TARGET_ROWS_PER_SECOND:,} target; "
          f"converters: {name})", file=out)
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue(), file=out)
    return rate


def bench_receive(rows: int) -> dict[str, float]:
    """Receive rate of the live replication connection for the same 5-column rows: a local
    PostgreSQL, one transaction of ``rows`` inserts, read until the commit by the two ways a
    replication connection can live with asyncio (issue 3): ``asyncio`` -- the non-blocking
    socket on the event loop (``ReplicationConnection``, what the bridge uses); ``thread`` --
    a dedicated thread doing libpq reads into a bounded queue, the event loop taking batches
    from it. Each way twice: CopyData messages only counted (``asyncio``, ``thread``), and
    decoded on the event loop as the bridge does (``asyncio+decode``, ``thread+decode``).
    Each run reads the same WAL from its own slot, after a warm-up read (the first reader of
    a WAL pays for reading it from disk). Returns rows/s per run."""
    import asyncio
    import shutil
    import tempfile

    import psycopg

    from cdc_platform.dev.servers import start_logical_postgres
    from cdc_platform.postgres.admin import provision_database
    from cdc_platform.replication.connection import ReplicationConnection

    base = Path(tempfile.mkdtemp(prefix="cdc-decode-bench-"))
    server = start_logical_postgres(base / "pg")
    try:
        with psycopg.connect(server.superuser_conninfo(), autocommit=True) as conn:
            conn.execute("CREATE TABLE bench (id int8 PRIMARY KEY, name text, qty int4, "
                         "price numeric(12,2), created timestamptz)")
            provision_database(conn, publication="bench_pub", role="bench_reader",
                               tables=["bench"], role_password="bench")
            for slot in ("bench_warm", "bench", "bench_t", "bench_d", "bench_td"):
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')",
                             (slot,))
            conn.execute("INSERT INTO bench SELECT i, 'name-' || i, i %% 1000, i * 0.01, "
                         "now() FROM generate_series(1, %s) i", (rows,))

        def counted_or_decoded(decode: bool) -> Callable[[list], int]:
            """Per batch: its XLogData messages, and, if asked, decoded (a change record
            per row; Begin, Relation and Commit then counted apart)."""
            if not decode:
                return lambda batch: sum(1 for m in batch if m[0] == 0x77)
            assembler = TransactionAssembler(converters(False)[0])  # type: ignore[arg-type]

            def decoded(batch: list) -> int:
                others = sum(1 for m in batch if m[0] == 0x77 and m[25] in b"BRC")
                return assemble_batch(assembler, batch) + others
            return decoded

        async def receive(slot: str, decode: bool) -> float:
            conninfo = (f"host={server.host} port={server.port} dbname=postgres "
                        "user=bench_reader password=bench replication=database")
            connection = await ReplicationConnection.connect(conninfo, "bench")
            await connection.start_replication(slot, 0, ["bench_pub"])
            count = counted_or_decoded(decode)
            started, received = time.perf_counter(), 0
            while received < rows + 3:  # Begin, Relation, inserts, Commit
                received += count(await connection.read(timeout=5.0))
            elapsed = time.perf_counter() - started
            connection.close()
            return rows / elapsed

        async def receive_in_thread(slot: str, decode: bool) -> float:
            import queue
            import threading

            from psycopg import pq

            conninfo = (f"host={server.host} port={server.port} dbname=postgres "
                        "user=bench_reader password=bench replication=database")
            batches: queue.Queue = queue.Queue(maxsize=64)  # bounded: backpressure

            def read() -> None:  # libpq reads off the event loop
                import select

                pgconn = pq.PGconn.connect(conninfo.encode())
                pgconn.exec_(f"START_REPLICATION SLOT {slot} LOGICAL 0/0 (proto_version "
                             "'1', publication_names 'bench_pub')".encode())
                pgconn.nonblocking = 1
                # Wait in select(), which releases the GIL: psycopg's blocking
                # get_copy_data(0) holds it while it waits for the network, starving the
                # event loop (measured: ~1K rows/s).
                while not stop.is_set():
                    select.select([pgconn.socket], [], [], 1.0)
                    pgconn.consume_input()
                    batch = []
                    while len(batch) < 4096:
                        nbytes, data = pgconn.get_copy_data(1)
                        if nbytes <= 0:
                            break
                        batch.append(data)
                    if batch:
                        batches.put(batch)  # blocks when the loop falls behind
                    if nbytes < 0:
                        break
                pgconn.finish()

            stop = threading.Event()
            thread = threading.Thread(target=read, daemon=True)
            loop = asyncio.get_running_loop()
            count = counted_or_decoded(decode)
            started, received = time.perf_counter(), 0
            thread.start()
            while received < rows + 3:
                received += count(await loop.run_in_executor(None, batches.get))
            elapsed = time.perf_counter() - started
            stop.set()
            while thread.is_alive():  # let it see stop (a full queue would block its put)
                with contextlib.suppress(queue.Empty):
                    batches.get_nowait()
                thread.join(0.05)
            return rows / elapsed

        asyncio.run(receive("bench_warm", False))  # the first reader pays for a cold WAL
        return {"asyncio": asyncio.run(receive("bench", False)),
                "thread": asyncio.run(receive_in_thread("bench_t", False)),
                "asyncio+decode": asyncio.run(receive("bench_d", True)),
                "thread+decode": asyncio.run(receive_in_thread("bench_td", True))}
    finally:
        server.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pgoutput decode throughput")
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--profile", action="store_true", help="run under cProfile")
    parser.add_argument("--stand-in", action="store_true",
                        help="stand-in converters instead of cdc_platform.protocol.values")
    parser.add_argument("--loop", choices=[*LOOPS, "all"], default="all")
    parser.add_argument("--no-receive", action="store_true",
                        help="skip the live receive-rate baseline (needs PostgreSQL)")
    args = parser.parse_args(argv)
    decode_rate = 0.0
    for loop in LOOPS if args.loop == "all" else [args.loop]:
        decode_rate = max(decode_rate, bench_decode(args.rows, stand_in=args.stand_in,
                                                    profile=args.profile, loop=loop))
    if not args.no_receive:
        rates = bench_receive(args.rows)
        rate = rates["asyncio"]
        print(f"raw receive (replication connection, asyncio reader, no decode): "
              f"{rate:,.0f} rows/s; decode / receive = {decode_rate / rate:.2f}")
        print(f"raw receive (dedicated reader thread: select + libpq, bounded queue): "
              f"{rates['thread']:,.0f} rows/s; asyncio / thread = "
              f"{rate / rates['thread']:.2f}")
        print(f"receive + decode on the event loop (the bridge's reading half): asyncio "
              f"{rates['asyncio+decode']:,.0f} rows/s, thread {rates['thread+decode']:,.0f} "
              f"rows/s; asyncio / thread = "
              f"{rates['asyncio+decode'] / rates['thread+decode']:.2f}")


if __name__ == "__main__":
    main()
