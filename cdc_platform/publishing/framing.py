"""The NATS protocol bytes the publisher writes, how they are written (through nats-py's
outbound buffer, or its public ``publish``), and the server's replies read back. No state."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError

from cdc_platform.jetstream.nats_internals import raw_writer
from cdc_platform.publishing.messages import Held
from cdc_platform.speedups import compiled_twin

log = logging.getLogger(__name__)

# A frame to write: (subject, reply, header block or None for a plain PUB, payload).
Frame = tuple[bytes, bytes, "bytes | None", bytes]


class Wire(Protocol):
    name: str

    async def write(self, frames: Sequence[Frame]) -> None: ...

    async def write_sequence(self, held: list[Held], reply_prefix: bytes, first_seq: int,
                             reply_suffix: bytes) -> None: ...


def frame_sequence(held: list[Held], reply_prefix: bytes, first_seq: int,
                   reply_suffix: bytes) -> list[Frame]:
    """The frames of ``held`` with reply subjects ``reply_prefix + seq + reply_suffix``, seq
    counting up from ``first_seq``: how both channels number their messages."""
    return [(subject, b"%s%d%s" % (reply_prefix, seq, reply_suffix), header, payload)
            for seq, (subject, header, payload, _, _) in enumerate(held, first_seq)]


def protocol_bytes(frames: Sequence[Frame]) -> bytes:
    """NATS protocol text of ``frames``: ``HPUB`` with a header block, ``PUB`` without."""
    buffer = bytearray()
    for subject, reply, header, payload in frames:
        if header is None:
            buffer += b"PUB %s %s %d\r\n" % (subject, reply, len(payload))
        else:
            header_size = len(header)
            buffer += b"HPUB %s %s %d %d\r\n" % (subject, reply, header_size,
                                                 header_size + len(payload))
            buffer += header
        buffer += payload
        buffer += b"\r\n"
    return bytes(buffer)


def sequence_bytes_python(held: list[Held], reply_prefix: bytes, first_seq: int,
                          reply_suffix: bytes) -> bytes:
    """``protocol_bytes(frame_sequence(...))``: a run of held messages as protocol bytes."""
    return protocol_bytes(frame_sequence(held, reply_prefix, first_seq, reply_suffix))


#: :func:`sequence_bytes_python`, or its compiled twin (the same bytes).
sequence_bytes: Callable[[list[Held], bytes, int, bytes], bytes] = sequence_bytes_python


class RawWire:
    """Writes pre-framed ``HPUB``/``PUB`` bytes through nats-py's outbound buffer
    (:func:`~cdc_platform.jetstream.nats_internals.raw_writer`): framing ourselves skips
    nats-py's per-message header encoding, which costs more than the publish itself.
    :func:`probe_raw_wire` checks at start that the bytes arrive intact, so a nats-py that
    writes them otherwise falls back to :class:`PublicWire` instead of putting garbage on the
    wire. A run of messages is framed by the compiled twin when it is built
    (``sequence_bytes``; same bytes).
    """

    name = "raw-hpub"

    def __init__(self, nc: NatsClient) -> None:
        self._send = raw_writer(nc)

    async def write(self, frames: Sequence[Frame]) -> None:
        await self._send(protocol_bytes(frames))

    async def write_sequence(self, held: list[Held], reply_prefix: bytes, first_seq: int,
                             reply_suffix: bytes) -> None:
        await self._send(sequence_bytes(held, reply_prefix, first_seq, reply_suffix))


class PublicWire:
    """The same frames through ``nc.publish``: slower, but only public API."""

    name = "nc.publish"

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc

    async def write(self, frames: Sequence[Frame]) -> None:
        for subject, reply, header, payload in frames:
            await self._nc.publish(subject.decode(), payload, reply=reply.decode(),
                                   headers=None if header is None else parse_header_block(header))

    async def write_sequence(self, held: list[Held], reply_prefix: bytes, first_seq: int,
                             reply_suffix: bytes) -> None:
        await self.write(frame_sequence(held, reply_prefix, first_seq, reply_suffix))


def parse_header_block(block: bytes) -> dict[str, str]:
    """Our own header block back into a dict (:class:`PublicWire`, a message sent alone)."""
    lines = block.decode("ascii").split("\r\n")[1:]
    return dict(line.split(": ", 1) for line in lines if line)


async def probe_raw_wire(nc: NatsClient, timeout: float = 2.0) -> RawWire | None:
    """A :class:`RawWire` if one framed message round-trips intact through the server."""
    subject, reply = nc.new_inbox(), nc.new_inbox()
    subscription = await nc.subscribe(subject)
    try:
        wire = RawWire(nc)
        await wire.write([(subject.encode(), reply.encode(),
                           b"NATS/1.0\r\nCdc-Wire-Probe: 1\r\n\r\n", b"probe")])
        message = await subscription.next_msg(timeout)
    except (NatsError, TimeoutError, TypeError, AttributeError) as exc:
        log.warning("raw HPUB self-check failed (%r); publishing via nc.publish", exc)
        return None
    finally:
        await subscription.unsubscribe()
    intact = (message.subject == subject and message.reply == reply
              and message.data == b"probe"
              and (message.headers or {}).get("Cdc-Wire-Probe") == "1")
    if not intact:
        log.warning("raw HPUB self-check returned %r; publishing via nc.publish", message)
        return None
    return wire


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    pattern_tokens, subject_tokens = pattern.split("."), subject.split(".")
    for position, token in enumerate(pattern_tokens):
        if token == ">":
            return len(subject_tokens) > position
        if position >= len(subject_tokens) or token not in ("*", subject_tokens[position]):
            return False
    return len(pattern_tokens) == len(subject_tokens)


def is_header_text(text: str) -> bool:
    """ASCII without control characters: anything else would corrupt the header block."""
    return text.isascii() and text.isprintable()


def status_details(headers: dict[str, str] | None) -> tuple[int | None, str]:
    """``(status, description)`` of a core NATS status reply such as ``NATS/1.0 503``.

    nats-py 2.16 files the line after the status under "Description" (for a 503 that is
    ``"\nNats-Subject: ..."``), so only a clean one-line description is kept.
    """
    headers = headers or {}
    text = str(headers.get("Status") or "")
    status = int(text) if text.isdigit() else None
    if status == 503:
        return status, ("no responders: no JetStream stream captures the subject (stream "
                        "deleted, subjects changed, or JetStream unavailable)")
    description = str(headers.get("Description") or "").strip()
    if not description or "\n" in description:
        description = f"status reply {text}" if text else "empty reply"
    return status, description


def error_details(error: Any) -> tuple[int | None, int | None, str]:
    """``(status, err_code, description)`` of a JetStream ``ApiError`` JSON object."""
    if not isinstance(error, dict):
        return None, None, str(error)
    return error.get("code"), error.get("err_code"), str(error.get("description", error))


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.publishing import framing as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    sequence_bytes = _twin.sequence_bytes
