#!/usr/bin/env python
"""The table digest's cost in this process (``cdc_platform.wire.digest``, docs/verification.md),
each figure with its ratio to baselines measured in the same run on the same rows:

    .venv/bin/python benchmarks/digest.py [--rows 200000] [--repeat 3]

Rows: a 9-column table as the snapshot reader and the stream deliver it (int8 key, text,
int4, numeric, timestamptz, float8, bool, 16 bytes of bytea, a text[] of 3). Timed, best of
``--repeat``:

* ``msgpack.packb`` of each row map: the baseline, what publishing a row costs at least;
* ``hashlib.sha256`` of each row's canonical bytes, built beforehand: the hash alone;
* the same bytes with ``blake2b(digest_size=8)``, ``sha1`` and ``md5``: the hash functions
  considered (xxhash is not a dependency; measured when installed);
* ``row_bytes``: the canonical bytes alone;
* ``row_hash``: canonical bytes + SHA-256 (what a mirror does per applied row);
* digesting: key hash, row hash and adding into the buckets (what the source does per row);
* comparing two 2^14-bucket digests, and folding one to 2^10: buckets per second.

Then the mirror's side, on a real SQLite file written by ``MirrorStore``:

* on demand: the table's digest from its rows (``SELECT *``, ``stored_values.wire_value``,
  key and row hash, add), against a plain ``SELECT *`` of the same table;
* upkeep: ``MirrorStore.apply_transaction`` of INSERT events (100 a transaction), and of
  UPDATE events, with the digest kept current against the same without; for an UPDATE the
  old row is read back by key and hashed (what the mirror will do, docs/verification.md
  "Mirror upkeep"). No NATS: the apply path alone, so the ratio is an upper bound of what
  the whole mirror loses.

No servers. A source's digest against ``psql COPY`` needs the verification run (issue 25
item 7; docs/verification.md, item 7).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.stored_values import wire_value
from cdc_platform.wire.digest import (
    MAX_BUCKET_BITS,
    RowDigester,
    TableDigest,
    bucket_bits,
    table_digest,
)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = make_rows(args.rows)
    digester = RowDigester(COLUMNS, ["id"])
    canonical = [digester.row_bytes(row) for row in rows]
    packed = [msgpack.packb(row) for row in rows]
    bits = bucket_bits(len(rows))
    print(f"{len(rows):,} rows of {len(COLUMNS)} columns; canonical bytes "
          f"{sum(map(len, canonical)) / len(rows):.0f} a row (msgpack "
          f"{sum(map(len, packed)) / len(rows):.0f}); {1 << bits:,} buckets")

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
        figures.append((f"{name} of the same bytes",
                        per_second(best(args.repeat, hash_all(factory, canonical)))))
    figures.append(("row_bytes (canonical bytes alone)", per_second(best(
        args.repeat, lambda: [digester.row_bytes(row) for row in rows]))))
    figures.append(("row_hash (canonical bytes + sha256)", per_second(best(
        args.repeat, lambda: [digester.row_hash(row) for row in rows]))))
    figures.append(("digest: key hash + row hash + add to its bucket", per_second(best(
        args.repeat, lambda: table_digest(rows, digester, bits)))))
    print(f"{'rows/s':>12}  {'x packb':>8}  {'x sha256':>8}  what")
    for name, rate in figures:
        print(f"{rate:>12,.0f}  {rate / baseline:>8.2f}  {rate / sha256:>8.2f}  {name}")

    fine = table_digest(rows, digester, MAX_BUCKET_BITS)
    other = table_digest(rows[1:], digester, MAX_BUCKET_BITS)
    buckets = 1 << MAX_BUCKET_BITS
    compare = best(args.repeat, lambda: fine.differing(other))
    fold = best(args.repeat, lambda: fine.folded(10))
    print(f"{buckets / compare:>12,.0f}  buckets/s compared (two digests of {buckets:,} buckets)")
    print(f"{buckets / fold:>12,.0f}  buckets/s folded ({buckets:,} into 1,024)")
    assert TableDigest(MAX_BUCKET_BITS) != fine
    with tempfile.TemporaryDirectory() as directory:
        mirror_side(Path(directory), rows, digester, args.repeat)


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


def mirror_side(directory: Path, rows: list[dict[str, Any]], digester: RowDigester,
                repeat: int) -> None:
    table_shape = shape()
    columns = {column.name: column for column in table_shape.columns}
    updated = [{**row, "qty": row["qty"] + 1, "name": row["name"] + "!"} for row in rows]

    def apply(path: Path, keep_digest: bool) -> tuple[float, float]:
        """(inserts/s, updates/s) applying ``rows`` then ``updated`` into a new file."""
        store = MirrorStore(path)
        try:
            store.begin_bootstrap(table_shape, "bench", 1)
            store.finish_bootstrap(TABLE, 0)
            digest = TableDigest(MAX_BUCKET_BITS)
            reader = sqlite3.connect(path)
            select = f'SELECT * FROM "{TABLE}" WHERE id = ?'
            rates = []
            for high, (operation, source) in enumerate((("INSERT", rows), ("UPDATE", updated)),
                                                       start=1):
                started = time.perf_counter()
                for seq, transaction in enumerate(events(source, operation, high), start=1):
                    if keep_digest:
                        for event in transaction:
                            data = event["data"]
                            if operation == "UPDATE":
                                stored = reader.execute(select, (data["id"],)).fetchone()
                                old = {name: wire_value(value, columns[name])
                                       for name, value in zip(COLUMNS, stored)}
                                digest.remove(digester.key_hash(old), digester.row_hash(old))
                            digest.add(digester.key_hash(data), digester.row_hash(data))
                    store.apply_transaction(transaction, seq)
                rates.append(len(source) / (time.perf_counter() - started))
            reader.close()
            return rates[0], rates[1]
        finally:
            store.close()

    plain = [apply(directory / f"plain-{n}.db", keep_digest=False) for n in range(repeat)]
    kept = [apply(directory / f"kept-{n}.db", keep_digest=True) for n in range(repeat)]
    for index, operation in enumerate(("INSERT", "UPDATE")):
        without = max(rates[index] for rates in plain)
        with_digest = max(rates[index] for rates in kept)
        print(f"{with_digest:>12,.0f}  {operation} events/s applied with the digest kept, "
              f"{with_digest / without:.2f} x {without:,.0f} without")

    path = directory / f"kept-{repeat - 1}.db"
    db = sqlite3.connect(path)
    query = f'SELECT * FROM "{TABLE}"'

    def scan() -> None:
        for _ in db.execute(query):
            pass

    def scan_digest() -> TableDigest:
        digest = TableDigest(bucket_bits(len(rows)))
        for stored in db.execute(query):
            row = {name: wire_value(value, columns[name])
                   for name, value in zip(COLUMNS, stored)}
            digest.add(digester.key_hash(row), digester.row_hash(row))
        return digest

    assert scan_digest() == table_digest(updated, digester, bucket_bits(len(rows)))
    baseline = len(rows) / best(repeat, scan)
    on_demand = len(rows) / best(repeat, scan_digest)
    print(f"{on_demand:>12,.0f}  rows/s: the mirror's digest from its SQLite rows, "
          f"{on_demand / baseline:.2f} x a plain SELECT * ({baseline:,.0f} rows/s)")
    db.close()


if __name__ == "__main__":
    main()
