"""The wire contract, the public API for consumers in any language (docs/wire-contract.md
documents it; change it only on purpose):

- :mod:`.subjects`: subjects, operations and message ids;
- :mod:`.headers`: headers and content types;
- :mod:`.payloads`: every payload, typed, with its field order;
- :mod:`.encoding`: msgpack and JSON;
- :mod:`.cutover`: where a snapshot ends and the stream begins;
- :mod:`.signing`: what a signature covers, and its check;
- :mod:`.bucket_sets`: a set of buckets as a list or a bitmap (repair requests and metas).

Golden payloads in ``cdc_platform_tests/data/golden/`` pin the bytes.
"""

from cdc_platform.wire.bucket_sets import (
    BUCKET_BITMAP_FIELD,
    META_MAX_LISTED_BUCKETS,
    bucket_bitmap_bytes,
    decode_bucket_bitmap,
    encode_bucket_bitmap,
)
from cdc_platform.wire.cutover import CUTOVER_RULE, applies, cutover_rule_text
from cdc_platform.wire.encoding import (
    Format,
    decode_any,
    decode_payload,
    encode_json,
    encoder,
    payload_format,
)
from cdc_platform.wire.headers import (
    CONTENT_ENCODING_ZSTD,
    CONTENT_TYPES,
    HEADER_CLAIM_CHECK,
    HEADER_CONTENT_ENCODING,
    HEADER_CONTENT_TYPE,
    HEADER_MSG_ID,
    HEADER_SCHEMA_FINGERPRINT,
    HEADER_SIGNATURE,
    HEADER_SIGNING_KEY,
    HEADER_ZSTD_DICT,
)
from cdc_platform.wire.payloads import (
    COLUMN_FIELDS,
    MIRROR_STATE_FIELDS,
    ChangeEvent,
    Column,
    MirrorStateValue,
    MirrorTableState,
    MirrorVerification,
    RepairMetaPayload,
    ResyncMarker,
    SchemaEvent,
    SnapshotChunk,
    SnapshotMetaPayload,
    SnapshotReply,
    TableSchemaValue,
    VerificationDigestPayload,
    WatermarkMarker,
    commit_ts_epoch,
    in_field_order,
    schema_fingerprint,
)
from cdc_platform.wire.signing import MessageSigner, SignatureVerifier, signed_bytes
from cdc_platform.wire.subjects import (
    CDC_PREFIX,
    CHANGE_OPERATIONS,
    CONTROL_EOB_SUBJECT,
    CONTROL_TOKEN,
    HEARTBEAT_PREFIX,
    INIT_META_PREFIX,
    INIT_REPAIR_PREFIX,
    INIT_SNAP_PREFIX,
    MIRROR_ID_PATTERN,
    MIRROR_STATE_PREFIX,
    REQUEST_BODY_MAX_BYTES,
    RESYNC_SUBJECT_PREFIX,
    SCHEMA_OPERATION,
    SNAPSHOT_REQUEST_PREFIX,
    VERIFICATION_ID_PREFIX,
    VERIFY_SUBJECT_PREFIX,
    WATERMARK_PREFIX,
    WATERMARK_SUBJECT_PREFIX,
    batch_msg_id,
    cdc_batch_subject,
    cdc_schema_subject,
    cdc_subject,
    cdc_table_subjects,
    change_msg_id,
    chunk_msg_id,
    dictionary_key,
    meta_msg_id,
    mirror_state_subject,
    repair_meta_subject,
    resync_msg_id,
    resync_subject,
    schema_event_msg_id,
    snapshot_chunk_prefix,
    snapshot_chunk_subject,
    snapshot_meta_subject,
    snapshot_request_subject,
    verify_digest_msg_id,
    verify_digest_subject,
    watermark_msg_id,
    watermark_subject,
)

__all__ = [
    "BUCKET_BITMAP_FIELD", "CDC_PREFIX", "CHANGE_OPERATIONS", "COLUMN_FIELDS", "CONTENT_ENCODING_ZSTD", "CONTENT_TYPES",
    "CONTROL_EOB_SUBJECT", "CONTROL_TOKEN", "CUTOVER_RULE", "HEADER_CLAIM_CHECK",
    "HEADER_CONTENT_ENCODING", "HEADER_CONTENT_TYPE", "HEADER_MSG_ID",
    "HEADER_SCHEMA_FINGERPRINT", "HEADER_SIGNATURE", "HEADER_SIGNING_KEY",
    "HEADER_ZSTD_DICT", "HEARTBEAT_PREFIX", "INIT_META_PREFIX", "INIT_REPAIR_PREFIX",
    "INIT_SNAP_PREFIX", "META_MAX_LISTED_BUCKETS", "MIRROR_ID_PATTERN", "MIRROR_STATE_FIELDS",
    "MIRROR_STATE_PREFIX",
    "REQUEST_BODY_MAX_BYTES", "RESYNC_SUBJECT_PREFIX", "SCHEMA_OPERATION", "SNAPSHOT_REQUEST_PREFIX",
    "VERIFICATION_ID_PREFIX", "VERIFY_SUBJECT_PREFIX", "WATERMARK_PREFIX",
    "WATERMARK_SUBJECT_PREFIX", "ChangeEvent", "Column", "Format", "MessageSigner",
    "MirrorStateValue", "MirrorTableState", "MirrorVerification", "RepairMetaPayload",
    "ResyncMarker", "SchemaEvent", "SignatureVerifier", "SnapshotChunk", "SnapshotMetaPayload",
    "SnapshotReply", "TableSchemaValue", "VerificationDigestPayload", "WatermarkMarker", "applies", "batch_msg_id", "bucket_bitmap_bytes",
    "cdc_batch_subject", "cdc_schema_subject", "cdc_subject", "cdc_table_subjects",
    "change_msg_id",
    "chunk_msg_id", "commit_ts_epoch", "cutover_rule_text", "decode_any", "decode_bucket_bitmap", "decode_payload",
    "dictionary_key",
    "encode_bucket_bitmap", "encode_json", "encoder", "in_field_order", "meta_msg_id", "mirror_state_subject",
    "payload_format",
    "repair_meta_subject", "resync_msg_id", "resync_subject", "schema_event_msg_id", "schema_fingerprint", "signed_bytes", "snapshot_chunk_prefix",
    "snapshot_chunk_subject", "snapshot_meta_subject", "snapshot_request_subject",
    "verify_digest_msg_id", "verify_digest_subject", "watermark_msg_id", "watermark_subject",
]
