"""The wire contract: subjects, message ids, payload maps and their encodings.

This module is the public API for consumers in any language; README "Wire contract"
documents it. Change it only on purpose.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal

import msgpack

from cdc_platform.lsn import format_lsn

Format = Literal["msgpack", "json"]

CDC_PREFIX = "cdc"
# A token no table can have: wire table names escape "-" (see cdc_platform.naming).
CONTROL_TOKEN = "cdc-platform"
WATERMARK_SUBJECT_PREFIX = f"{CDC_PREFIX}.{CONTROL_TOKEN}.watermark"
# Commit frames of JetStream fast-ingest batches: captured by the CDC stream, never stored.
CONTROL_EOB_SUBJECT = f"{CDC_PREFIX}.{CONTROL_TOKEN}.eob"
INIT_SNAP_PREFIX = "init.snap"
INIT_META_PREFIX = "init.meta"
SNAPSHOT_REQUEST_PREFIX = "snapshot.request"

# Logical decoding message prefixes we emit with pg_logical_emit_message.
HEARTBEAT_PREFIX = "cdc_platform.heartbeat"
WATERMARK_PREFIX = "cdc_platform.watermark"

HEADER_MSG_ID = "Nats-Msg-Id"
HEADER_CONTENT_TYPE = "Content-Type"
HEADER_CONTENT_ENCODING = "Content-Encoding"
HEADER_ZSTD_DICT = "Cdc-Zstd-Dict"
HEADER_SCHEMA_FINGERPRINT = "Cdc-Schema-Fingerprint"
CONTENT_TYPES = {"msgpack": "application/msgpack", "json": "application/json"}


def cdc_subject(table: str, operation: str) -> str:
    """``cdc.{table}.{op}``; ``operation`` is INSERT/UPDATE/DELETE/TRUNCATE."""
    return f"{CDC_PREFIX}.{table}.{operation.lower()}"


def cdc_batch_subject(table: str, operation: str) -> str:
    return f"{CDC_PREFIX}.{table}.{operation.lower()}.batch"


# A table's new shape, in stream order before the first change that uses it (README
# "Schema changes"); its ordinal is that change's, and it sorts before it.
SCHEMA_OPERATION = "SCHEMA"


def cdc_schema_subject(table: str) -> str:
    return f"{CDC_PREFIX}.{table}.schema"


def schema_event_msg_id(commit_lsn: int, ordinal: int) -> str:
    return f"{format_lsn(commit_lsn)}:{ordinal}:schema"


def watermark_subject(snapshot_id: str) -> str:
    return f"{WATERMARK_SUBJECT_PREFIX}.{snapshot_id}"


def change_msg_id(commit_lsn: int, ordinal: int) -> str:
    """Unique per change (a commit LSN belongs to one transaction), stable across replays."""
    return f"{format_lsn(commit_lsn)}:{ordinal}"


def batch_msg_id(commit_lsn: int, first_ordinal: int, last_ordinal: int) -> str:
    """Batches never span transactions and are cut by content only, so a replay cuts the
    same batches and this id always names the same content."""
    return f"{format_lsn(commit_lsn)}:{first_ordinal}-{last_ordinal}"


def snapshot_chunk_subject(table: str, snapshot_id: str, chunk: int) -> str:
    return f"{INIT_SNAP_PREFIX}.{table}.{snapshot_id}.{chunk}"


def snapshot_meta_subject(table: str) -> str:
    return f"{INIT_META_PREFIX}.{table}"


def schema_fingerprint(columns: Sequence[tuple[str, int, int, bool]],
                       replica_identity: str) -> str:
    """Stable id of a table's shape: (name, type oid, type modifier, is_key) per column."""
    canonical = json.dumps([list(c) for c in columns] + [replica_identity],
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# -- encodings -----------------------------------------------------------------------------
_packb = msgpack.Packer(use_bin_type=True, datetime=False).pack


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def _json_safe_floats(value: Any) -> Any:
    """JSON has no NaN/Infinity: write them as the strings PostgreSQL prints."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _json_safe_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe_floats(v) for v in value]
    return value


def encode_json(value: Any) -> bytes:
    try:
        return json.dumps(value, default=_json_default, separators=(",", ":"),
                          allow_nan=False, ensure_ascii=False).encode()
    except ValueError:  # a non-finite float somewhere: rare, so only then walk the value
        return json.dumps(_json_safe_floats(value), default=_json_default,
                          separators=(",", ":"), allow_nan=False,
                          ensure_ascii=False).encode()


def encoder(fmt: Format):
    """``value -> bytes`` for the configured payload format."""
    if fmt == "msgpack":
        return msgpack.Packer(use_bin_type=True, datetime=False).pack
    if fmt == "json":
        return encode_json
    raise ValueError(f"unknown format {fmt!r}")


def commit_ts_epoch(commit_ts: str) -> float:
    """An event's ``commit_ts`` (``2025-12-08T13:45:21.719719Z``) -> seconds since the epoch;
    one PostgreSQL cannot express in a datetime (infinity, year 0) -> now."""
    try:
        return datetime.fromisoformat(commit_ts).timestamp()
    except ValueError:
        return time.time()


def payload_format(data: bytes) -> Format:
    """The format of a payload from its first byte (README "Payload encoding"): JSON
    payloads start with ``{`` or ``[``, which never begin a msgpack map or array."""
    return "json" if data[:1] in (b"{", b"[") else "msgpack"


def decode_payload(data: bytes, fmt: Format) -> Any:
    """For consumers and tests: the inverse of :func:`encoder` (bytes stay base64 in JSON)."""
    if fmt == "msgpack":
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    return json.loads(data)
