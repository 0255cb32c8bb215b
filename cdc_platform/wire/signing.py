"""Message signatures (docs/wire-contract.md "Signatures"): the bytes the platform signs, the
headers that carry a signature, and the check a consumer makes before it trusts a message.

A signature is ed25519 over :func:`signed_bytes`, which binds the subject, the
``Nats-Msg-Id``, the headers that change what a payload means, and the payload, so a signed
message cannot be stored again under another subject or id, or with another claim check, and
still verify. Keys are nkeys (NATS's ed25519 keys, base32 with a checksum), decoded here
without an nkeys library: :func:`public_key_bytes` is what a consumer in another language
writes.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping

from nacl.bindings import crypto_sign, crypto_sign_open, crypto_sign_seed_keypair
from nacl.exceptions import BadSignatureError

from cdc_platform.wire.headers import (
    HEADER_CLAIM_CHECK,
    HEADER_CONTENT_ENCODING,
    HEADER_CONTENT_TYPE,
    HEADER_MSG_ID,
    HEADER_SCHEMA_FINGERPRINT,
    HEADER_SIGNATURE,
    HEADER_SIGNING_KEY,
    HEADER_ZSTD_DICT,
)

SIGNATURE_CONTEXT = b"cdc-platform-signature-v1\n"
# The headers whose values are signed, in this order (absent: an empty line).
SIGNED_HEADERS = (HEADER_SCHEMA_FINGERPRINT, HEADER_CLAIM_CHECK, HEADER_CONTENT_TYPE,
                  HEADER_CONTENT_ENCODING, HEADER_ZSTD_DICT)

# what the two headers add to a message's header block (their lengths are fixed)
SIGNATURE_HEADERS_BYTES = len(f"{HEADER_SIGNATURE}: \r\n{HEADER_SIGNING_KEY}: \r\n") + 86 + 56

_SEED_PREFIX = 18 << 3       # nkeys' "S" (a seed): the first 5 bits of a seed's first byte
# nkeys' key roles, the first byte of a public key: operator, cluster, account, user, server
_PUBLIC_PREFIXES = frozenset({14 << 3, 2 << 3, 0, 20 << 3, 13 << 3})


def signed_bytes(subject: str, msg_id: str, headers: Mapping[str, str],
                 payload: bytes) -> bytes:
    """What is signed: the context line, the subject, the message id (empty: a KV value has
    none), then each of :data:`SIGNED_HEADERS`' values (empty when absent), each followed by
    ``\\n``, then the payload as stored. (None of those texts may hold a line break: NATS
    forbids it.)"""
    lines = [subject, msg_id, *(headers.get(name, "") for name in SIGNED_HEADERS)]
    return SIGNATURE_CONTEXT + "".join(line + "\n" for line in lines).encode() + payload


def _crc16(data: bytes) -> int:
    """CRC-16/XMODEM (polynomial 0x1021, initial 0), the nkeys checksum."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
    return crc


def _checked(text: str, what: str) -> bytes:
    """The bytes of an nkey (base32, RFC 4648, no padding) without its trailing checksum."""
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not base32") from None
    body, checksum = raw[:-2], raw[-2:]
    if len(raw) < 3 or int.from_bytes(checksum, "little") != _crc16(body):
        raise ValueError(f"{what}: checksum mismatch")
    return body


def public_key_bytes(public_key: str) -> bytes:
    """The 32-byte ed25519 key of a public nkey (56 characters: a role letter such as ``A``
    or ``U``, then the key and a CRC-16, base32); ValueError when it is not one."""
    body = _checked(public_key, f"public key {public_key[:60]!r}")
    if len(body) != 33 or body[0] not in _PUBLIC_PREFIXES:
        raise ValueError(f"public key {public_key[:60]!r} is not a public nkey")
    return body[1:]


def _public_key_text(prefix: int, key: bytes) -> str:
    body = bytes([prefix]) + key
    return base64.b32encode(body + _crc16(body).to_bytes(2, "little")).decode().rstrip("=")


def new_seed(raw: bytes) -> str:
    """The nkey seed text (``SA...``: an account key) of 32 random bytes."""
    if len(raw) != 32:
        raise ValueError("a seed is 32 bytes")
    body = bytes([_SEED_PREFIX, 0]) + raw   # (0: the account role)
    return base64.b32encode(body + _crc16(body).to_bytes(2, "little")).decode().rstrip("=")


class MessageSigner:
    """Signs messages with the key of an nkey seed (``S...``, 58 characters)."""

    def __init__(self, seed: str) -> None:
        body = _checked(seed.strip(), "the signing key seed")
        if len(body) != 34 or body[0] & 0xF8 != _SEED_PREFIX:
            raise ValueError("the signing key seed is not an nkey seed (S...)")
        prefix = (body[0] & 0x07) << 5 | (body[1] & 0xF8) >> 3
        if prefix not in _PUBLIC_PREFIXES:
            raise ValueError("the signing key seed is not an nkey seed (S...)")
        public, self._secret = crypto_sign_seed_keypair(body[2:])
        self.public_key = _public_key_text(prefix, public)

    def signature(self, subject: str, msg_id: str, headers: Mapping[str, str],
                  payload: bytes) -> str:
        """The ``Cdc-Signature`` value: the signature, base64url without padding."""
        signed = crypto_sign(signed_bytes(subject, msg_id, headers, payload), self._secret)
        return base64.urlsafe_b64encode(signed[:64]).decode().rstrip("=")

    def signed_headers(self, subject: str, headers: Mapping[str, str],
                       payload: bytes) -> dict[str, str]:
        """``headers`` with the two signature headers."""
        return {**headers, HEADER_SIGNATURE: self.signature(
            subject, headers.get(HEADER_MSG_ID, ""), headers, payload),
            HEADER_SIGNING_KEY: self.public_key}


class SignatureVerifier:
    """Tells whether a message was signed by one of ``trusted_keys`` (public nkeys; several
    while keys are rotated)."""

    def __init__(self, trusted_keys: Iterable[str]) -> None:
        self.keys = {key: public_key_bytes(key) for key in trusted_keys}
        if not self.keys:
            raise ValueError("no trusted key")

    def refusal(self, subject: str, headers: Mapping[str, str], payload: bytes) -> str | None:
        """Why the message is not to be trusted; None when it verifies."""
        key_text = headers.get(HEADER_SIGNING_KEY)
        signature_text = headers.get(HEADER_SIGNATURE)
        if key_text is None or signature_text is None:
            return f"not signed (no {HEADER_SIGNATURE} / {HEADER_SIGNING_KEY} header)"
        key = self.keys.get(key_text)
        if key is None:
            return f"signed by {key_text[:60]!r}, which is not a trusted key"
        msg_id = headers.get(HEADER_MSG_ID, "")
        try:
            signature = base64.urlsafe_b64decode(signature_text + "=" * (-len(signature_text) % 4))
        except (binascii.Error, ValueError):
            signature = b""
        if len(signature) != 64:
            return f"{HEADER_SIGNATURE} is not a base64url ed25519 signature"
        try:
            crypto_sign_open(signature + signed_bytes(subject, msg_id, headers, payload), key)
        except BadSignatureError:
            return f"bad signature (key {key_text})"
        return None
