"""Message headers (docs/wire-contract.md "Headers")."""

from __future__ import annotations

HEADER_MSG_ID = "Nats-Msg-Id"
HEADER_CONTENT_TYPE = "Content-Type"
HEADER_CONTENT_ENCODING = "Content-Encoding"
HEADER_ZSTD_DICT = "Cdc-Zstd-Dict"
HEADER_SCHEMA_FINGERPRINT = "Cdc-Schema-Fingerprint"
# The payload is an object in the object store: ``{bucket}/{object}`` (docs/wire-contract.md "Large
# values")
HEADER_CLAIM_CHECK = "Cdc-Claim-Check"
# The message's ed25519 signature and the public nkey that made it (docs/wire-contract.md
# "Signatures")
HEADER_SIGNATURE = "Cdc-Signature"
HEADER_SIGNING_KEY = "Cdc-Signing-Key"

CONTENT_TYPES = {"msgpack": "application/msgpack", "json": "application/json"}
CONTENT_ENCODING_ZSTD = "zstd"
