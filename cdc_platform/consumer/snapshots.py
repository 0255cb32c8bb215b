"""Snapshots, the consumer's side (docs/wire-contract.md "Snapshots", "The cutover rule"): the
newest meta of a table in `INIT` (:func:`latest_meta`), where `CDC` takes over from it
(:func:`cutover_start_seq`), whether a recent snapshot can serve a request
(:func:`reusable_snapshot`, :func:`snapshot_stored_since`), and the zstd dictionary a chunk names
(:func:`fetch_dictionary`, :func:`decompressor`). A repair snapshot (some buckets of a table,
docs/verification.md Part 2, item 4) has its meta on `init.repair.{table}`
(:func:`latest_repair_meta`, :func:`repair_meta_at`), read with the same checks; whether it can
repair a table is :func:`repair_refusal`. Used by the mirror and by the snapshot request
sensor, which reads snapshots as any consumer does; taking and publishing them is
``cdc_platform.snapshot``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import zstandard
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg
from nats.js.errors import KeyNotFoundError, NotFoundError

from cdc_platform.errors import CdcError
from cdc_platform.jetstream.kv import kv_value
from cdc_platform.lsn import parse_lsn
from cdc_platform.settings import DictionaryBucketSettings
from cdc_platform.wire import (
    BUCKET_BITMAP_FIELD,
    INIT_REPAIR_PREFIX,
    SignatureVerifier,
    decode_any,
    decode_bucket_bitmap,
    dictionary_key,
    repair_meta_subject,
    snapshot_meta_subject,
)
from cdc_platform.wire.digest import MAX_HELD_BITS

log = logging.getLogger(__name__)

DICTIONARY_BUCKET: str = DictionaryBucketSettings.model_fields["bucket"].default


class SnapshotUnusable(CdcError):
    """The snapshot cannot bootstrap a mirror (incomplete, aged out of `INIT`, or its cutover
    point is no longer in `CDC`)."""


class MarkerNotInCdcYet(SnapshotUnusable):
    """The snapshot's watermark marker is not in `CDC` yet: the bridge is behind (or not
    running), and the cutover point appears once it publishes the marker."""


class NoMetaThere(CdcError):
    """A ``done`` reply names no readable meta (not the platform's reply, or the meta is
    gone)."""


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
    # a repair snapshot's buckets (its rows are those whose key hash falls in them); None:
    # a full snapshot
    bits: int | None = None
    buckets: tuple[int, ...] | None = None

    @property
    def table_schema(self) -> dict[str, Any] | None:
        """The rows' shape (a KV ``schemas`` value), in metas written since it was added."""
        return self.raw.get("table_schema")

    @property
    def is_repair(self) -> bool:
        return self.buckets is not None

    @property
    def subject(self) -> str:
        """Where a meta of its kind is stored: ``init.repair.{table}`` or
        ``init.meta.{table}``."""
        return (repair_meta_subject if self.is_repair else snapshot_meta_subject)(self.table)

    def covers(self, bits: int, buckets: Iterable[int]) -> bool:
        """Whether a repair snapshot holds every row of ``buckets`` at ``bits`` (it may have
        been taken at finer or coarser bits, for several requests at once)."""
        if self.bits is None or self.buckets is None:
            return True  # a full snapshot holds every row
        mine = set(self.buckets)
        for bucket in buckets:
            if bits >= self.bits:
                if bucket >> (bits - self.bits) not in mine:
                    return False
            elif not mine.issuperset(range(bucket << (self.bits - bits),
                                           (bucket + 1) << (self.bits - bits))):
                return False
        return True

    @classmethod
    def from_wire(cls, meta: dict[str, Any], seq: int = 0) -> SnapshotMeta:
        try:
            bits, buckets = _repair_buckets(meta)
            return cls(
                table=meta["table"], snapshot_id=meta["snapshot_id"],
                lsn=parse_lsn(meta["lsn"]), batch_count=int(meta["batch_count"]),
                row_count=int(meta["row_count"]), cdc_stream=meta["cdc_stream"],
                cdc_start_seq=meta.get("cdc_start_seq"),
                watermark_subject=meta["watermark_subject"],
                chunk_subject_prefix=meta["chunk_subject_prefix"],
                schema_fingerprint=meta["schema_fingerprint"], format=meta["format"],
                timestamp=float(meta["timestamp"]), raw=meta, seq=seq, bits=bits,
                buckets=buckets)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotUnusable(f"malformed snapshot meta ({exc!r})") from exc


