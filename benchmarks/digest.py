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

No servers: the digest is pure computation. A source's digest throughput against ``psql
COPY`` and a mirror's upkeep against its apply rate need the verification run and the mirror
(issue 25 item 7; docs/verification.md, "Benchmarks").
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cdc_platform.wire.digest import (
    MAX_BUCKET_BITS,
    RowDigester,
    TableDigest,
    bucket_bits,
    table_digest,
)

COLUMNS = ("id", "name", "qty", "price", "created", "ratio", "active", "token", "tags")


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


if __name__ == "__main__":
    main()
