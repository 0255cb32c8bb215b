#!/usr/bin/env python
"""The table digest's cost (``cdc_platform.wire.digest``, docs/verification.md), compiled twins
and pure Python in the same run, each figure with its ratio to baselines measured in the same
run on the same rows:

    .venv/bin/python benchmarks/digest.py [--rows 200000] [--mirror-rows 50000]
                                          [--source-rows 200000] [--repeat 3]

The pure figures come from copies of the pure modules loaded with the twins off, beside the
compiled ones (``pure_modules``); the mirror's store keeps its compiled twins throughout.

Rows: a 9-column table as the snapshot reader and the stream deliver it (int8 key, text,
int4, numeric, timestamptz, float8, bool, 16 bytes of bytea, a text[] of 3). Timed, best of
``--repeat``:

* ``msgpack.packb`` of each row map: the baseline, what publishing a row costs at least;
* ``hashlib.sha256`` of each row's canonical bytes, built beforehand: the hash alone;
* the same bytes with ``blake2b(digest_size=8)``, ``sha1`` and ``md5``: the hash functions
  considered (xxhash is not a dependency; measured when installed);
* per implementation: ``row_bytes`` (the canonical bytes alone), ``row_hash``, digesting
  row maps (``digest_rows``: key hash, row hash, add into 2^14 buckets) and digesting the
  same values column by column (``digest_columns``, no row maps);
* comparing two 2^14-bucket digests, and folding one to 2^10: buckets per second.

Then the mirror's side, on a real SQLite file written by ``MirrorStore`` (``--mirror-rows``):

* upkeep: ``MirrorStore.apply_transaction`` of INSERT events (100 a transaction), and of
  UPDATE events, with the digest kept current against the same without; for an UPDATE the
  old row is read back by key and hashed with ``StoredRowDigester`` (what the mirror will
  do, docs/verification.md "Mirror upkeep"). No NATS: the apply path alone, so the ratio is
  an upper bound of what the whole mirror loses;
* on demand: the table's digest from its rows (``SELECT *``, ``digest_stored_rows``),
  against a plain ``SELECT *`` of the same table (item 7's target: >= 0.5x).

Then the source's side (``--source-rows``, 0 skips it): its own PostgreSQL (temp dir) with
``benchmarks/snapshot.py``'s 9-column table, and ``psql -c "\\copy (SELECT ...) TO
'/dev/null'"`` (best of ``--repeat``) against the same COPY read in this process
(``copy_blocks``) through the snapshot reader's ``Chunker`` and digested: by row maps
(``rows_of`` + ``digest_rows``), by columns (``columns_of`` + ``digest_columns``), from the
fields themselves (``Chunker.digest``, the compiled chunker writing the canonical bytes from
the COPY text), from the block (``Chunker.digest_block``: no Python str per field), and the
parts alone (the COPY drained; drained and converted) to show where
the time goes (item 7's target: >= 0.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import math
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cdc_platform import speedups
from cdc_platform.mirror import stored_values
from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.wire import digest
from cdc_platform.wire.digest import MAX_BUCKET_BITS, TableDigest, bucket_bits

COLUMNS = ("id", "name", "qty", "price", "created", "ratio", "active", "token", "tags")
TYPE_OIDS = (20, 25, 23, 1700, 1184, 701, 16, 17, 1009)
TABLE = "bench_rows"
TRANSACTION_EVENTS = 100


def make_rows(count: int) -> list[dict[str, Any]]:
    return [{"id": n, "name": f"customer-{n:07d} {'x' * (n % 17)}", "qty": n % 1000,
             "price": f"{n % 100000}.{n % 100:02d}",
             "created": f"2025-12-{1 + n % 28:02d}T{n % 24:02d}:{n % 60:02d}:{n % 60:02d}."
                        f"{n % 1000000:06d}Z",
             "ratio": n / 7 if n % 11 else math.nan, "active": n % 3 == 0,
             "token": n.to_bytes(16, "big"), "tags": ["a", f"t{n % 10}", None]}
            for n in range(count)]


def pure_modules() -> tuple[ModuleType, ModuleType]:
    """Copies of ``wire.digest`` and ``mirror.stored_values`` that bind no compiled twin (the
    second importing the first), to time beside the modules in use."""
    def load(name: str) -> ModuleType:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    in_use, speedups.PURE_PYTHON = speedups.PURE_PYTHON, True
    try:
        pure_digest = load("cdc_platform.wire.digest")
        sys.modules["cdc_platform.wire.digest"] = pure_digest
        try:
            pure_stored = load("cdc_platform.mirror.stored_values")
        finally:
            sys.modules["cdc_platform.wire.digest"] = digest
    finally:
        speedups.PURE_PYTHON = in_use
    return pure_digest, pure_stored


def implementations() -> dict[str, tuple[ModuleType, ModuleType]]:
    """``{"compiled": (digest, stored_values), "pure": (...)}``; compiled only when built."""
    pure = pure_modules()
    if speedups.compiled_twin(digest.__name__) is None:
        print("(the compiled twins are not built or are off: pure Python only)")
        return {"pure": pure}
    return {"compiled": (digest, stored_values), "pure": pure}


def best(repeat: int, run: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def hash_all(factory: Callable[[bytes], Any], data: Sequence[bytes]) -> Callable[[], None]:
    def run() -> None:
        for item in data:
            factory(item).digest()
    return run


def digesting(module: ModuleType, rows: list[dict[str, Any]]
              ) -> list[tuple[str, Callable[[], Any]]]:
    """What is timed of one implementation of ``wire.digest`` on ``rows``."""
    bound = module.RowDigester(COLUMNS, ["id"])
    columns = [[row[name] for row in rows] for name in COLUMNS]
    return [
        ("row_bytes (canonical bytes alone)", lambda: [bound.row_bytes(row) for row in rows]),
        ("row_hash (canonical bytes + sha256)", lambda: [bound.row_hash(row) for row in rows]),
        ("digest_rows (key hash + row hash + add)",
         lambda: module.digest_rows(TableDigest(MAX_BUCKET_BITS), bound, rows)),
        ("digest_columns (the same, no row maps)",
         lambda: module.digest_columns(TableDigest(MAX_BUCKET_BITS), bound, columns,
                                       len(rows)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--mirror-rows", type=int, default=50_000)
    parser.add_argument("--source-rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    kinds = implementations()
    rows = make_rows(args.rows)
    digester = digest.RowDigester(COLUMNS, ["id"])
    canonical = [digester.row_bytes(row) for row in rows]
    packed = [msgpack.packb(row) for row in rows]
    print(f"{len(rows):,} rows of {len(COLUMNS)} columns; canonical bytes "
          f"{sum(map(len, canonical)) / len(rows):.0f} a row (msgpack "
          f"{sum(map(len, packed)) / len(rows):.0f}); {1 << MAX_BUCKET_BITS:,} buckets")

    def per_second(seconds: float) -> float:
        return len(rows) / seconds

    baseline = per_second(best(args.repeat, lambda: [msgpack.packb(row) for row in rows]))
    sha256 = per_second(best(args.repeat, hash_all(hashlib.sha256, canonical)))
    figures: list[tuple[str, float]] = [
        ("msgpack.packb of the row map (baseline)", baseline),
        ("sha256 of prebuilt canonical bytes (baseline)", sha256)]
    alternatives = {"blake2b(digest_size=8)": lambda b: hashlib.blake2b(b, digest_size=8),
                    "sha1": hashlib.sha1, "md5": hashlib.md5}
    try:
        import xxhash  # type: ignore[import-not-found]
        alternatives["xxh3_64"] = xxhash.xxh3_64
    except ImportError:
        print("(xxhash not installed: not measured)")
    for name, factory in alternatives.items():
        figures.append((f"{name} of the same bytes (hashlib)",
                        per_second(best(args.repeat, hash_all(factory, canonical)))))
    for kind, (module, _) in kinds.items():
        figures += [(f"{kind}: {name}", per_second(best(args.repeat, run)))
                    for name, run in digesting(module, rows)]
    print(f"{'rows/s':>12}  {'x packb':>8}  {'x sha256':>8}  what")
    for name, rate in figures:
        print(f"{rate:>12,.0f}  {rate / baseline:>8.2f}  {rate / sha256:>8.2f}  {name}")

    fine = digest.table_digest(rows, digester, MAX_BUCKET_BITS)
    other = digest.table_digest(rows[1:], digester, MAX_BUCKET_BITS)
    buckets = 1 << MAX_BUCKET_BITS
    compare = best(args.repeat, lambda: fine.differing(other))
    fold = best(args.repeat, lambda: fine.folded(10))
    print(f"{buckets / compare:>12,.0f}  buckets/s compared (two digests of {buckets:,} buckets)")
    print(f"{buckets / fold:>12,.0f}  buckets/s folded ({buckets:,} into 1,024)")
    with tempfile.TemporaryDirectory() as directory:
        mirror_side(Path(directory), rows[:args.mirror_rows], kinds, args.repeat)
        if args.source_rows:
            source_side(Path(directory), args.source_rows, kinds, args.repeat)


def shape() -> TableShape:
    return TableShape.from_schema({
        "table": TABLE, "fingerprint": "bench", "primary_key": ["id"],
        "columns": [{"name": name, "type_oid": oid,
                     "data_type": "text[]" if oid == 1009 else "x", "attnum": position}
                    for position, (name, oid) in enumerate(zip(COLUMNS, TYPE_OIDS), start=1)]})


def events(rows: Sequence[dict[str, Any]], operation: str, high: int
           ) -> list[list[dict[str, Any]]]:
    """``rows`` as change events, TRANSACTION_EVENTS to a transaction, with commit LSNs
    ``{high}/...`` (each phase above the last: the high-water mark skips nothing)."""
    transactions = []
    for start in range(0, len(rows), TRANSACTION_EVENTS):
        commit_lsn = f"{high:X}/{start + 1:X}"
        transactions.append([
            {"table": TABLE, "operation": operation, "commit_lsn": commit_lsn,
             "lsn": commit_lsn, "ordinal": ordinal, "msg_id": f"{commit_lsn}:{ordinal}",
             "data": row, "unchanged_toast": []}
            for ordinal, row in enumerate(rows[start:start + TRANSACTION_EVENTS])])
    return transactions


def mirror_side(directory: Path, rows: list[dict[str, Any]],
                kinds: dict[str, tuple[ModuleType, ModuleType]], repeat: int) -> None:
    table_shape = shape()
    updated = [{**row, "qty": row["qty"] + 1, "name": row["name"] + "!"} for row in rows]
    print(f"\nthe mirror's side, {len(rows):,} rows, SQLite written by MirrorStore:")

    def apply(path: Path, kind: str | None) -> tuple[float, float]:
        """(inserts/s, updates/s) applying ``rows`` then ``updated`` into a new file, the
        digest kept by ``kind``'s modules (None: not kept)."""
        store = MirrorStore(path)
        try:
            store.begin_bootstrap(table_shape, "bench", 1)
            store.finish_bootstrap(TABLE, 0)
            table_digest = TableDigest(MAX_BUCKET_BITS)
            if kind is not None:
                module, stored_module = kinds[kind]
                hashes = module.RowDigester(COLUMNS, ["id"]).hashes
                old_hashes = stored_module.StoredRowDigester(table_shape.columns, ["id"]).hashes
            reader = sqlite3.connect(path)
            select = f'SELECT * FROM "{TABLE}" WHERE id = ?'
            rates = []
            for high, (operation, source) in enumerate((("INSERT", rows), ("UPDATE", updated)),
                                                       start=1):
                started = time.perf_counter()
                for seq, transaction in enumerate(events(source, operation, high), start=1):
                    if kind is not None:
                        for event in transaction:
                            data = event["data"]
                            if operation == "UPDATE":
                                table_digest.remove(*old_hashes(reader.execute(
                                    select, (data["id"],)).fetchone()))
                            table_digest.add(*hashes(data))
                    store.apply_transaction(transaction, seq)
                rates.append(len(source) / (time.perf_counter() - started))
            reader.close()
            return rates[0], rates[1]
        finally:
            store.close()

    # interleaved (without, then each kind, repeat times): the machine's speed drifts
    applied: dict[str | None, list[tuple[float, float]]] = {None: [], **{k: [] for k in kinds}}
    for n in range(repeat):
        for kind, results in applied.items():
            results.append(apply(directory / f"{kind or 'plain'}-{n}.db", kind))
    plain = applied[None]
    for kind in kinds:
        for index, operation in enumerate(("INSERT", "UPDATE")):
            without = max(rates[index] for rates in plain)
            with_digest = max(rates[index] for rates in applied[kind])
            print(f"{with_digest:>12,.0f}  {kind}: {operation} events/s applied with the digest "
                  f"kept, {with_digest / without:.2f} x {without:,.0f} without")

    path = directory / f"plain-{repeat - 1}.db"
    db = sqlite3.connect(path)
    query = f'SELECT * FROM "{TABLE}"'

    def scan() -> None:
        for _ in db.execute(query):
            pass

    baseline = len(rows) / best(repeat, scan)
    expected = digest.table_digest(updated, digest.RowDigester(COLUMNS, ["id"]),
                                   bucket_bits(len(rows)))
    for kind, (_, stored_module) in kinds.items():
        stored_digester = stored_module.StoredRowDigester(table_shape.columns, ["id"])

        def scan_digest(stored_module: ModuleType = stored_module,
                        stored_digester: Any = stored_digester) -> TableDigest:
            scanned = TableDigest(bucket_bits(len(rows)))
            stored_module.digest_stored_rows(scanned, stored_digester, db.execute(query))
            return scanned

        assert scan_digest() == expected
        on_demand = len(rows) / best(repeat, scan_digest)
        print(f"{on_demand:>12,.0f}  {kind}: rows/s, the mirror's digest from its SQLite rows, "
              f"{on_demand / baseline:.2f} x a plain SELECT * ({baseline:,.0f} rows/s)")
    db.close()