def _repair_buckets(meta: Mapping[str, Any]) -> tuple[int | None, tuple[int, ...] | None]:
    """A repair meta's ``bits`` and buckets (``buckets``, or ``bucket_bitmap`` past
    ``META_MAX_LISTED_BUCKETS``; all absent: a full snapshot's meta); ValueError when they are
    not buckets at ``bits``."""
    if not {"bits", "buckets", BUCKET_BITMAP_FIELD} & meta.keys():
        return None, None
    bits = meta["bits"]
    if type(bits) is not int or not 0 <= bits <= MAX_HELD_BITS:
        raise ValueError(f"bits {bits!r}")
    if ("buckets" in meta) == (BUCKET_BITMAP_FIELD in meta):
        raise ValueError(f"a repair meta has buckets or {BUCKET_BITMAP_FIELD}, one of them")
    if BUCKET_BITMAP_FIELD in meta:
        return bits, decode_bucket_bitmap(bits, meta[BUCKET_BITMAP_FIELD])
    buckets = meta["buckets"]
    if (not isinstance(buckets, list) or not buckets
            or any(type(b) is not int or not 0 <= b < 1 << bits for b in buckets)
            or buckets != sorted(set(buckets))):
        raise ValueError(f"buckets must be sorted distinct numbers below 2^{bits}")
    return bits, tuple(buckets)


async def latest_meta(js: JetStreamContext, table: str, stream: str = "INIT",
                      verifier: SignatureVerifier | None = None) -> SnapshotMeta | None:
    """The newest meta of ``table`` still in the `INIT` stream, or None (also when
    ``verifier`` refuses it: not the platform's)."""
    try:
        message = await js.get_last_msg(stream, snapshot_meta_subject(table))
    except NotFoundError:
        return None
    return _verified_meta(message, stream, verifier)


async def meta_at(js: JetStreamContext, stream: str, done: Mapping[str, Any],
                  verifier: SignatureVerifier | None = None) -> SnapshotMeta | None:
    """The full snapshot's meta a ``done`` reply names (``meta_seq`` in ``stream``, the
    `INIT` stream); None when ``verifier`` refuses it (logged); :class:`NoMetaThere` when
    the reply names none; :class:`SnapshotUnusable` when it names a repair snapshot's
    (loading its buckets as the whole table would lose every other row)."""
    meta = await _meta_named(js, stream, done, verifier)
    if meta is not None and meta.is_repair:
        raise SnapshotUnusable(f"the snapshot reply names the meta of repair snapshot "
                               f"{meta.snapshot_id} of {meta.table}, not a full snapshot's")
    return meta


async def repair_meta_at(js: JetStreamContext, stream: str, done: Mapping[str, Any],
                         verifier: SignatureVerifier | None = None) -> SnapshotMeta | None:
    """The repair snapshot's meta a ``done`` reply to a ``purpose: repair`` request names
    (``meta_seq``; ``meta_subject`` is ``init.repair.{table}``), checked as :func:`meta_at`
    checks a full one's; :class:`SnapshotUnusable` when it names a full snapshot's meta."""
    meta = await _meta_named(js, stream, done, verifier)
    if meta is not None and not meta.is_repair:
        raise SnapshotUnusable(f"the repair reply names the meta of snapshot "
                               f"{meta.snapshot_id} of {meta.table}, not a repair snapshot's")
    return meta


