"""Payload encodings (docs/wire-contract.md "Payload encoding"): msgpack or JSON, told apart by the
first byte; JSON carries bytes as base64 and non-finite floats as the strings PostgreSQL prints."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import msgpack

from cdc_platform.speedups import compiled_twin

Format = Literal["msgpack", "json"]


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


def encoder(fmt: Format) -> Callable[[Any], bytes]:
    """``value -> bytes`` for the configured payload format."""
    if fmt == "msgpack":
        pack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True, datetime=False).pack
        return pack
    if fmt == "json":
        return encode_json
    raise ValueError(f"unknown format {fmt!r}")


def payload_format(data: bytes) -> Format:
    """The format of a payload from its first byte: JSON payloads start with ``{`` or ``[``,
    which never begin a msgpack map or array."""
    return "json" if data[:1] in (b"{", b"[") else "msgpack"


def decode_any(data: bytes) -> Any:
    """A payload in either format, told apart by its first byte (:func:`payload_format`)."""
    return decode_payload(data, payload_format(data))


def decode_msgpack_python(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def decode_msgpack(data: bytes, unread: frozenset[str] | None = None) -> Any:
    """:func:`decode_msgpack_python`, then ``without(value, unread)``. The compiled twin gives
    the same (reading past the ``unread`` values without making them), or a ValueError or
    TypeError for what it does not take: the caller then decodes the pure way."""
    decoded = decode_msgpack_python(data)
    return without(decoded, unread) if unread else decoded


def decode_payload(data: bytes, fmt: Format, unread: frozenset[str] = frozenset()) -> Any:
    """For consumers and tests: the inverse of :func:`encoder` (bytes stay base64 in JSON).
    ``unread``: fields the caller never reads, left out of each event (:func:`without`); the
    compiled decoder reads past them without making their values."""
    if fmt == "msgpack":
        try:
            return decode_msgpack(data, unread or None)
        except (ValueError, TypeError):  # the pure decoder's answer, or its error
            pass
        decoded = decode_msgpack_python(data)
    else:
        try:
            decoded = json.loads(data)
        except RecursionError:  # a forged payload nested too deep: one kind of error for all
            raise ValueError("JSON nested too deep") from None
    return without(decoded, unread) if unread else decoded


def without(payload: Any, unread: frozenset[str]) -> Any:
    """``payload`` (an event map, or a batch: an array of them) without the entries of the
    keys in ``unread``; anything else as it is."""
    if type(payload) is dict:
        return {key: value for key, value in payload.items() if key not in unread}
    if type(payload) is list:
        return [without(item, unread) if type(item) is dict else item for item in payload]
    return payload


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.wire import encoding as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    decode_msgpack = _twin.decode_msgpack
