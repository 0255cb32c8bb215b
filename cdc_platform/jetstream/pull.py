"""A JetStream pull consumer read at the protocol level (ADR-13 pull requests), for the
mirror's follow loop.

nats-py's ``fetch`` costs about 60 µs of CPU per message here (a parsed header dict, a ``Msg``
object, a queue hop and an ``asyncio.wait_for`` for each one), which held a mirror at ~13K
events/s against a bridge publishing 70K+. This reader keeps nats-py for everything else
(connection, auth, TLS, reconnects, the JetStream API) and only takes the messages delivered to
its own inbox before nats-py builds them: ~6 µs per message.

How it works: one subscription on ``{inbox}.*``; each pull request (``$JS.API.CONSUMER.MSG.
NEXT.{stream}.{consumer}``, payload ``{"batch": n, "expires": ns}``) replies to its own
``{inbox}.{n}``, so a status message (404/408/409, subject = that reply subject) ends exactly
the request it belongs to. Requests are kept ahead of the reader (up to twice ``batch`` messages
asked for) so the server streams while the caller works. The server serves pull requests first
come first served, so a delivered message counts against the oldest open request.

Messages reach the reader without nats-py's parser: :class:`~cdc_platform.jetstream.frames.
FrameReader` takes the place of nats-py's (private) parser and hands this reader's frames
straight to it (measured reading 200K changes: ~10 µs of CPU per message with nats-py's parser,
~5.5 µs with this one); a frame nats-py's parser still reads (one it held half of when the
reader took over) reaches it through a hook on nats-py's (private) message handler, and one
that gets past both, through the subscription's own callback (slower, the same result): see
:func:`_install_hook` and ``jetstream/nats_internals.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from cdc_platform.errors import CdcError
from cdc_platform.jetstream.frames import FrameReader
from cdc_platform.jetstream.nats_internals import (
    Sink,
    route_messages,
    subscription_sid,
    swap_parser,
)
from cdc_platform.speedups import compiled_twin


class PullConsumerGone(CdcError):
    """The pull requests can no longer be served (the consumer was deleted, NATS reconnected
    and the requests died with the old connection, a leadership change): open a new one."""


class PulledMessage:
    """One stored message as delivered: its subject, stream sequence, payload and headers
    (parsed when first read: most callers only ask whether one is there)."""

    __slots__ = ("_headers", "data", "raw_headers", "raw_reply", "stream_seq", "subject")

    def __init__(self, subject: str, stream_seq: int, data: bytes, raw_headers: bytes | None,
                 raw_reply: bytes) -> None:
        self.subject = subject
        self.stream_seq = stream_seq
        self.data = data
        self.raw_headers = raw_headers
        self.raw_reply = raw_reply
        self._headers: dict[str, str] | None = None

    @property
    def reply(self) -> str:
        """The ack subject (decoded when asked for: most messages are never acked)."""
        return self.raw_reply.decode()

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:
            self._headers = _parse_headers(self.raw_headers)[2] if self.raw_headers else {}
        return self._headers

    def has_header(self, name: str) -> bool:
        """Whether header ``name`` is set (without parsing the others)."""
        encoded = _ENCODED_NAMES.get(name)
        if encoded is None:
            encoded = _ENCODED_NAMES[name] = name.encode()
        # (find, not ``in``: CPython 3.11's ``bytes in bytes`` first tries the operand as an
        # integer and formats a TypeError it then drops, ~2K instructions a message)
        if self.raw_headers is None or self.raw_headers.find(encoded) < 0:
            return False
        return name in self.headers


_ENCODED_NAMES: dict[str, bytes] = {}


# 409s that end one request only (404: none now, 408: expired); the next one is asked
_REQUEST_ENDED = frozenset({"message size exceeds maxbytes", "exceeded maxwaiting",
                            "batch completed"})

_SINKS_ATTRIBUTE = "_cdc_platform_pull_sinks"


def _install_hook(client: NatsClient) -> dict[int, Sink]:
    """The per-client table of subscription id -> sink, with what feeds it (installed once
    per client). The frame reader calls the sink of a frame's sid directly; nats-py's parser,
    where it still reads, hands every MSG/HMSG to its message handler, and the hook there
    sends our sids' raw parts to the sink. Either way nats-py's header parsing, ``Msg`` and
    queue are skipped."""
    sinks: dict[int, Sink] | None = getattr(client, _SINKS_ATTRIBUTE, None)
    if sinks is not None:
        return sinks
    sinks = {}
    setattr(client, _SINKS_ATTRIBUTE, sinks)
    process_msg = route_messages(client, sinks)
    swap_parser(client, lambda parser: FrameReader(process_msg, parser, sinks))
    return sinks


def sequences_python(reply: bytes) -> tuple[int, int]:
    """(stream sequence, consumer sequence) from a ``$JS.ACK`` reply subject (ADR-15: the v1
    form has 9 tokens, the v2 form adds a domain and an account hash before the stream)."""
    tokens = reply.split(b".")
    first = 5 if len(tokens) == 9 else 7
    return int(tokens[first]), int(tokens[first + 1])


#: :func:`sequences_python`, or its compiled twin (the same answer, or the same error).
sequences: Callable[[bytes], tuple[int, int]] = sequences_python


def _parse_headers(raw: bytes) -> tuple[int, str, dict[str, str]]:
    """``NATS/1.0[ code description]\\r\\nName: value\\r\\n...`` -> (code, description,
    headers); code 0 for a stored message's headers."""
    lines = raw.decode("utf-8", "replace").split("\r\n")
    status = lines[0][8:].strip()  # after "NATS/1.0"
    code, _, description = status.partition(" ")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip()] = value.strip()
    return (int(code) if code.isdigit() else 0), description, headers


