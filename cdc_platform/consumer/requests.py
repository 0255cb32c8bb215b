"""Snapshot requests, the requester's side (docs/wire-contract.md "Snapshot requests"): publish a
request on ``snapshot.request.{table}`` and wait for its ``done`` reply, saying what happens
meanwhile. A request that joined a run in flight, or one the stream let go in a flood, gets no
``done``: the snapshot is then found in `INIT` (:func:`snapshot_stored_since`). A repair
snapshot of some buckets (``purpose: repair``, docs/verification.md Part 2, item 4) and a
verification of a table (``purpose: verify``) are asked for the same way
(:meth:`SnapshotRequester.request_repair`, :meth:`SnapshotRequester.request_verification`). The
sensor answering requests is ``cdc_platform.snapshot.requests``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from cdc_platform.consumer.snapshots import repair_stored_since, snapshot_stored_since
from cdc_platform.errors import CdcError
from cdc_platform.lsn import format_lsn
from cdc_platform.wire import (
    BUCKET_BITMAP_FIELD,
    REQUEST_BODY_MAX_BYTES,
    SignatureVerifier,
    decode_any,
    encode_bucket_bitmap,
    snapshot_request_subject,
    verify_digest_subject,
)

log = logging.getLogger(__name__)

# while waiting for "done", how often the requester also looks for the snapshot in INIT
LOOK_FOR_SNAPSHOT_SECONDS = 5.0
# JSStreamStoreFailedF: what a full SNAPSHOT_REQUESTS answers ("maximum messages exceeded")
_STREAM_STORE_FAILED = 10077


class SnapshotRequestFailed(CdcError):
    """The request was refused, its snapshot failed, or none came within the wait."""


class AskAgainLater(SnapshotRequestFailed):
    """Refused for now (a repair of the table ran moments ago): ask again after
    ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def repair_request_body(request_id: str, reply_to: str, bits: int,
                        buckets: Sequence[int]) -> bytes:
    """A ``purpose: repair`` request's body: ``buckets`` as a list when the body fits
    ``REQUEST_BODY_MAX_BYTES`` so (every platform reads it), else as ``bucket_bitmap`` (at
    most 2,732 characters at 14 bits: any set fits; platforms before it refuse it)."""
    fields: dict[str, Any] = {"request_id": request_id, "reply_to": reply_to,
                              "purpose": "repair", "bits": bits}
    listed = json.dumps({**fields, "buckets": list(buckets)}).encode()
    if len(listed) <= REQUEST_BODY_MAX_BYTES:
        return listed
    return json.dumps({**fields,
                       BUCKET_BITMAP_FIELD: encode_bucket_bitmap(bits, buckets)}).encode()


