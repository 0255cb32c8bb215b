"""Subjects and message ids (docs/wire-contract.md "Subjects" and "Message ids").

Every id is stable across replays: JetStream's duplicate window drops a republished copy.
"""

from __future__ import annotations

from cdc_platform.lsn import format_lsn

CDC_PREFIX = "cdc"
# A token no table can have: wire table names escape "-" (see cdc_platform.naming).
CONTROL_TOKEN = "cdc-platform"
WATERMARK_SUBJECT_PREFIX = f"{CDC_PREFIX}.{CONTROL_TOKEN}.watermark"
# Commit frames of JetStream fast-ingest batches: captured by the CDC stream, never stored.
CONTROL_EOB_SUBJECT = f"{CDC_PREFIX}.{CONTROL_TOKEN}.eob"
# The bridge lost its slot and streams from a new one (CDC_ON_SLOT_LOST=resync): changes
# between the marker's lost_after and the first change after it may be missing.
RESYNC_SUBJECT_PREFIX = f"{CDC_PREFIX}.{CONTROL_TOKEN}.resync"
# A table's verification digest (docs/verification.md): after every transaction it covers.
VERIFY_SUBJECT_PREFIX = f"{CDC_PREFIX}.{CONTROL_TOKEN}.verify"
# The watermark marker of a verification has an id starting so (a snapshot's never does).
VERIFICATION_ID_PREFIX = "verify-"
INIT_SNAP_PREFIX = "init.snap"
INIT_META_PREFIX = "init.meta"
# The meta of a repair snapshot (some buckets of a table): never where full snapshots' are.
INIT_REPAIR_PREFIX = "init.repair"
SNAPSHOT_REQUEST_PREFIX = "snapshot.request"
# A request body's size at most (larger: refused; a repair's buckets must fit in it).
REQUEST_BODY_MAX_BYTES = 4096
# A mirror's state: READERS' import of PLATFORM's KV `mirrors` (key = the mirror id).
MIRROR_STATE_PREFIX = "mirror.state"
# A mirror id: a name, or a team's user's `{team}.{name}` (its rights: mirror.state.{team}.>).
MIRROR_ID_PATTERN = r"[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64})?"

# Logical decoding message prefixes we emit with pg_logical_emit_message.
HEARTBEAT_PREFIX = "cdc_platform.heartbeat"
WATERMARK_PREFIX = "cdc_platform.watermark"

# A table's new shape, in stream order before the first change that uses it (docs/wire-contract.md
# "Schema changes"); its ordinal is that change's, and it sorts before it.
SCHEMA_OPERATION = "SCHEMA"
CHANGE_OPERATIONS = ("INSERT", "UPDATE", "DELETE", "TRUNCATE")


def cdc_subject(table: str, operation: str) -> str:
    """``cdc.{table}.{op}``; ``operation`` is INSERT/UPDATE/DELETE/TRUNCATE."""
    return f"{CDC_PREFIX}.{table}.{operation.lower()}"


def cdc_batch_subject(table: str, operation: str) -> str:
    return f"{CDC_PREFIX}.{table}.{operation.lower()}.batch"


def cdc_schema_subject(table: str) -> str:
    return f"{CDC_PREFIX}.{table}.schema"


def cdc_table_subjects(table: str) -> str:
    """Every subject of ``table``'s events in ``CDC`` (changes, batches, schema events)."""
    return f"{CDC_PREFIX}.{table}.>"


def watermark_subject(snapshot_id: str) -> str:
    return f"{WATERMARK_SUBJECT_PREFIX}.{snapshot_id}"


def snapshot_chunk_subject(table: str, snapshot_id: str, chunk: int) -> str:
    return f"{INIT_SNAP_PREFIX}.{table}.{snapshot_id}.{chunk}"


def snapshot_chunk_prefix(table: str, snapshot_id: str) -> str:
    """The meta's ``chunk_subject_prefix``: every chunk subject of one snapshot starts so."""
    return f"{INIT_SNAP_PREFIX}.{table}.{snapshot_id}."


def snapshot_meta_subject(table: str) -> str:
    return f"{INIT_META_PREFIX}.{table}"


def repair_meta_subject(table: str) -> str:
    return f"{INIT_REPAIR_PREFIX}.{table}"


def verify_digest_subject(table: str, verification_id: str) -> str:
    """``cdc.cdc-platform.verify.{table}.{verification_id}``: the source's digest."""
    return f"{VERIFY_SUBJECT_PREFIX}.{table}.{verification_id}"


def snapshot_request_subject(table: str) -> str:
    return f"{SNAPSHOT_REQUEST_PREFIX}.{table}"


def mirror_state_subject(mirror_id: str) -> str:
    """``mirror.state.{mirror_id}``: stored as key ``mirror_id`` of KV ``mirrors``."""
    return f"{MIRROR_STATE_PREFIX}.{mirror_id}"


# -- message ids (the Nats-Msg-Id header) ----------------------------------------------------
def change_msg_id(commit_lsn: int, ordinal: int) -> str:
    """Unique per change (a commit LSN belongs to one transaction), stable across replays."""
    return f"{format_lsn(commit_lsn)}:{ordinal}"


def batch_msg_id(commit_lsn: int, first_ordinal: int, last_ordinal: int) -> str:
    """Batches never span transactions and are cut by content only, so a replay cuts the
    same batches and this id always names the same content."""
    return f"{format_lsn(commit_lsn)}:{first_ordinal}-{last_ordinal}"


def schema_event_msg_id(commit_lsn: int, ordinal: int) -> str:
    return f"{format_lsn(commit_lsn)}:{ordinal}:schema"


def watermark_msg_id(snapshot_id: str) -> str:
    return f"watermark:{snapshot_id}"


def chunk_msg_id(snapshot_id: str, chunk: int) -> str:
    """A retried Spark task republishes identical chunks under the same ids."""
    return f"{snapshot_id}:{chunk}"


def meta_msg_id(snapshot_id: str) -> str:
    return f"{snapshot_id}:meta"


def resync_subject(slot: str) -> str:
    """``cdc.cdc-platform.resync.{slot}`` (a slot name is lowercase letters, digits, ``_``)."""
    return f"{RESYNC_SUBJECT_PREFIX}.{slot}"


def resync_msg_id(slot: str, lost_after: int) -> str:
    return f"resync:{slot}:{format_lsn(lost_after)}"


def verify_digest_msg_id(verification_id: str) -> str:
    return f"verify:{verification_id}:digest"


def dictionary_key(table: str, dictionary_id: int) -> str:
    """The key of a snapshot's zstd dictionary in the dictionaries KV bucket."""
    return f"{table}.{dictionary_id}"
