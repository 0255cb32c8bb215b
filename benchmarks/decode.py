"""In-process decode throughput: CopyData -> pgoutput message -> typed ChangeRecord.

    .venv/bin/python benchmarks/decode.py [--rows 500000] [--loop in-place|via-payload|all]
                                          [--profile] [--stand-in]

Input: the 100 Insert messages of a 5-column table (int8 id, text, int4, numeric(12,2),
timestamptz) captured from PostgreSQL 15 by COPY (cdc_platform_tests/data/pgoutput/pg15/
copy_multi_insert.jsonl), each framed as the XLogData CopyData message a walsender sends,
repeated to ``--rows`` distinct ``bytes`` objects (as libpq hands them over). Timed: for
every message ``parse_copy_data`` + ``decode_message`` + ``TransactionAssembler.feed``,
with the value converters of ``cdc_platform.protocol.values`` (or, with ``--stand-in`` or
while values.py does not exist, int/str/int/Decimal/datetime.fromisoformat). Target: 300K
rows/s per core.

Where the time goes (2-vCPU AMD EPYC VM, Python 3.11, stand-in converters, 500K rows;
``--loop in-place`` ~225K rows/s = 0.75x the target, ``via-payload`` ~200K rows/s):

    per row ~4.4 us, timed piecewise without a profiler
    0.57 us  13%  parse_copy_data: header unpack + XLogData (slot-descriptor construction)
    1.85 us  42%  decode_message: the generated, unrolled 5-column text reader is 1.2 us of
                  it (per column: struct unpack of kind+length, slice, UTF-8 decode, ~0.23
                  us); the rest is the Insert header and the Insert object
    1.85 us  42%  TransactionAssembler.feed (Insert inlined): converters 0.6 us (Decimal
                  and datetime.fromisoformat the dearest), generated dict builder 0.35 us,
                  ChangeRecord 0.35 us, dispatch + ordinal bookkeeping 0.5 us
    0.1  us   3%  the loop itself

cProfile (which triples the wall time) agrees on the order: read_exact 34% cumulative,
feed 32% (build 12%, ChangeRecord.__init__ 4.5%), parse_copy_data 10%. Already applied:
struct.Struct unpackers, loop unrolling by code generation (pgoutput._text_tuple_reader,
changes._row_builder), the Insert path inlined in decode_message and feed, frozen
dataclasses built through slot descriptors (object.__setattr__ per field costs ~6x),
decoding in place from the CopyData buffer (``via-payload`` pays a memoryview slice and a
copy: -10%). GC is not a factor (gc.disable() changes nothing). What is left is
interpreter work per column; more would need compiled code (mypyc/Cython) or fewer
Python-level objects per row (e.g. a tuple-based ChangeRecord, -0.1 us).
"""

from __future__ import annotations

import argparse
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
from typing import Any

from cdc_platform.lsn import parse_lsn
from cdc_platform.protocol.changes import TransactionAssembler
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


class StandInConverters:
    """int8/int4 -> int, numeric -> Decimal, timestamptz -> datetime, else str."""

    BY_OID: dict[int, Callable[[str], Any]] = {
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
    # bytes(bytearray(...)): distinct objects, as from the network, not 100 hot ones.
    return preamble, [bytes(bytearray(framed[i % len(framed)])) for i in range(rows)]


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


LOOPS = {"in-place": decode_stream, "via-payload": decode_stream_via_payload}


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


def bench_receive(rows: int) -> float:
    """Raw receive rate of the live replication connection for the same 5-column rows:
    a local PostgreSQL, one transaction of ``rows`` inserts, read as CopyData messages only
    (no decoding) until the commit. Returns rows/s."""
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
            conn.execute("SELECT pg_create_logical_replication_slot('bench', 'pgoutput')")
            conn.execute("INSERT INTO bench SELECT i, 'name-' || i, i %% 1000, i * 0.01, "
                         "now() FROM generate_series(1, %s) i", (rows,))

        async def receive() -> float:
            conninfo = (f"host={server.host} port={server.port} dbname=postgres "
                        "user=bench_reader password=bench replication=database")
            connection = await ReplicationConnection.connect(conninfo, "bench")
            await connection.start_replication("bench", 0, ["bench_pub"])
            started, received = time.perf_counter(), 0
            while received < rows + 3:  # Begin, Relation, inserts, Commit
                received += sum(1 for m in await connection.read(timeout=5.0) if m[0] == 0x77)
            elapsed = time.perf_counter() - started
            connection.close()
            return rows / elapsed

        return asyncio.run(receive())
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
        rate = bench_receive(args.rows)
        print(f"raw receive (replication connection, asyncio reader, no decode): "
              f"{rate:,.0f} rows/s; decode / receive = {decode_rate / rate:.2f}")


if __name__ == "__main__":
    main()