@dataclass
class SnapshotRequester:
    """Asks for snapshots on ``nc``/``js``; ``report`` gets what a person watching should
    read (accepted, waiting, the stream full)."""

    nc: NatsClient
    js: JetStreamContext
    requests_stream: str
    init_stream: str
    max_age_seconds: float
    wait_seconds: float
    status_interval_seconds: float
    report: Callable[[str], None]
    verifier: SignatureVerifier | None = None

    async def request(self, table: str, min_lsn: int, relation_id: int | None,
                      stop: asyncio.Event) -> dict[str, Any] | None:
        """The ``done`` reply's fields (or those of the snapshot found in `INIT`) of a
        snapshot of ``table`` with a cutover LSN of at least ``min_lsn``, of the table with
        oid ``relation_id`` when known; None: ``stop`` was set first."""
        inbox = self.nc.new_inbox()
        replies: asyncio.Queue = asyncio.Queue()
        subscription = await self.nc.subscribe(inbox, cb=replies.put)
        request_id = secrets.token_hex(8)
        try:
            body: dict[str, Any] = {"request_id": request_id, "reply_to": inbox,
                                    "max_age_seconds": self.max_age_seconds}
            if min_lsn:
                body["min_lsn"] = format_lsn(min_lsn)
            asked_after = (await self.js.stream_info(self.init_stream)).state.last_seq
            started = time.monotonic()
            if not await self._publish(table, json.dumps(body).encode(), started, stop):
                return None
            self.report(f"{table}: requested a snapshot (request {request_id})")
            return await self._wait(table, request_id, inbox, replies, partial(
                snapshot_stored_since, self.js, table, asked_after, self.init_stream, min_lsn,
                relation_id=relation_id, verifier=self.verifier), started, stop)
        finally:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def request_repair(self, table: str, bits: int, buckets: Sequence[int],
                             stop: asyncio.Event) -> dict[str, Any] | None:
        """The ``done`` reply's fields of a repair snapshot of ``buckets`` (at ``bits``) of
        ``table``: its meta is on ``init.repair.{table}`` (read it with
        ``consumer.snapshots.repair_meta_at``); None: ``stop`` was set first. Refused for
        now (a repair of the table ran moments ago): asked again after ``retry_after``
        while within ``wait_seconds``; any other refusal or a failure is
        :class:`SnapshotRequestFailed`."""
        def body_for(request_id: str, inbox: str) -> bytes:
            body = repair_request_body(request_id, inbox, bits, buckets)
            if len(body) > REQUEST_BODY_MAX_BYTES:  # (nats-server refuses it past 8 KB)
                raise SnapshotRequestFailed(
                    f"{table}: {len(buckets)} buckets at {bits} bits do not fit in a "
                    f"repair request ({len(body):,} bytes, over the "
                    f"{REQUEST_BODY_MAX_BYTES:,}-byte limit)")
            return body

        return await self._ask_until_answered(
            table, body_for, f"a repair of {len(buckets)} of {1 << bits} buckets",
            self.init_stream, lambda asked_after: partial(
                repair_stored_since, self.js, table, asked_after, bits, buckets,
                self.init_stream, verifier=self.verifier), stop)

    async def request_verification(self, table: str, bits: int | None, cdc_stream: str,
                                   stop: asyncio.Event) -> dict[str, Any] | None:
        """The ``done`` reply's fields of a verification of ``table`` (``bits``: None, the
        platform's choice): ``verification_id``, ``lsn``, ``digest_subject``, ``digest_seq``,
        ``bits``, ``row_count``. A digest message of the table stored in ``cdc_stream`` after
        the request is taken as well (the reply may never come: more requesters than a run
        replies to). None: ``stop`` was set first. Refused for now (``retry_after``): asked
        again while within ``wait_seconds``; any other refusal or a failure is
        :class:`SnapshotRequestFailed`."""
        def body_for(request_id: str, inbox: str) -> bytes:
            body: dict[str, Any] = {"request_id": request_id, "reply_to": inbox,
                                    "purpose": "verify"}
            if bits is not None:
                body["bits"] = bits
            return json.dumps(body).encode()

        return await self._ask_until_answered(
            table, body_for, "a verification", cdc_stream, lambda asked_after: partial(
                digest_stored_since, self.js, table, asked_after, cdc_stream,
                verifier=self.verifier), stop, what="verification")

    async def _ask_until_answered(
            self, table: str, body_for: Callable[[str, str], bytes], asked: str,
            stored_in: str,
            stored_since: Callable[[int], Callable[[], Awaitable[dict[str, Any] | None]]],
            stop: asyncio.Event, *, what: str = "snapshot") -> dict[str, Any] | None:
        """Ask (``body_for(request_id, inbox)``) and wait for the answer, or for what
        ``stored_since(last sequence of stored_in when asked)`` finds; a refusal for now
        (``retry_after``) is asked again after it while within ``wait_seconds``."""
        started = time.monotonic()
        while not stop.is_set():
            inbox = self.nc.new_inbox()
            replies: asyncio.Queue = asyncio.Queue()
            subscription = await self.nc.subscribe(inbox, cb=replies.put)
            request_id = secrets.token_hex(8)
            try:
                body = body_for(request_id, inbox)
                asked_after = (await self.js.stream_info(stored_in)).state.last_seq
                if not await self._publish(table, body, started, stop):
                    return None
                self.report(f"{table}: requested {asked} (request {request_id})")
                return await self._wait(table, request_id, inbox, replies,
                                        stored_since(asked_after), started, stop, what=what)
            except AskAgainLater as exc:
                if time.monotonic() - started + exc.retry_after > self.wait_seconds:
                    raise
                self.report(f"{exc}; asking again in {exc.retry_after:.0f}s")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(exc.retry_after):
                        await stop.wait()
            finally:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
        return None

    async def _wait(self, table: str, request_id: str, inbox: str, replies: asyncio.Queue,
                    stored_since: Callable[[], Awaitable[dict[str, Any] | None]],
                    started: float, stop: asyncio.Event, *, what: str = "snapshot"
                    ) -> dict[str, Any] | None:
        """The ``done`` reply to ``request_id`` on ``inbox``, or what ``stored_since`` finds
        meanwhile (the reply may never come); None: ``stop`` was set first. ``what`` is
        asked for (``snapshot``, ``verification``): the messages say it."""
        last_report = last_look = time.monotonic()
        while not stop.is_set():
            try:
                async with asyncio.timeout(1.0):
                    message = await replies.get()
            except TimeoutError:
                now = time.monotonic()
                if now - last_look >= LOOK_FOR_SNAPSHOT_SECONDS:
                    last_look = now
                    found = await stored_since()
                    if found is not None:
                        return found
                if now - started > self.wait_seconds:
                    raise SnapshotRequestFailed(
                        f"{table}: no {what} within {self.wait_seconds:.0f}s of the request: "
                        "is the snapshot request sensor running (the Dagster daemon)?") from None
                if now - last_report >= self.status_interval_seconds:
                    last_report = now
                    self.report(f"{table}: waiting for the {what} ({now - started:.0f}s)")
                continue
            try:
                reply = json.loads(message.data)
                status = reply["status"]
            except (ValueError, KeyError, TypeError):
                log.warning("%s: ignored an unreadable reply on %s", table, inbox)
                continue
            if reply.get("request_id") != request_id:
                continue
            if status == "accepted":
                self.report(f"{table}: {what} request accepted (run key {reply.get('run_key')})")
            elif status == "refused":
                refusal = f"{table}: {what} request refused: {reply.get('reason')}"
                retry_after = reply.get("retry_after")
                if isinstance(retry_after, (int, float)) and 0 < retry_after <= 3600:
                    raise AskAgainLater(refusal, float(retry_after))
                raise SnapshotRequestFailed(refusal)
            elif status == "failed":
                raise SnapshotRequestFailed(f"{table}: the {what} failed: "
                                            f"{reply.get('reason')}")
            elif status == "done":
                return reply
        return None

    async def _publish(self, table: str, body: bytes, started: float,
                       stop: asyncio.Event) -> bool:
        """Publish the request, asking again every few seconds while the stream is full (a
        flood: docs/wire-contract.md "Floods"); False: stopped first."""
        stream = self.requests_stream
        while not stop.is_set():
            try:
                await self.js.publish(snapshot_request_subject(table), body, stream=stream)
                return True
            except APIError as exc:
                if exc.err_code != _STREAM_STORE_FAILED:
                    raise
                if time.monotonic() - started > self.wait_seconds:
                    raise SnapshotRequestFailed(
                        f"{table}: {stream} refused the snapshot request for "
                        f"{self.wait_seconds:.0f}s: {exc.description}") from None
                self.report(f"{table}: {stream} refused the snapshot request "
                            f"({exc.description}: full, a flood?); asking again in "
                            f"{LOOK_FOR_SNAPSHOT_SECONDS:.0f}s")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LOOK_FOR_SNAPSHOT_SECONDS):
                        await stop.wait()
        return False


