"""Reading an INIT snapshot as a consumer: its chunks decoded (zstd with the table's
dictionary) in chunk order. Its meta, and whether its cutover point is still in `CDC`, are
read by ``snapshot/meta.py``.

Only the wire contract is used (docs/wire-contract.md "Snapshots" and "The cutover rule"), as a
consumer in another language would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zstandard
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError

from cdc_platform.consumer.claim_checks import UnresolvableClaimCheck, resolve_payload
from cdc_platform.consumer.snapshots import (
    SnapshotMeta,
    SnapshotUnusable,
    decompressor,
    fetch_dictionary,
)
from cdc_platform.errors import PublishError
from cdc_platform.mirror.store import ChunkLoad
from cdc_platform.speedups import compiled_twin
from cdc_platform.wire import SignatureVerifier, decode_any

log = logging.getLogger(__name__)

# A chunk is up to max_payload bytes: fetch a few at a time (the client's pending limits).
_FETCH_BATCH = 16


# A chunk message's content that cannot be used: a claim check naming no (whole) object, a
# dictionary not in KV, a payload that does not decompress or decode to a chunk.
_UNUSABLE_CHUNK = (UnresolvableClaimCheck, PublishError, KeyNotFoundError, zstandard.ZstdError,
                   KeyError, ValueError, TypeError)



def chunk_tuples(data: bytes, columns: tuple[str, ...]
                 ) -> tuple[dict[str, Any], list[tuple[Any, ...]], bool]:
    """A msgpack chunk -> (its fields but ``data``, its rows as tuples in ``columns`` order,
    whether a row value is a float NaN); KeyError or ValueError: what :func:`decode_chunk`'s
    pure path must decode. The pure code leaves every chunk to it; the compiled twin reads
    the row maps straight into tuples."""
    raise ValueError("the pure code reads chunks as row maps")


@dataclass
class ChunkRows:
    """One chunk's rows: tuples in the order of the ``columns`` asked for (``as_tuples``), or
    row maps (JSON chunks, rows of other columns, or no compiled decoder)."""

    number: int
    rows: list[Any]
    as_tuples: bool = False
    has_nan: bool = False  # (tuples) a float NaN among the values: convert before SQLite
    loaded: int | None = None  # rows already in SQLite (``load`` took the chunk; ``rows`` empty)


def decode_chunk(data: bytes, columns: tuple[str, ...] | None = None) -> ChunkRows:
    """A chunk payload (decompressed) -> its rows. The pure path decodes the row maps; with
    ``columns``, the compiled twin reads msgpack rows straight into tuples."""
    if columns:
        try:
            fields, rows, has_nan = chunk_tuples(data, columns)
            return ChunkRows(fields["chunk"], rows, as_tuples=True, has_nan=has_nan)
        except (KeyError, ValueError, TypeError):
            pass  # not what the compiled decoder takes: the pure path decides
    chunk = decode_any(data)
    return ChunkRows(chunk["chunk"], chunk["data"])


Progress = Callable[[int, int], None]  # (rows so far, chunks so far)


async def read_chunks(js: JetStreamContext, meta: SnapshotMeta, *, stream: str = "INIT",
                      dictionary_bucket: str | None = None, progress: Progress | None = None,
                      columns: tuple[str, ...] | None = None,
                      load: ChunkLoad | None = None,
                      verifier: SignatureVerifier | None = None,
                      received: Callable[[int], None] | None = None
                      ) -> AsyncIterator[ChunkRows]:
    """Each chunk's rows (as tuples in ``columns`` order where it can: see
    :func:`decode_chunk`), every chunk exactly once; :class:`SnapshotUnusable` when the
    stream no longer holds all ``batch_count`` chunks, a chunk message cannot be read, or
    the rows do not add up to the meta's ``row_count``. With ``load``, a chunk it takes is
    written by it and comes with ``loaded`` set instead of its rows. A chunk ``verifier``
    refuses is not the platform's: said, and read past. ``received``: told the size of
    each chunk message read (the bytes a bootstrap or a repair moves)."""
    bucket = dictionary_bucket or meta.raw.get("dictionary_bucket") or "zstd_dictionaries"
    decompressors: dict[str | None, zstandard.ZstdDecompressor] = {}
    subscription = await js.pull_subscribe(
        f"{meta.chunk_subject_prefix}>", stream=stream,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL,
                              inactive_threshold=60.0))
    seen: set[int] = set()
    rows = 0
    try:
        info = await subscription.consumer_info()
        if (info.num_pending or 0) < meta.batch_count:
            raise SnapshotUnusable(
                f"snapshot {meta.snapshot_id} of {meta.table}: {stream} holds "
                f"{info.num_pending} of its {meta.batch_count} chunks")
        while len(seen) < meta.batch_count:
            for message in await subscription.fetch(_FETCH_BATCH, timeout=10.0):
                if received is not None:
                    received(len(message.data))
                headers = message.headers or {}
                if verifier is not None:
                    refusal = verifier.refusal(message.subject, headers, message.data)
                    if refusal is not None:
                        log.error("refused chunk message %s on %s: %s",
                                  message.metadata.sequence.stream, message.subject, refusal)
                        continue
                try:
                    # a one-row chunk over max_payload is a claim check; its headers describe
                    # the object (docs/wire-contract.md "Large values")
                    data = await resolve_payload(js, message.data, headers)
                    if headers.get("Content-Encoding") == "zstd":
                        dict_id = headers.get("Cdc-Zstd-Dict")
                        if dict_id not in decompressors:
                            decompressors[dict_id] = decompressor(
                                None if dict_id is None
                                else await fetch_dictionary(js, meta.table, int(dict_id),
                                                            bucket=bucket, verifier=verifier))
                        data = decompressors[dict_id].decompress(data)
                    taken = load(data, seen) if load is not None else None
                    if taken is not None:
                        chunk = ChunkRows(taken[0], [], loaded=taken[1])
                    else:
                        chunk = decode_chunk(data, columns)
                    if chunk.number in seen:  # a retried task's chunk stored twice past
                        continue              # the dedupe window (``load`` leaves those)
                    seen.add(chunk.number)
                    rows += len(chunk.rows) if chunk.loaded is None else chunk.loaded
                except _UNUSABLE_CHUNK as exc:
                    # what the snapshot holds, not NATS being away: no reading of it helps
                    raise SnapshotUnusable(
                        f"snapshot {meta.snapshot_id} of {meta.table}: chunk message "
                        f"{message.metadata.sequence.stream} in {stream} cannot be read "
                        f"({type(exc).__name__}: {exc})") from exc
                yield chunk
                if progress is not None:
                    progress(rows, len(seen))
    finally:
        await subscription.unsubscribe()
    if rows != meta.row_count:
        raise SnapshotUnusable(f"snapshot {meta.snapshot_id} of {meta.table}: read {rows} rows, "
                               f"the meta says {meta.row_count}")


@dataclass
class BootstrapProgress:
    """Rows, chunks, rate and ETA of one bootstrap, for the progress line."""

    table: str
    total_rows: int
    total_chunks: int
    started: float
    rows: int = 0
    chunks: int = 0

    def update(self, rows: int, chunks: int) -> None:
        self.rows, self.chunks = rows, chunks

    @property
    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.rows / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        rate = self.rate
        eta = (self.total_rows - self.rows) / rate if rate > 0 else float("inf")
        eta_text = f"{eta:.0f}s" if eta != float("inf") else "?"
        return (f"bootstrap {self.table}: {self.rows}/{self.total_rows} rows, "
                f"{self.chunks}/{self.total_chunks} chunks, {rate:,.0f} rows/s, ETA {eta_text}")


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.mirror import snapshots as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    chunk_tuples = _twin.chunk_tuples
