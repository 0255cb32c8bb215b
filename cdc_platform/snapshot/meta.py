"""A snapshot's meta message on ``init.meta.{table}`` (docs/wire-contract.md "Snapshots"), a
repair snapshot's on ``init.repair.{table}`` (docs/verification.md Part 2, item 4):
everything a consumer needs to load the chunks and to know exactly where the CDC stream takes over.
Built from the finished tasks' figures, published once every chunk is acknowledged; read back as a
consumer reads it (:func:`latest_meta`, :func:`cutover_start_seq`), by the mirror and by the
snapshot request sensor (which answers with a recent snapshot when it can)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, cast

from nats.js import JetStreamContext

from cdc_platform.errors import SnapshotError
from cdc_platform.postgres.catalog import TableSchema
from cdc_platform.settings import EncodingSettings
from cdc_platform.snapshot.buckets import BucketSelection
from cdc_platform.snapshot.chunks import headers_size
from cdc_platform.snapshot.reader import RangeStats
from cdc_platform.wire import (
    BUCKET_BITMAP_FIELD,
    CONTENT_ENCODING_ZSTD,
    CONTENT_TYPES,
    HEADER_CONTENT_TYPE,
    HEADER_MSG_ID,
    META_MAX_LISTED_BUCKETS,
    RepairMetaPayload,
    SnapshotMetaPayload,
    cutover_rule_text,
    encode_bucket_bitmap,
    encoder,
    in_field_order,
    meta_msg_id,
    repair_meta_subject,
    snapshot_chunk_prefix,
    snapshot_meta_subject,
    watermark_subject,
)
from cdc_platform.wire.encoding import Format
from cdc_platform.wire.signing import MessageSigner

log = logging.getLogger(__name__)


def snapshot_meta(*, snapshot_id: str, lsn: str, watermark_lsn: str, cdc_stream: str,
                  cdc_start_seq: int | None, schema: TableSchema, stats: Sequence[RangeStats],
                  partitions: int, encoding: EncodingSettings, dictionary_id: int | None,
                  dictionary_bucket: str | None, dictionary_key: str | None,
                  duration: float, timestamp: int | None = None,
                  buckets: BucketSelection | None = None) -> SnapshotMetaPayload:
    """The meta payload, in the contract's field order (a field the type does not name, or
    one it misses, fails here, not in a consumer); with ``buckets``, a repair snapshot's
    (a :class:`RepairMetaPayload`)."""
    wire_table = schema.wire_name
    chunk_prefix = snapshot_chunk_prefix(wire_table, snapshot_id)
    marker_subject = watermark_subject(snapshot_id)
    fields: dict[str, Any] = {
        "snapshot_id": snapshot_id, "lsn": lsn, "timestamp": int(time.time()) if timestamp is None else timestamp,
        "batch_count": sum(s.chunks for s in stats), "row_count": sum(s.rows for s in stats),
        "table": wire_table, "cdc_stream": cdc_stream, "cdc_start_seq": cdc_start_seq,
        "watermark_subject": marker_subject, "watermark_lsn": watermark_lsn,
        "cutover_rule": cutover_rule_text(chunk_subject_prefix=chunk_prefix,
                                          cdc_stream=cdc_stream,
                                          watermark_subject=marker_subject,
                                          table=wire_table, lsn=lsn),
        "format": encoding.format,
        "compression": CONTENT_ENCODING_ZSTD if encoding.zstd else None,
        "dictionary_id": dictionary_id,
        "dictionary_bucket": dictionary_bucket if dictionary_id is not None else None,
        "dictionary_key": dictionary_key,
        "schema_fingerprint": schema.fingerprint,
        # the shape of the rows, read under the lock the snapshot holds: a consumer creates
        # its table from it (the KV schema may already be newer)
        "table_schema": schema.to_wire(),
        "partitions": partitions,
        # [partition, first chunk number, chunk count] for every partition with chunks
        "chunks": [[s.partition, s.first_chunk, s.chunks] for s in stats if s.chunks],
        "bytes_raw": sum(s.bytes_raw for s in stats),
        "bytes_compressed": sum(s.bytes_compressed for s in stats),
        "duration_seconds": round(duration, 3),
        "chunk_subject_prefix": chunk_prefix,
    }
    if buckets is not None:
        fields["bits"] = buckets.bits
        if len(buckets.buckets) <= META_MAX_LISTED_BUCKETS:
            fields["buckets"] = list(buckets.buckets)
        else:  # a list would not fit max_payload (bucket_sets.META_MAX_LISTED_BUCKETS)
            fields[BUCKET_BITMAP_FIELD] = encode_bucket_bitmap(buckets.bits, buckets.buckets)
        return cast(RepairMetaPayload, in_field_order(RepairMetaPayload, fields))
    return cast(SnapshotMetaPayload, in_field_order(SnapshotMetaPayload, fields))


def meta_subject(meta: SnapshotMetaPayload) -> str:
    """Where ``meta`` goes: ``init.repair.{table}`` for a repair snapshot's (never
    ``init.meta.{table}``, whose last message every consumer takes for a full snapshot),
    else ``init.meta.{table}``."""
    if "bits" in meta:
        return repair_meta_subject(meta["table"])
    return snapshot_meta_subject(meta["table"])


async def publish_meta(js: JetStreamContext, meta: SnapshotMetaPayload, fmt: Format,
                       signer: MessageSigner | None = None, *, max_payload: int) -> int:
    """Store ``meta`` on its subject (:func:`meta_subject`; deduplicated by snapshot id),
    signed by ``signer`` when there is one; its sequence. :class:`SnapshotError` when it is
    over the server's ``max_payload`` (a repair's buckets: up to ~175 KB as a bitmap)."""
    subject, payload = meta_subject(meta), encoder(fmt)(meta)
    headers = {HEADER_MSG_ID: meta_msg_id(meta["snapshot_id"]),
               HEADER_CONTENT_TYPE: CONTENT_TYPES[fmt]}
    if signer is not None:
        headers = signer.signed_headers(subject, headers, payload)
    size = len(payload) + headers_size(headers)
    if size > max_payload:
        raise SnapshotError(
            f"the meta of snapshot {meta['snapshot_id']} of {meta['table']} is {size:,} "
            f"bytes, over the NATS server's max_payload ({max_payload:,}): its chunks are "
            "stored but no consumer will find them; raise max_payload (a repair: ask fewer "
            "bits)")
    ack = await js.publish(subject, payload, headers=headers)
    return ack.seq