async def latest_repair_meta(js: JetStreamContext, table: str, stream: str = "INIT",
                             verifier: SignatureVerifier | None = None) -> SnapshotMeta | None:
    """The newest repair snapshot's meta of ``table`` (``init.repair.{table}``), or None
    (also when ``verifier`` refuses it)."""
    try:
        message = await js.get_last_msg(stream, repair_meta_subject(table))
    except NotFoundError:
        return None
    return _verified_meta(message, stream, verifier)


async def _meta_named(js: JetStreamContext, stream: str, done: Mapping[str, Any],
                      verifier: SignatureVerifier | None) -> SnapshotMeta | None:
    try:
        return _verified_meta(await js.get_msg(stream, seq=int(done["meta_seq"])), stream,
                              verifier)
    except (KeyError, TypeError, ValueError, NotFoundError) as exc:
        raise NoMetaThere(f"the snapshot reply names no readable meta ({exc!r})") from exc


def _verified_meta(message: RawStreamMsg, stream: str,
                   verifier: SignatureVerifier | None) -> SnapshotMeta | None:
    """The meta ``message`` holds; None when ``verifier`` refuses it (logged)."""
    refusal = verifier.refusal(message.subject or "", message.headers or {},
                               message.data or b"") if verifier is not None else None
    if refusal is not None:
        log.error("refused the snapshot meta at %s of %s: %s", message.seq, stream, refusal)
        return None
    meta = SnapshotMeta.from_wire(decode_any(message.data or b""), message.seq or 0)
    # a repair meta (some buckets) is one only where repair metas are, and a meta there is
    # never taken for a full snapshot's
    if (message.subject or "").startswith(f"{INIT_REPAIR_PREFIX}.") != meta.is_repair \
            or message.subject != meta.subject:
        raise SnapshotUnusable(f"the meta of snapshot {meta.snapshot_id} at {message.seq} of "
                               f"{stream} is on {message.subject}, not {meta.subject}")
    return meta


def repair_refusal(meta: SnapshotMeta, table: str, schema_fingerprint: str, bits: int,
                   buckets: Iterable[int]) -> str | None:
    """Why the repair snapshot ``meta`` cannot replace the rows of ``buckets`` (at ``bits``)
    of ``table`` as a consumer holds it (``schema_fingerprint``: the shape of its rows), or
    None when it can. Its rows are loaded as a full snapshot's are (:func:`repair_meta_at`,
    then the chunks, signatures checked alike) and follow the same cutover rule."""
    if not meta.is_repair:
        return f"snapshot {meta.snapshot_id} is not a repair snapshot"
    if meta.table != table:
        return f"repair snapshot {meta.snapshot_id} is of {meta.table}, not {table}"
    if meta.schema_fingerprint != schema_fingerprint:
        return (f"repair snapshot {meta.snapshot_id} of {table} has rows of schema "
                f"{meta.schema_fingerprint}, the table holds {schema_fingerprint}")
    if not meta.covers(bits, buckets):
        held = meta.buckets or ()
        # (it may hold thousands: the line names a few)
        named = f"buckets {list(held)}" if len(held) <= 8 else f"{len(held):,} buckets"
        return (f"repair snapshot {meta.snapshot_id} of {table} holds {named} at "
                f"{meta.bits} bits, not every one asked for at {bits} bits")
    return None


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


async def reusable_snapshot(js: JetStreamContext, table: str, max_age_seconds: float,
                            init_stream: str = "INIT", min_lsn: int = 0, *,
                            relation_id: int | None,
                            verifier: SignatureVerifier | None = None) -> dict[str, Any] | None:
    """The ``done`` fields of the newest snapshot of ``table`` at most ``max_age_seconds``
    old, with a cutover LSN of at least ``min_lsn``, of the table whose oid is
    ``relation_id`` (not one dropped since and created again under its name), whose cutover
    point the CDC stream still holds (None: a new one is needed). So a hundred mirrors
    asking for one table within minutes share one snapshot (and after a rewrite, one taken
    after it). ``relation_id`` None: the table is not known to exist, nothing is reused.
    A meta ``verifier`` refuses is none."""
    if max_age_seconds <= 0 or relation_id is None:
        return None
    meta = await latest_meta(js, table, init_stream, verifier)
    if (meta is None or time.time() - meta.timestamp > max_age_seconds
            or meta.lsn < min_lsn or snapshot_relation_id(meta) != relation_id):
        return None
    return await _done_if_usable(js, table, meta, reused=True, verifier=verifier)


