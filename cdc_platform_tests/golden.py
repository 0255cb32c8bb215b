"""Golden payloads: the exact messages the platform writes for fixed inputs, one file per case
and format in ``data/golden/`` (msgpack as hex, JSON as text). ``test_golden.py`` checks that
both writers (pure Python and the compiled twins) still produce exactly these bytes.

``bucket_bitmaps.json`` holds ``bucket_bitmap`` vectors (``wire.bucket_sets``).

``signatures.json`` holds test vectors of message signatures (docs/wire-contract.md
"Signatures"): a fixed key's signatures of golden messages, with the exact bytes signed.

Write them again only on purpose (a wire change, in the CHANGELOG):

    .venv/bin/python -m cdc_platform_tests.golden
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cdc_platform.bridge.events import BuiltBatch, MessageBuilder
from cdc_platform.postgres.catalog import CatalogColumn, TableSchema
from cdc_platform.protocol import values
from cdc_platform.protocol.changes import (
    ChangeRecord,
    LogicalMessageReceived,
    RelationChanged,
    TransactionCommitted,
)
from cdc_platform.protocol.pgoutput import Relation, RelationColumn
from cdc_platform.settings import EncodingSettings
from cdc_platform.snapshot.buckets import BucketSelection
from cdc_platform.snapshot.chunks import Chunker, ChunkLayout
from cdc_platform.snapshot.meta import snapshot_meta
from cdc_platform.snapshot.reader import RangeStats
from cdc_platform.speedups import compiled_twin
from cdc_platform.verify.message import digest_message, digest_payload
from cdc_platform.wire import (
    CONTENT_TYPES,
    HEADER_CONTENT_TYPE,
    HEADER_MSG_ID,
    HEADER_SIGNATURE,
    HEADER_SIGNING_KEY,
    META_MAX_LISTED_BUCKETS,
    WATERMARK_PREFIX,
    WATERMARK_SUBJECT_PREFIX,
    MessageSigner,
    encode_bucket_bitmap,
    encoder,
    meta_msg_id,
    repair_meta_subject,
    signed_bytes,
    snapshot_meta_subject,
)
from cdc_platform.wire.digest import RowDigester, table_digest
from cdc_platform.wire.signing import new_seed, public_key_bytes

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
FORMATS = ("msgpack", "json")
IMPLEMENTATIONS = ("python", "compiled")

Message = dict[str, Any]  # subject, msg_id, headers, payload (bytes)

_COMMIT_TS = "2026-11-22T10:00:00.123456Z"
_COLUMNS = (("id", 23, True), ("name", 25, False), ("score", 701, False),
            ("blob", 17, False), ("tags", 1007, False), ("doc", 3802, False))


def table_schema() -> TableSchema:
    """The KV schema of the golden table ``public.users``."""
    return TableSchema(
        schema="public", table="users", relation_id=16400, replica_identity="d",
        columns=tuple(
            CatalogColumn(name=name, position=index + 1, data_type=values_type,
                          is_nullable=not key, column_default="7" if name == "score" else None,
                          type_oid=oid, type_modifier=-1, is_key=key, is_primary_key=key,
                          missing_value=7.0 if name == "score" else None, attnum=index + 1,
                          is_array=values.TypeRegistry().is_array(oid))
            for index, ((name, oid, key), values_type) in enumerate(zip(
                _COLUMNS, ["integer", "text", "double precision", "bytea", "integer[]",
                           "jsonb"], strict=True))),
        captured_at=1795000000.0, storage=16401)


def _relation() -> Relation:
    return Relation(16400, "public", "users", "d",
                    tuple(RelationColumn(name, oid, -1, key) for name, oid, key in _COLUMNS))


def _change(operation: str, ordinal: int, commit_lsn: int, **fields: Any) -> ChangeRecord:
    record = {"new": None, "old": None, "old_kind": None, "unchanged_toast": (), **fields}
    return ChangeRecord(table="users", schema="public", operation=operation,
                        relation_id=16400, lsn=commit_lsn - 0x100 + ordinal * 0x10,
                        commit_lsn=commit_lsn, xid=771, commit_ts=_COMMIT_TS, ordinal=ordinal,
                        **record)


def _transactions() -> list:
    """Two transactions: insert, update with a key change and an unchanged TOAST value,
    delete; then a truncate. A watermark message in between."""
    first, second = 0x1_0000_0900, 0x1_0000_0A00
    row = {"id": 1, "name": "Zoë \"q\"", "score": -0.0, "blob": b"\x00\xff",
           "tags": [1, None, 3], "doc": '{"a": [1, 2.5, "x"], "b": null}'}
    return [
        RelationChanged(_relation(), None),
        _change("INSERT", 0, first, new=row),
        _change("INSERT", 1, first, new={**row, "id": 2, "score": float("nan"),
                                          "doc": "18446744073709551617"}),
        _change("UPDATE", 2, first, new={"id": 3, "name": "x", "score": float("inf"),
                                         "blob": None, "tags": []},
                old={"id": 1}, old_kind="K", unchanged_toast=("doc",)),
        _change("DELETE", 3, first, old={"id": 2}, old_kind="K"),
        TransactionCommitted(first, first + 0x30, _COMMIT_TS, 771, 4),
        LogicalMessageReceived(lsn=0x1_0000_0980, prefix=WATERMARK_PREFIX,
                               content=b'{"snapshot_id": "20261122T100000Z-0a0b0c0d", '
                                       b'"table": "users"}',
                               transactional=True, commit_lsn=0x1_0000_0990),
        _change("TRUNCATE", 0, second, cascade=True, restart_identity=False),
        TransactionCommitted(second, second + 0x30, _COMMIT_TS, 772, 1),
    ]


def _messages(built: BuiltBatch, builder: MessageBuilder) -> list[Message]:
    for slot in built.schema_events:  # as the bridge fills them in
        built.messages[slot.index] = builder.schema_event(
            slot, table_schema().to_wire(), previous_fingerprint=None, needs_snapshot=False,
            reason=None, storage=16401)
    return [{"subject": m.subject, "msg_id": m.msg_id, "headers": [list(h) for h in m.headers],
             "payload": m.payload} for m in built.messages]


def _builder(fmt: str, mode: str, implementation: str) -> MessageBuilder:
    if implementation == "python":
        return MessageBuilder(fmt, mode, compiled=False)
    return MessageBuilder(fmt, mode)


def per_change(fmt: str, implementation: str) -> list[Message]:
    builder = _builder(fmt, "per-change", implementation)
    return _messages(builder.build(_transactions()), builder)


def batched(fmt: str, implementation: str) -> list[Message]:
    builder = _builder(fmt, "batched", implementation)
    return _messages(builder.build(_transactions()), builder)


def chunk(fmt: str, implementation: str) -> list[Message]:
    names = [name for name, _, _ in _COLUMNS]
    layout = ChunkLayout(table="users", snapshot_id="20261122T100000Z-0a0b0c0d", lsn="1/900",
                         schema_fingerprint=table_schema().fingerprint, columns=tuple(names),
                         key_columns=(0,), format=fmt, chunk_rows=3)
    converters = values.TypeRegistry().for_columns(
        [type("Column", (), {"type_oid": oid}) for _, oid, _ in _COLUMNS])
    chunker = Chunker(layout, converters, partition=2)
    if implementation == "python":
        chunker._compiled_kinds = None  # the pure-Python path
    copy_text = (
        "1\tZoë \"q\"\t-0\t\\\\x00ff\t{1,NULL,3}\t{\"a\": [1, 2.5, \"x\"], \"b\": null}\n"
        "2\t\\N\tNaN\t\\N\t{}\t18446744073709551617\n"
        "3\ttab\\there\tInfinity\t\\\\x\t{-1}\t\"s\"\n"
        "4\tlast\t1e-300\t\\N\t\\N\t[]\n").encode()
    chunks = [*chunker.add(copy_text), *chunker.finish()]
    return [{"subject": c.subject, "msg_id": c.headers[HEADER_MSG_ID],
             "headers": sorted([k, v] for k, v in c.headers.items()), "payload": c.payload}
            for c in chunks]


def meta(fmt: str, implementation: str, buckets: BucketSelection | None = None,
         snapshot_id: str = "20261122T100000Z-0a0b0c0d") -> list[Message]:
    schema = table_schema()
    payload = snapshot_meta(  # the snapshot job's own writer
        snapshot_id=snapshot_id, lsn="1/900", watermark_lsn="1/980", cdc_stream="CDC",
        cdc_start_seq=41, schema=schema, partitions=3,
        stats=[RangeStats(0), RangeStats(1),
               RangeStats(2, rows=4, chunks=2, first_chunk=2000000, bytes_raw=700,
                          bytes_compressed=700)],
        encoding=EncodingSettings(format=fmt, zstd=False), dictionary_id=None,
        dictionary_bucket="zstd_dictionaries", dictionary_key=None, duration=1.5,
        timestamp=1795000100, buckets=buckets)
    subject = snapshot_meta_subject("users") if buckets is None else repair_meta_subject("users")
    return [{"subject": subject, "msg_id": meta_msg_id(snapshot_id),
             "headers": [[HEADER_CONTENT_TYPE, CONTENT_TYPES[fmt]]],
             "payload": encoder(fmt)(payload)}]


def repair_meta(fmt: str, implementation: str) -> list[Message]:
    """A repair snapshot's meta (docs/verification.md Part 2, item 4): on init.repair.users,
    with its bits and buckets."""
    return meta(fmt, implementation, BucketSelection(4, (3, 9)),
                "repair-20261122T100000Z-0a0b0c0d")


def repair_meta_bitmap(fmt: str, implementation: str) -> list[Message]:
    """A repair meta of more buckets than a meta lists (``META_MAX_LISTED_BUCKETS``): its
    buckets as ``bucket_bitmap`` (buckets 0-16,384 of 32,768 at 15 bits)."""
    return meta(fmt, implementation,
                BucketSelection(15, tuple(range(META_MAX_LISTED_BUCKETS + 1))),
                "repair-20261122T100000Z-0a0b0c0e")


def digest(fmt: str, implementation: str) -> list[Message]:
    """Two digest messages of the golden table: every bucket at 2 bits, and buckets 1 and 6
    at 3 bits (a run asked for some)."""
    schema = table_schema()
    rows = [{"id": 1, "name": "Zoë", "score": -0.0, "blob": b"\x00\xff", "tags": [1, None, 3],
             "doc": '{"a": 1}'},
            {"id": 2, "name": None, "score": float("nan"), "blob": None, "tags": [],
             "doc": "null"},
            {"id": 3, "name": "x", "score": 7.0, "blob": b"", "tags": None, "doc": None}]
    digester = RowDigester([name for name, _, _ in _COLUMNS], schema.primary_key)
    fine = table_digest(rows, digester, 3)
    messages = []
    for verification_id, bits, buckets in (("verify-20261122T100000Z-0a0b0c0d", 2, None),
                                           ("verify-20261122T100500Z-0e0f1011", 3, [1, 6])):
        folded = fine.folded(bits)
        covered = buckets if buckets is not None else range(1 << bits)
        payload = digest_payload(
            verification_id=verification_id, table="users", lsn="1/A00",
            schema_fingerprint=schema.fingerprint, bits=bits,
            totals=[folded.totals[b] for b in covered],
            counts=[folded.counts[b] for b in covered], buckets=buckets, duration=2.25)
        subject, headers, data = digest_message(payload, fmt)
        msg_id = headers.pop(HEADER_MSG_ID)
        messages.append({"subject": subject, "msg_id": msg_id,
                         "headers": sorted([k, v] for k, v in headers.items()), "payload": data})
    return messages


def kv_schema(fmt: str, implementation: str) -> list[Message]:
    return [{"subject": "$KV.schemas.users", "msg_id": "", "headers": [],
             "payload": encoder(fmt)(table_schema().to_wire())}]


CASES: dict[str, Callable[[str, str], list[Message]]] = {
    "per_change": per_change, "batched": batched, "chunk": chunk, "meta": meta,
    "repair_meta": repair_meta, "repair_meta_bitmap": repair_meta_bitmap,
    "kv_schema": kv_schema, "digest": digest}
# The cases with two writers (compiled twins of them write msgpack: cdc_platform/_speedups).
TWO_WRITERS = {"per_change", "batched", "chunk"}


def implementations(case: str) -> tuple[str, ...]:
    if case in TWO_WRITERS and None not in (compiled_twin("cdc_platform.bridge.events"),
                                            compiled_twin("cdc_platform.snapshot.chunks")):
        return IMPLEMENTATIONS
    return ("python",)


def to_file(messages: list[Message], fmt: str) -> str:
    """The golden file's text: one JSON object per message, its payload as hex (msgpack) or
    as the JSON text itself."""
    lines = []
    for message in messages:
        payload = message["payload"]
        written = payload.hex() if fmt == "msgpack" else payload.decode()
        lines.append(json.dumps({**message, "payload": written}, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def path(case: str, fmt: str) -> Path:
    return GOLDEN / f"{case}.{fmt}.jsonl"


BUCKET_BITMAPS = GOLDEN / "bucket_bitmaps.json"
# (bits, buckets) of the bucket_bitmap vectors: the edges of a byte, bits under 3, 14 bits
_BITMAP_CASES = ((0, [0]), (2, [1, 3]), (3, [0, 7]), (4, [3, 9]), (6, [0, 8, 9, 63]),
                 (14, [0, 1, 4095, 8192, 16383]))


def bucket_bitmap_vectors() -> str:
    """``bucket_bitmaps.json``'s text: ``bucket_bitmap`` of a few sets of buckets (repair
    requests and metas, ``wire.bucket_sets``)."""
    return json.dumps([{"bits": bits, "buckets": buckets,
                        "bucket_bitmap": encode_bucket_bitmap(bits, buckets)}
                       for bits, buckets in _BITMAP_CASES], indent=1) + "\n"


SIGNATURES = GOLDEN / "signatures.json"
# a fixed signing key (never use it for anything but these vectors)
SIGNING_SEED = new_seed(bytes(range(32)))


def signature_vectors() -> str:
    """``signatures.json``'s text: golden messages of several kinds (a change, a batch, a
    watermark marker, a claim check's stand-in), each with the bytes signed and
    the two signature headers a bridge holding :data:`SIGNING_SEED` writes."""
    signer = MessageSigner(SIGNING_SEED)
    per_change_messages = per_change("msgpack", "python")
    chosen = [per_change_messages[1],
              next(m for m in batched("msgpack", "python") if m["subject"].endswith(".batch")),
              next(m for m in per_change_messages if m["subject"].startswith(WATERMARK_SUBJECT_PREFIX)),
              {**per_change_messages[1], "payload": encoder("msgpack")(
                  {"table": "users", "claim_check": {
                      "bucket": "cdc_large", "object": per_change_messages[1]["msg_id"],
                      "size": 2_000_000, "sha256": "00" * 32}}),
               "headers": [*per_change_messages[1]["headers"],
                           ["Cdc-Claim-Check", f"cdc_large/{per_change_messages[1]['msg_id']}"]]}]
    vectors = []
    for message in chosen:
        headers = {HEADER_MSG_ID: message["msg_id"], **dict(message["headers"])}
        signed = signed_bytes(message["subject"], message["msg_id"], headers, message["payload"])
        vectors.append({
            "subject": message["subject"], "headers": {
                **headers, HEADER_SIGNATURE: signer.signature(
                    message["subject"], message["msg_id"], headers, message["payload"]),
                HEADER_SIGNING_KEY: signer.public_key},
            "payload": message["payload"].hex(), "signed_bytes": signed.hex()})
    return json.dumps({
        "seed": SIGNING_SEED, "public_key": signer.public_key,
        "public_key_ed25519": public_key_bytes(signer.public_key).hex(),
        "messages": vectors}, indent=1) + "\n"


def main() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for case, build in CASES.items():
        for fmt in FORMATS:
            path(case, fmt).write_text(to_file(build(fmt, "python"), fmt))
            print(path(case, fmt))
    SIGNATURES.write_text(signature_vectors())
    print(SIGNATURES)
    BUCKET_BITMAPS.write_text(bucket_bitmap_vectors())
    print(BUCKET_BITMAPS)


if __name__ == "__main__":
    main()
