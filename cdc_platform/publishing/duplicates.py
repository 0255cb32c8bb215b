"""A duplicate the publisher did not expect: what JetStream holds under a message id, checked.

JetStream drops a message whose ``Nats-Msg-Id`` it stored within the duplicate window and
answers ``duplicate``. For the publisher's own resends (an outage, a timeout, a replay after a
restart) that is the point of the id; but anyone who may publish into the stream can take an
id first, and JetStream would then drop the genuine change for good. So a duplicate is never
taken on trust: the message stored under the id is read back (``STREAM.MSG.GET``) and compared
with the one sent. The same change (:func:`same_change`) counts as stored; different content
is a conflict: one error line, a counter, and the change stored again under an id nobody can
have taken (:func:`replacement_id`). docs/wire-contract.md "Message ids taken by other content" is
the contract.
"""

from __future__ import annotations

import logging
import math
import secrets
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import PubAck, RawStreamMsg
from nats.js.errors import NotFoundError

from cdc_platform.errors import PublishError
from cdc_platform.publishing.framing import parse_header_block
from cdc_platform.publishing.messages import Held, PublishStats
from cdc_platform.wire import HEADER_CLAIM_CHECK, HEADER_MSG_ID, MessageSigner, decode_any

log = logging.getLogger(__name__)

_REPLACEMENTS_LIMIT = 10_000
_WINDOW_SLACK = 1_000   # foreign messages a batch's window may hold before probing is cheaper


def replacement_id(msg_id: str) -> str:
    """``{msg_id}:conflict:{16 random hex}``: random, so no third party can take it first."""
    return f"{msg_id}:conflict:{secrets.token_hex(8)}"


def same_change(subject: bytes, header: bytes, payload: bytes, stored: RawStreamMsg) -> bool:
    """Whether ``stored`` is this message as the bridge publishes it (a resend of it).

    A resend carries the same payload bytes (the held message is sent again; a restarted
    bridge encodes the same change the same way). The payloads are also compared decoded,
    so that an encoding difference alone (say a JSON key order) is no conflict. Headers other
    than the claim check (which says what the payload stands for) are not compared: they may
    be written anew for every send."""
    if stored.subject != subject.decode():
        return False
    claim = parse_header_block(header).get(HEADER_CLAIM_CHECK)
    if claim != (stored.headers or {}).get(HEADER_CLAIM_CHECK):
        return False
    stored_payload = stored.data or b""
    if stored_payload == payload:
        return True
    try:
        return _canonical(decode_any(stored_payload)) == _canonical(decode_any(payload))
    except (ValueError, TypeError, IndexError):  # not a payload of ours at all
        return False


def _canonical(value: Any) -> Any:
    """``value`` comparable with ``==``: maps in key order, NaN equal to NaN."""
    if isinstance(value, dict):
        return sorted((str(key), _canonical(item)) for key, item in value.items())
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return value


class DuplicateChecker:
    """Settles duplicates: compares what is stored, alarms on conflicts and stores again."""

    def __init__(self, js: JetStreamContext, stream: str, stats: PublishStats,
                 signer: MessageSigner | None = None) -> None:
        self._js = js
        self._stream = stream
        self._stats = stats
        self._signer = signer  # a change stored again under another id is signed for it
        # original id -> the id its change was stored again under: a resend of the same
        # message reuses it, so this process never stores one change twice that way
        self._replacements: dict[str, str] = {}

    async def settle(self, held: Held, seq: int) -> None:
        """``held`` was answered ``duplicate`` of stream sequence ``seq``."""
        stored = await self._get(seq)
        if stored is None or not same_change(held[0], held[1], held[2], stored):
            await self._conflict(held, seq)
        else:
            self._stats.duplicates_checked += 1

    async def settle_batch(self, batch: list[Held], after_seq: int | None,
                           last_seq: int) -> None:
        """A fast-ingest batch whose commit moved the stream by other than its size: some of
        its messages were dropped as duplicates (the server does not say which). Its
        messages are looked for in the stream sequences ``(after_seq, last_seq]`` by id;
        one not there is sent again alone, whose PubAck names what holds its id."""
        window: dict[str, RawStreamMsg] = {}
        if after_seq is not None and 0 < last_seq - after_seq <= len(batch) + _WINDOW_SLACK:
            for seq in range(after_seq + 1, last_seq + 1):
                stored = await self._get(seq)
                if stored is not None and stored.headers:
                    window.setdefault(stored.headers.get(HEADER_MSG_ID, ""), stored)
        for held in batch:
            msg_id = held[3].msg_id
            stored = window.get(msg_id)
            if stored is not None:
                if same_change(held[0], held[1], held[2], stored):
                    continue
                await self._conflict(held, stored.seq or 0)
                continue
            ack = await self._store(held, msg_id)
            if ack.duplicate:
                await self.settle(held, ack.seq)

    async def _conflict(self, held: Held, seq: int) -> None:
        subject, msg_id = held[3].subject, held[3].msg_id
        replacement = self._replacements.get(msg_id)
        if replacement is None:
            if len(self._replacements) >= _REPLACEMENTS_LIMIT:
                self._replacements.clear()
            replacement = self._replacements[msg_id] = replacement_id(msg_id)
            self._stats.duplicate_conflicts += 1
            log.error("duplicate conflict on stream %s: Nats-Msg-Id %s on %s is taken by other "
                      "content (stream seq %d), not this change; storing the change as %s",
                      self._stream, msg_id, subject, seq, replacement)
        ack = await self._store(held, replacement)
        if ack.duplicate:   # stored as the replacement before (a resend): check that, too
            stored = await self._get(ack.seq)
            if stored is None or not same_change(held[0], held[1], held[2], stored):
                raise PublishError(f"Nats-Msg-Id {replacement} on {subject} is taken by other "
                                   f"content (stream seq {ack.seq}) as well; stopping")

    async def _store(self, held: Held, msg_id: str) -> PubAck:
        """``held`` published alone under ``msg_id``, awaiting its PubAck."""
        headers = parse_header_block(held[1])
        headers[HEADER_MSG_ID] = msg_id
        subject = held[0].decode()
        if self._signer is not None:  # (the signature binds the id)
            headers = self._signer.signed_headers(subject, headers, held[2])
        return await self._js.publish(subject, held[2], headers=headers)

    async def _get(self, seq: int) -> RawStreamMsg | None:
        try:
            return await self._js.get_msg(self._stream, seq=seq)
        except NotFoundError:   # deleted, or aged out: nothing shows it is this change
            return None
