"""A snapshot's meta message on ``init.meta.{table}`` (README "Snapshots"): everything a
consumer needs to load the chunks and to know exactly where the CDC stream takes over. Built
from the finished tasks' figures, published once every chunk is acknowledged; read back as a
consumer reads it (:func:`latest_meta`, :func:`cutover_start_seq`), by the mirror and by the
snapshot request sensor (which answers with a recent snapshot when it can)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from cdc_platform.errors import CdcError
from cdc_platform.lsn import parse_lsn
from cdc_platform.postgres.catalog import TableSchema
from cdc_platform.settings import EncodingSettings
from cdc_platform.snapshot.reader import RangeStats
from cdc_platform.wire import (
    CONTENT_ENCODING_ZSTD,
    CONTENT_TYPES,
    HEADER_CONTENT_TYPE,
    HEADER_MSG_ID,
    SnapshotMetaPayload,
    cutover_rule_text,
    decode_any,
    encoder,
    in_field_order,
    meta_msg_id,
    snapshot_chunk_prefix,
    snapshot_meta_subject,
    watermark_subject,
)
from cdc_platform.wire.encoding import Format
from cdc_platform.wire.signing import MessageSigner, SignatureVerifier

log = logging.getLogger(__name__)


def snapshot_meta(*, snapshot_id: str, lsn: str, watermark_lsn: str, cdc_stream: str,
                  cdc_start_seq: int | None, schema: TableSchema, stats: Sequence[RangeStats],
                  partitions: int, encoding: EncodingSettings, dictionary_id: int | None,
                  dictionary_bucket: str | None, dictionary_key: str | None,
                  duration: float, timestamp: int | None = None) -> SnapshotMetaPayload:
    """The meta payload, in the contract's field order (a field the type does not name, or
    one it misses, fails here, not in a consumer)."""
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
    return cast(SnapshotMetaPayload, in_field_order(SnapshotMetaPayload, fields))


async def publish_meta(js: JetStreamContext, meta: SnapshotMetaPayload, fmt: Format,
                       signer: MessageSigner | None = None) -> int:
    """Store ``meta`` on ``init.meta.{table}`` (deduplicated by snapshot id), signed by
    ``signer`` when there is one; its sequence."""
    subject, payload = snapshot_meta_subject(meta["table"]), encoder(fmt)(meta)
    headers = {HEADER_MSG_ID: meta_msg_id(meta["snapshot_id"]),
               HEADER_CONTENT_TYPE: CONTENT_TYPES[fmt]}
    if signer is not None:
        headers = signer.signed_headers(subject, headers, payload)
    ack = await js.publish(subject, payload, headers=headers)
    return ack.seq


# -- read back, as a consumer ------------------------------------------------------------------
class SnapshotUnusable(CdcError):
    """The snapshot cannot bootstrap a mirror (incomplete, aged out of `INIT`, or its cutover
    point is no longer in `CDC`)."""


class MarkerNotInCdcYet(SnapshotUnusable):
    """The snapshot's watermark marker is not in `CDC` yet: the bridge is behind (or not
    running), and the cutover point appears once it publishes the marker."""


@dataclass(frozen=True)
class SnapshotMeta:
    """The fields of a meta message a consumer acts on (the rest stays in ``raw``)."""

    table: str
    snapshot_id: str
    lsn: int
    batch_count: int
    row_count: int
    cdc_stream: str
    cdc_start_seq: int | None
    watermark_subject: str
    chunk_subject_prefix: str
    schema_fingerprint: str
    format: str
    timestamp: float
    raw: dict[str, Any]
    seq: int = 0  # its sequence in the INIT stream

    @property
    def table_schema(self) -> dict[str, Any] | None:
        """The rows' shape (a KV ``schemas`` value), in metas written since it was added."""
        return self.raw.get("table_schema")

    @classmethod
    def from_wire(cls, meta: dict[str, Any], seq: int = 0) -> SnapshotMeta:
        try:
            return cls(
                table=meta["table"], snapshot_id=meta["snapshot_id"],
                lsn=parse_lsn(meta["lsn"]), batch_count=int(meta["batch_count"]),
                row_count=int(meta["row_count"]), cdc_stream=meta["cdc_stream"],
                cdc_start_seq=meta.get("cdc_start_seq"),
                watermark_subject=meta["watermark_subject"],
                chunk_subject_prefix=meta["chunk_subject_prefix"],
                schema_fingerprint=meta["schema_fingerprint"], format=meta["format"],
                timestamp=float(meta["timestamp"]), raw=meta, seq=seq)
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotUnusable(f"malformed snapshot meta ({exc!r})") from exc


async def latest_meta(js: JetStreamContext, table: str, stream: str = "INIT",
                      verifier: SignatureVerifier | None = None) -> SnapshotMeta | None:
    """The newest meta of ``table`` still in the `INIT` stream, or None (also when
    ``verifier`` refuses it: not the platform's)."""
    try:
        message = await js.get_last_msg(stream, snapshot_meta_subject(table))
    except NotFoundError:
        return None
    refusal = verifier.refusal(message.subject or "", message.headers or {},
                               message.data or b"") if verifier is not None else None
    if refusal is not None:
        log.error("refused the snapshot meta at %s of %s: %s", message.seq, stream, refusal)
        return None
    return SnapshotMeta.from_wire(decode_any(message.data or b""), message.seq or 0)


async def cutover_start_seq(js: JetStreamContext, meta: SnapshotMeta,
                            verifier: SignatureVerifier | None = None) -> int:
    """The `CDC` stream sequence to read from (the cutover rule, step 2), checked to be still
    held by the stream; :class:`SnapshotUnusable` when retention dropped it. A marker
    ``verifier`` refuses is not the bridge's: the stream's first message is then the start
    (any earlier sequence is correct, a later one would lose changes)."""
    start = meta.cdc_start_seq
    info = None
    if start is None:
        try:
            marker = await js.get_last_msg(meta.cdc_stream, meta.watermark_subject)
        except NotFoundError:
            raise MarkerNotInCdcYet(
                f"snapshot {meta.snapshot_id} of {meta.table}: its watermark marker "
                f"{meta.watermark_subject} is not in {meta.cdc_stream}") from None
        start = marker.seq or 0  # (always set; from the start would also be correct)
        refusal = verifier.refusal(marker.subject or "", marker.headers or {},
                                   marker.data or b"") if verifier is not None else None
        if refusal is not None:
            info = await js.stream_info(meta.cdc_stream)
            log.error("refused the watermark marker at %s of %s: %s; reading from the "
                      "stream's first message", start, meta.cdc_stream, refusal)
            start = info.state.first_seq
    info = info or await js.stream_info(meta.cdc_stream)
    if start < info.state.first_seq:
        raise SnapshotUnusable(
            f"snapshot {meta.snapshot_id} of {meta.table}: its cutover point (sequence "
            f"{start}) is older than the first message {meta.cdc_stream} still holds "
            f"({info.state.first_seq}); a newer snapshot is needed")
    return start