async def digest_stored_since(js: JetStreamContext, table: str, asked_after_seq: int,
                              cdc_stream: str = "CDC", *,
                              verifier: SignatureVerifier | None = None
                              ) -> dict[str, Any] | None:
    """The ``done`` fields of the newest verification digest message of ``table`` if it was
    stored in ``cdc_stream`` after the request was made (sequence above ``asked_after_seq``)
    and ``verifier`` (if any) takes it: a verification the platform made since, which is what
    a requester whose ``done`` got lost finds instead."""
    try:
        message = await js.get_last_msg(cdc_stream, verify_digest_subject(table, "*"))
    except (NotFoundError, NatsError, TimeoutError):
        return None
    if message.seq is None or message.seq <= asked_after_seq:
        return None
    subject, data = message.subject or "", message.data or b""
    if verifier is not None and verifier.refusal(subject, message.headers or {}, data):
        return None
    try:
        payload = decode_any(data)
    except ValueError:
        return None
    if not isinstance(payload, dict) or payload.get("type") != "digest" \
            or payload.get("table") != table:
        return None
    return {"verification_id": payload.get("verification_id"), "lsn": payload.get("lsn"),
            "digest_subject": subject, "digest_seq": message.seq,
            "bits": payload.get("bits"), "row_count": payload.get("row_count")}
