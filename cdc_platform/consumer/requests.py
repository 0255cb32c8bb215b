"""Snapshot requests, the requester's side (docs/wire-contract.md "Snapshot requests"): publish a
request on ``snapshot.request.{table}`` and wait for its ``done`` reply, saying what happens
meanwhile. A request that joined a run in flight, or one the stream let go in a flood, gets no
``done``: the snapshot is then found in `INIT` (:func:`snapshot_stored_since`). A repair
snapshot of some buckets (``purpose: repair``, docs/verification.md Part 2, item 4) is asked for
the same way (:meth:`SnapshotRequester.request_repair`). The sensor answering requests is
``cdc_platform.snapshot.requests``."""

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
from nats.js import JetStreamContext
from nats.js.errors import APIError

from cdc_platform.consumer.snapshots import repair_stored_since, snapshot_stored_since
from cdc_platform.errors import CdcError
from cdc_platform.lsn import format_lsn
from cdc_platform.wire import REQUEST_BODY_MAX_BYTES, SignatureVerifier, snapshot_request_subject

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
        started = time.monotonic()
        while not stop.is_set():
            inbox = self.nc.new_inbox()
            replies: asyncio.Queue = asyncio.Queue()
            subscription = await self.nc.subscribe(inbox, cb=replies.put)
            request_id = secrets.token_hex(8)
            try:
                body = json.dumps({"request_id": request_id, "reply_to": inbox,
                                   "purpose": "repair", "bits": bits,
                                   "buckets": list(buckets)}).encode()
                if len(body) > REQUEST_BODY_MAX_BYTES:  # (nats-server refuses it past 8 KB)
                    raise SnapshotRequestFailed(
                        f"{table}: {len(buckets)} buckets do not fit in a repair request "
                        f"({len(body):,} bytes, over the {REQUEST_BODY_MAX_BYTES:,}-byte "
                        "limit)")
                asked_after = (await self.js.stream_info(self.init_stream)).state.last_seq
                if not await self._publish(table, body, started, stop):
                    return None
                self.report(f"{table}: requested a repair of {len(buckets)} of "
                            f"{1 << bits} buckets (request {request_id})")
                return await self._wait(table, request_id, inbox, replies, partial(
                    repair_stored_since, self.js, table, asked_after, bits, buckets,
                    self.init_stream, verifier=self.verifier), started, stop)
            except AskAgainLater as exc:
                if time.monotonic() - started + exc.retry_after > self.wait_seconds:
                    raise
                self.report(f"{exc}; asking again in {exc.retry_after:.0f}s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), exc.retry_after)
            finally:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
        return None

    async def _wait(self, table: str, request_id: str, inbox: str, replies: asyncio.Queue,
                    stored_since: Callable[[], Awaitable[dict[str, Any] | None]],
                    started: float, stop: asyncio.Event) -> dict[str, Any] | None:
        """The ``done`` reply to ``request_id`` on ``inbox``, or what ``stored_since`` finds
        in `INIT` meanwhile (the reply may never come); None: ``stop`` was set first."""
        last_report = last_look = time.monotonic()
        while not stop.is_set():
            try:
                message = await asyncio.wait_for(replies.get(), 1.0)
            except TimeoutError:
                now = time.monotonic()
                if now - last_look >= LOOK_FOR_SNAPSHOT_SECONDS:
                    last_look = now
                    found = await stored_since()
                    if found is not None:
                        return found
                if now - started > self.wait_seconds:
                    raise SnapshotRequestFailed(
                        f"{table}: no snapshot within {self.wait_seconds:.0f}s of the request: "
                        "is the snapshot request sensor running (the Dagster daemon)?") from None
                if now - last_report >= self.status_interval_seconds:
                    last_report = now
                    self.report(f"{table}: waiting for the snapshot ({now - started:.0f}s)")
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
                self.report(f"{table}: snapshot request accepted (run key {reply.get('run_key')})")
            elif status == "refused":
                refusal = f"{table}: snapshot request refused: {reply.get('reason')}"
                retry_after = reply.get("retry_after")
                if isinstance(retry_after, (int, float)) and 0 < retry_after <= 3600:
                    raise AskAgainLater(refusal, float(retry_after))
                raise SnapshotRequestFailed(refusal)
            elif status == "failed":
                raise SnapshotRequestFailed(f"{table}: the snapshot failed: "
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
                    await asyncio.wait_for(stop.wait(), LOOK_FOR_SNAPSHOT_SECONDS)
        return False