async def snapshot_stored_since(js: JetStreamContext, table: str, asked_after_seq: int,
                                init_stream: str = "INIT", min_lsn: int = 0, *,
                                relation_id: int | None = None,
                                verifier: SignatureVerifier | None = None
                                ) -> dict[str, Any] | None:
    """The ``done`` fields of the newest meta of ``table`` if it was stored after the
    request was made (its `INIT` sequence above ``asked_after_seq``, the stream's last
    sequence read before the request was published), with a cutover LSN of at least
    ``min_lsn`` and a cutover point the CDC stream still holds: the snapshot a requester that
    gets no ``done`` (answered ``coalesced``, or asking without ``reply_to``) waits for
    (docs/wire-contract.md "Snapshot requests"). With ``relation_id``, only a snapshot of that table
    (not of one dropped since and created again under its name). A meta ``verifier`` refuses is
    none."""
    meta = await latest_meta(js, table, init_stream, verifier)
    if meta is None or meta.seq <= asked_after_seq or meta.lsn < min_lsn:
        return None
    if relation_id is not None and snapshot_relation_id(meta) != relation_id:
        return None
    return await _done_if_usable(js, table, meta, reused=False, verifier=verifier)


async def _done_if_usable(js: JetStreamContext, table: str, meta: SnapshotMeta, *,
                          reused: bool, verifier: SignatureVerifier | None = None
                          ) -> dict[str, Any] | None:
    try:
        start_seq = await cutover_start_seq(js, meta, verifier)
    except SnapshotUnusable:
        return None
    return {"snapshot_id": meta.snapshot_id, "lsn": meta.raw["lsn"],
            "cdc_stream": meta.cdc_stream, "cdc_start_seq": start_seq,
            "meta_subject": meta.subject, "meta_seq": meta.seq, "reused": reused}


async def repair_stored_since(js: JetStreamContext, table: str, asked_after_seq: int,
                              bits: int, buckets: Iterable[int], init_stream: str = "INIT", *,
                              verifier: SignatureVerifier | None = None
                              ) -> dict[str, Any] | None:
    """The ``done`` fields of the newest repair snapshot of ``table`` if it was stored after
    the request was made (its `INIT` sequence above ``asked_after_seq``), holds every row of
    ``buckets`` at ``bits``, and has a cutover point the CDC stream still holds: what a
    repair requester whose ``done`` got lost finds instead."""
    meta = await latest_repair_meta(js, table, init_stream, verifier)
    if meta is None or meta.seq <= asked_after_seq or not meta.covers(bits, buckets):
        return None
    return await _done_if_usable(js, table, meta, reused=False, verifier=verifier)


def snapshot_relation_id(meta: SnapshotMeta) -> int | None:
    """The oid of the table a snapshot was taken of (None: a meta without ``table_schema``)."""
    relation_id = (meta.table_schema or {}).get("relation_id")
    return relation_id if type(relation_id) is int else None


async def fetch_dictionary(js: JetStreamContext, table: str, dictionary_id: int, *,
                           bucket: str = DICTIONARY_BUCKET,
                           verifier: SignatureVerifier | None = None) -> bytes:
    """For consumers and tests: the dictionary a chunk names (KeyNotFoundError also when
    ``verifier`` refuses it: its bytes decide what a chunk decompresses to)."""
    key = dictionary_key(table, dictionary_id)
    value = await kv_value(js, bucket, key, verifier)
    if value is None:
        raise KeyNotFoundError(message=f"no dictionary {key}" + (
            " signed by a trusted key" if verifier is not None else ""))
    return value


def decompressor(dictionary: bytes | None) -> zstandard.ZstdDecompressor:
    if dictionary is None:
        return zstandard.ZstdDecompressor()
    return zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(dictionary))