def source_side(directory: Path, count: int, kinds: dict[str, tuple[ModuleType, ModuleType]],
                repeat: int) -> None:
    """A source digest from COPY in this process against ``psql \\copy`` of the same rows."""
    from snapshot import COLUMNS as SOURCE_COLUMNS
    from snapshot import PUBLICATION, create_table
    from snapshot import TABLE as SOURCE_TABLE

    from cdc_platform.dev.servers import start_logical_postgres
    from cdc_platform.replication.connection import SESSION_OPTIONS
    from cdc_platform.settings import EncodingSettings
    from cdc_platform.snapshot.chunks import Chunker
    from cdc_platform.snapshot.plan import BlockRange
    from cdc_platform.snapshot.reader import copy_blocks
    from cdc_platform.snapshot.source import (
        chunk_layout,
        copy_select,
        describe_table,
        table_converters,
    )

    pg = start_logical_postgres(directory / "pg", unsafe_no_fsync=True)
    try:
        create_table(pg, count)
        psql = shutil.which("psql") or str(pg.bin_dir / "psql")
        command = [psql, "-h", str(pg.socket_dir), "-p", str(pg.port), "-U", "postgres", "-d",
                   "postgres", "-X", "-q", "-c",
                   f"\\copy (SELECT {SOURCE_COLUMNS} FROM {SOURCE_TABLE}) TO '/dev/null'"]
        env = {**os.environ, "PGOPTIONS": SESSION_OPTIONS}

        def copy_to_null() -> None:
            subprocess.run(command, check=True, env=env)

        copy_to_null()  # the table into shared buffers
        baseline = count / best(repeat, copy_to_null)
        conninfo = pg.superuser_conninfo()
        with psycopg.connect(conninfo, autocommit=True, options=SESSION_OPTIONS) as conn:
            table = describe_table(conn, PUBLICATION, SOURCE_TABLE)
            select = copy_select(table.schema).replace(
                "{range}", BlockRange(0, 0, None).predicate().as_string(None))
            layout = chunk_layout(table, EncodingSettings(), "bench", "0/0", 1 << 20, None,
                                  signed=False)
            converters = table_converters(table)
            names = layout.columns
            key = list(table.schema.primary_key)

            def timed(consume: Callable[[Chunker, bytearray], Any]) -> float:
                chunker = Chunker(layout, converters, 0)

                async def drain() -> None:
                    async for block in copy_blocks(conn.pgconn, select):
                        consume(chunker, block)

                return count / best(repeat, lambda: asyncio.run(drain()))

            def converted(chunker: Chunker, block: bytearray) -> list[list[Any]]:
                _lines, fields, escapes = chunker.parse(block)
                return chunker.columns_of(fields, escapes)

            figures = [("COPY drained (copy_blocks), nothing else", timed(lambda c, b: None)),
                       ("COPY drained, parsed, converted (columns_of)", timed(converted))]
            for kind, (module, _) in kinds.items():
                bound = module.RowDigester(names, key)
                target = TableDigest(MAX_BUCKET_BITS)

                def by_rows(chunker: Chunker, block: bytearray, module: ModuleType = module,
                            bound: Any = bound, target: TableDigest = target) -> None:
                    lines, fields, escapes = chunker.parse(block)
                    module.digest_rows(target, bound,
                                       chunker.rows_of(fields, len(lines), escapes)[0])

                def by_columns(chunker: Chunker, block: bytearray,
                               module: ModuleType = module, bound: Any = bound,
                               target: TableDigest = target) -> None:
                    lines, fields, escapes = chunker.parse(block)
                    module.digest_columns(target, bound, chunker.columns_of(fields, escapes),
                                          len(lines))

                figures.append((f"{kind}: digest by row maps (rows_of + digest_rows)",
                                timed(by_rows)))
                figures.append((f"{kind}: digest by columns (columns_of + digest_columns)",
                                timed(by_columns)))
                if module is digest:  # the compiled chunker hashes the fields themselves

                    def by_fields(chunker: Chunker, block: bytearray, bound: Any = bound,
                                  target: TableDigest = target) -> None:
                        lines, fields, escapes = chunker.parse(block)
                        chunker.digest(target, bound, fields, len(lines), escapes, {})

                    figures.append((f"{kind}: digest from the fields (Chunker.digest)",
                                    timed(by_fields)))

                    def by_block(chunker: Chunker, block: bytearray, bound: Any = bound,
                                 target: TableDigest = target) -> None:
                        chunker.digest_block(target, bound, block, {})

                    figures.append((f"{kind}: digest from the block (Chunker.digest_block)",
                                    timed(by_block)))
    finally:
        pg.stop()
    print(f"\nthe source's side, {count:,} rows of snapshot.py's table "
          f"({SOURCE_COLUMNS}):")
    print(f"{baseline:>12,.0f}  rows/s: psql \\copy (SELECT ...) TO '/dev/null' (baseline)")
    for name, rate in figures:
        print(f"{rate:>12,.0f}  {rate / baseline:>5.2f} x psql  {name}")


if __name__ == "__main__":
    main()
