"""What the publisher takes and reports: the messages the bridge and the snapshot jobs hand it,
its refusal, its counters. No I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from cdc_platform.errors import PublishError

PublishMode = Literal["fast-batch", "per-message", "auto"]


class OutgoingMessage(NamedTuple):
    """One JetStream message as the bridge wants it stored. (A named tuple: one is built per
    change, and a frozen dataclass costs three times as much to build.)"""

    subject: str
    msg_id: str          # Nats-Msg-Id header, ASCII
    payload: bytes
    headers: tuple[tuple[str, str], ...] = ()   # extra headers (e.g. Cdc-Schema-Fingerprint)


class PublishRejected(PublishError):
    """JetStream or the NATS server refused a message; says which message and why.

    ``status`` is the HTTP-like code (``503``, ``400``, ``429`` ...) and ``err_code`` JetStream's
    own error code (``10077``, ``10205`` ...) when the reply carried one.
    """

    def __init__(self, description: str, *, subject: str | None = None,
                 msg_id: str | None = None, status: int | None = None,
                 err_code: int | None = None) -> None:
        self.description = description
        self.subject = subject
        self.msg_id = msg_id
        self.status = status
        self.err_code = err_code
        codes = ", ".join(part for part in (
            f"status {status}" if status is not None else "",
            f"err_code {err_code}" if err_code is not None else "") if part)
        where = f" message {msg_id!r} on {subject!r}" if msg_id is not None else ""
        super().__init__(f"JetStream refused{where}: {description}"
                         + (f" ({codes})" if codes else ""))


@dataclass(slots=True)
class PublishStats:
    """Counters for metrics; read them at any time, they are updated in place."""

    mode: str = ""
    wire: str = ""
    messages_published: int = 0      # accepted by publish()
    messages_sent: int = 0           # frames written, resends included
    messages_stored: int = 0         # acknowledged by JetStream, in order
    batches: int = 0                 # fast-ingest batches started
    commits: int = 0                 # fast-ingest end-of-batch commits sent
    resends: int = 0                 # messages written again after an outage, timeout or gap
    recoveries: int = 0              # resend cycles
    duplicates_checked: int = 0      # duplicates found to hold this very message (resends)
    duplicate_conflicts: int = 0     # ids found taken by other content; stored again
    last_ack_latency: float | None = None   # seconds from writing a chunk to its last ack
    peak_in_flight_messages: int = 0
    peak_in_flight_bytes: int = 0



# A message as held until it is stored: (subject, header block, payload, message, size). The
# header block ("NATS/1.0\r\nNats-Msg-Id: ...\r\n...\r\n\r\n") is built once at publish()
# so that resends cost no encoding; size = header block + payload, what max_payload limits.
Held = tuple[bytes, bytes, bytes, OutgoingMessage, int]
