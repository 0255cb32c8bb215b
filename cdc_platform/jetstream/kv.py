"""KV values as messages of their bucket's stream, where they carry headers: a value the
platform signs (docs/wire-contract.md "Signatures") is put with its signature and read back with it.
(nats-py's ``KeyValue`` neither writes nor returns headers.)"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from cdc_platform.wire import MessageSigner, SignatureVerifier

log = logging.getLogger(__name__)

_REMOVED = ("DEL", "PURGE")  # KV-Operation of a deleted or purged key


async def put_value(js: JetStreamContext, kv: KeyValue, bucket: str, key: str, value: bytes,
                    signer: MessageSigner | None) -> int:
    """``kv.put(key, value)``, signed by ``signer`` when there is one; the revision."""
    if signer is None:
        return await kv.put(key, value)
    subject = f"$KV.{bucket}.{key}"
    ack = await js.publish(subject, value, headers=signer.signed_headers(subject, {}, value))
    return ack.seq


async def verified_value(js: JetStreamContext, bucket: str, key: str,
                         verifier: SignatureVerifier) -> bytes | None:
    """The key's value when ``verifier`` accepts it; None when there is none or it refuses
    it (said)."""
    try:
        message = await js.get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{key}")
    except NotFoundError:
        return None
    headers = message.headers or {}
    if headers.get("KV-Operation") in _REMOVED:
        return None
    refusal = verifier.refusal(message.subject or "", headers, message.data or b"")
    if refusal is not None:
        log.error("refused the value of %s in KV %s (revision %s): %s", key, bucket,
                  message.seq, refusal)
        return None
    return message.data or b""


async def kv_value(js: JetStreamContext, bucket: str, key: str,
                   verifier: SignatureVerifier | None = None,
                   kv: KeyValue | None = None) -> bytes | None:
    """The key's value (None: none); with ``verifier``, only one it accepts
    (:func:`verified_value`). ``kv``: the bucket's handle, when the caller has it."""
    if verifier is not None:
        return await verified_value(js, bucket, key, verifier)
    try:
        return (await (kv or await js.key_value(bucket)).get(key)).value or b""
    except KeyNotFoundError:  # (deleted or purged too)
        return None



async def kv_values(js: JetStreamContext, bucket: str) -> dict[str, bytes]:
    """Each live key of ``bucket`` with its value. The keys come from the stream's info and
    each value from a get of the key's last message (direct where the bucket allows it):
    bounded requests, where nats-py's ``kv.keys()`` runs an ordered consumer that can wait
    for good on a bucket being written (and needs the right to make one)."""
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    info = await js.stream_info(stream, subjects_filter=f"{prefix}>")
    direct = bool(info.config.allow_direct)
    values = {}
    for subject in sorted(info.state.subjects or {}):
        try:
            message = await js.get_last_msg(stream, subject, direct=direct)
        except NotFoundError:  # (expired or purged meanwhile)
            continue
        if (message.headers or {}).get("KV-Operation") not in _REMOVED:
            values[subject[len(prefix):]] = message.data or b""
    return values
