"""The work of one verification task: read a block range under the exported snapshot, as a
snapshot task does (:mod:`cdc_platform.snapshot.reader`: same session, same ``COPY``, same
converters), and digest the rows instead of publishing them: :meth:`Chunker.digest_block`
hashes the COPY text straight into the digest where the compiled twin is built, else the
converted columns.
Before its COPY and between blocks it gives way to the bridge while that is behind
(:mod:`.yielding`).
A task returns its buckets' (total, count) pairs to the driver, never rows."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

from cdc_platform.errors import ConversionError, VerificationError
from cdc_platform.postgres.catalog import CatalogColumn
from cdc_platform.snapshot.chunks import Chunker, ChunkLayout
from cdc_platform.snapshot.plan import BlockRange
from cdc_platform.snapshot.reader import (
    RANGE_STOP,
    converters_for,
    copy_blocks,
    imported_snapshot,
)
from cdc_platform.snapshot.source import SourceTable, copy_select
from cdc_platform.verify.yielding import BridgeGate, YieldPolicy
from cdc_platform.wire.digest import HASH_BITS, RowDigester, TableDigest, pack_totals

_MASK = (1 << HASH_BITS) - 1
# COPY text a task digests at a time, at most and (unless the COPY has ended) at least:
# blocks 8x a snapshot's, as the compiled digest hashes them without the GIL (~10 % less
# CPU a row than 512 KiB blocks, measured: fewer waits for the socket and calls per row)
_BLOCK_BYTES = 4 * 1024**2
_MIN_BLOCK_BYTES = 512 * 1024


@dataclass(frozen=True, slots=True)
class DigestSpec:
    """What every task of one verification needs (travels to Spark executors with the tasks,
    secrets included, as a snapshot's TaskSpec does)."""

    conninfo: str = field(repr=False)
    snapshot_name: str
    select: str  # COPY (SELECT ... WHERE {range}) TO STDOUT, with {range} to fill in
    layout: ChunkLayout  # the rows' columns (the Chunker's conversion; nothing is chunked)
    columns: tuple[CatalogColumn, ...]
    type_rows: tuple[tuple[Any, ...], ...]
    key_columns: tuple[str, ...]  # the primary key; empty: every column
    bits: int  # the buckets each task digests into (the driver folds them)
    lock_timeout_ms: int = 5_000
    qualified_table: str = ""
    yield_policy: YieldPolicy | None = None  # None: the tasks never give way to the bridge

    @classmethod
    def of(cls, described: SourceTable, conninfo: str, snapshot_name: str, bits: int, *,
           verification_id: str = "", lock_timeout_ms: int = 5_000,
           yield_policy: YieldPolicy | None = None) -> DigestSpec:
        """The spec of ``described``'s tasks reading under ``snapshot_name`` (the
        verification id names the Spark job)."""
        schema = described.schema
        names = tuple(column.name for column in schema.columns)
        return cls(
            conninfo=conninfo, snapshot_name=snapshot_name, select=copy_select(schema),
            layout=ChunkLayout(table=schema.wire_name, snapshot_id=verification_id, lsn="",
                               schema_fingerprint=schema.fingerprint, columns=names,
                               key_columns=tuple(names.index(n) for n in schema.primary_key)),
            columns=schema.columns, type_rows=described.type_rows,
            key_columns=tuple(name for name in names if name in schema.primary_key),
            bits=bits, lock_timeout_ms=lock_timeout_ms,
            qualified_table=sql.Identifier(schema.schema, schema.table).as_string(None),
            yield_policy=yield_policy)

    def copy_command(self, block_range: BlockRange) -> str:
        return self.select.replace("{range}", block_range.predicate().as_string(None))


async def digest_range(spec: DigestSpec, block_range: BlockRange) -> dict[str, Any]:
    """One range's digest: ``{partition, rows, seconds, yielded (seconds given way to the
    bridge), error, error_kind, totals (packed as in a digest message), counts}``. A
    malformed COPY row is returned as ``error`` (a retry cannot fix it); anything else
    raises, and Spark retries the task. In this process, once the runner's ``RANGE_STOP``
    is set (the verification ended: cancelled, or another task failed), the task raises
    between blocks or in a pause (:class:`BridgeGate`)."""
    started = time.monotonic()
    chunker = Chunker(spec.layout, converters_for(spec.type_rows, spec.columns),
                      block_range.index)
    digester = RowDigester(spec.layout.columns, spec.key_columns)
    digest = TableDigest(spec.bits)
    gate = BridgeGate(spec.yield_policy, spec.conninfo, spec.qualified_table,
                      f"verification {spec.layout.snapshot_id} range {block_range.index}",
                      RANGE_STOP.get())
    rows = 0
    error = error_kind = None
    try:
        with imported_snapshot(spec.conninfo, spec.snapshot_name,
                               qualified_table=spec.qualified_table,
                               lock_timeout_ms=spec.lock_timeout_ms) as conn:
            await gate.give_way()  # before a first block: it may be megabytes
            async for block in copy_blocks(conn.pgconn, spec.copy_command(block_range),
                                           block_bytes=_BLOCK_BYTES,
                                           min_block_bytes=_MIN_BLOCK_BYTES):
                await gate.give_way()
                # hashed from the COPY text, no row maps; a value no converter takes stays
                # text, as in a snapshot chunk
                rows += chunker.digest_block(digest, digester, block, {})
    except ConversionError as exc:
        error, error_kind = str(exc), type(exc).__name__
    finally:
        await gate.close()
    return {"partition": block_range.index, "rows": rows,
            "seconds": time.monotonic() - started, "yielded": gate.yielded_seconds,
            "error": error, "error_kind": error_kind,
            "totals": pack_totals(digest.totals), "counts": digest.counts}


def digest_partition(spec: DigestSpec, ranges: Iterable[BlockRange]) -> Iterator[dict[str, Any]]:
    """``mapPartitions`` body: one result per range (one range per partition)."""
    for block_range in ranges:
        yield asyncio.run(digest_range(spec, block_range))


def summed_digest(results: Sequence[dict[str, Any]], bits: int, verification_id: str
                  ) -> tuple[TableDigest, int]:
    """The tasks' digests summed bucket by bucket (totals modulo 2^64), and the rows read;
    a task's error raised as the verification's."""
    failed = [result for result in results if result["error"]]
    if failed:
        kind = ConversionError if failed[0]["error_kind"] == "ConversionError" else (
            VerificationError)
        raise kind(f"verification {verification_id}: {failed[0]['error']}")
    digest = TableDigest(bits)
    size = 1 << bits
    for result in results:
        totals = struct.unpack(f">{size}Q", result["totals"])
        digest.totals = [(a + b) & _MASK for a, b in zip(digest.totals, totals, strict=True)]
        digest.counts = [a + b for a, b in zip(digest.counts, result["counts"], strict=True)]
    return digest, sum(result["rows"] for result in results)