class PullReader:
    """Messages of one existing pull consumer, in stream order.

    ``await reader.start()``, then ``await reader.fetch(limit, timeout)`` returns what has
    arrived (at most ``limit``, at least one unless ``timeout`` passed); ``await reader.stop()``.
    Raises :class:`PullConsumerGone` when the requests can no longer be served.
    """

    def __init__(self, client: NatsClient, stream: str, consumer: str, *,
                 batch: int = 512, max_bytes: int = 16 << 20) -> None:
        self.client = client
        self.stream = stream
        self.consumer = consumer
        self.batch = batch
        # bounds what two open requests can hold; one message of max_payload always fits
        self.max_bytes = max(max_bytes, 2 * (client.max_payload or 0))
        # the consumer sequence of the newest message received (ConsumerInfo.delivered's
        # consumer_seq beyond it: messages still on their way)
        self.received_consumer_seq = 0
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = client.new_inbox()
        self._received: collections.deque[PulledMessage] = collections.deque()
        self._arrived = asyncio.Event()
        self._open: collections.deque[list[Any]] = collections.deque()  # [token, remaining]
        self._request_number = 0
        self._failure: str | None = None
        self._subscription: Any = None
        self._sid = -1
        self._reconnects = 0

    async def start(self) -> None:
        self._reconnects = self.client.stats["reconnects"]
        # the callback only runs when the hook did not take the message (see module doc)
        self._subscription = await self.client.subscribe(f"{self._inbox}.*", cb=self._on_msg)
        self._sid = subscription_sid(self._subscription)
        _install_hook(self.client)[self._sid] = self._on_raw

    async def stop(self) -> None:
        sinks = getattr(self.client, _SINKS_ATTRIBUTE, {})
        sinks.pop(self._sid, None)
        if self._subscription is not None:
            try:
                await self._subscription.unsubscribe()
            except Exception:  # noqa: BLE001, S110 - the connection is already gone
                pass
            self._subscription = None

    async def ack(self, message: PulledMessage) -> None:
        """Acknowledge ``message`` (with AckPolicy.ALL: every message before it too)."""
        await self.client.publish(message.reply, b"+ACK")

    async def fetch(self, limit: int, timeout: float) -> list[PulledMessage]:
        deadline = time.monotonic() + timeout
        while not self._received:
            self._check()
            await self._ask(expires=max(timeout, 1.0))
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._arrived.wait()
        self._check()
        count = min(limit, len(self._received))
        taken = [self._received.popleft() for _ in range(count)]
        await self._ask(expires=max(timeout, 1.0))
        return taken

    def unread(self, delivered_consumer_seq: int) -> int:
        """Messages the server delivered (``ConsumerInfo.delivered.consumer_seq``) that the
        caller has not had yet: buffered here, or still on their way."""
        return len(self._received) + max(0, delivered_consumer_seq - self.received_consumer_seq)

    def _check(self) -> None:
        if self._failure is not None:
            raise PullConsumerGone(self._failure)
        if self.client.is_closed:
            raise PullConsumerGone("the NATS connection is closed")
        if self.client.stats["reconnects"] != self._reconnects:
            # pull requests live on the connection that sent them
            raise PullConsumerGone("NATS reconnected; the pull requests went with the old "
                                   "connection")

    async def _ask(self, expires: float) -> None:
        """Keep up to two batches asked for (the server streams while the caller works)."""
        if sum(remaining for _, remaining in self._open) >= self.batch:
            return
        self._request_number += 1
        token = str(self._request_number).encode()
        self._open.append([token, self.batch])
        request = json.dumps({"batch": self.batch, "max_bytes": self.max_bytes,
                              "expires": int(expires * 1e9)}).encode()
        await self.client.publish(self._next_subject, request,
                                  reply=f"{self._inbox}.{token.decode()}")

    def _on_raw(self, subject: bytes, reply: bytes, data: bytes,
                headers: bytes | None) -> None:
        if not reply.startswith(b"$JS.ACK."):  # a status for one of our requests (subject =
            code, description, _ = _parse_headers(headers or b"NATS/1.0")  # its reply subject)
            self._status(subject.rpartition(b".")[2], code, description)
            return
        stream_seq, consumer_seq = sequences(reply)
        self.received_consumer_seq = consumer_seq
        self._received.append(PulledMessage(subject.decode(), stream_seq, data, headers,
                                            reply))
        if self._open:
            head = self._open[0]
            head[1] -= 1
            if head[1] == 0:
                self._open.popleft()
        self._arrived.set()

    def _status(self, token: bytes, code: int, description: str) -> None:
        if code == 100:  # an idle heartbeat (not asked for here)
            return
        for request in self._open:
            if request[0] == token:
                self._open.remove(request)
                break
        if code not in (404, 408) and description.lower() not in _REQUEST_ENDED:
            # the consumer is gone or moved (deleted, leader change, server shutdown), or
            # the server refuses such requests: a new consumer, not another request
            self._failure = (f"pull requests on {self.stream}/{self.consumer} ended: "
                             f"{code} {description}".strip())
        self._arrived.set()

    async def _on_msg(self, message: Msg) -> None:
        """nats-py delivered a message the hook did not take (see module doc)."""
        raw = b"NATS/1.0\r\n" + b"".join(
            f"{name}: {value}\r\n".encode() for name, value in (message.headers or {}).items())
        if not message.reply and message.headers and "Status" in message.headers:
            raw = (f"NATS/1.0 {message.headers['Status']} "
                   f"{message.headers.get('Description', '')}\r\n").encode()
        self._on_raw(message.subject.encode(), message.reply.encode(), message.data, raw)


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.jetstream import pull as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    sequences = _twin.sequences
