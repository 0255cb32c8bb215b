"""The CDC bridge: slot -> typed events -> JetStream, acking PostgreSQL only what is stored.

One asyncio task reads the slot, builds messages and hands them to the publisher; the LSN
confirmed to PostgreSQL is always the publisher's ``stored_position`` (the end LSN of the
last transaction whose every message, and every earlier message, JetStream acknowledged).
Side tasks emit heartbeats (so an idle slot still advances), watch the slot's lag, and log a
METRICS line. PostgreSQL going away -> reconnect with backoff and resume from the slot; NATS
going away -> the publisher holds and resends, the reader stops reading (bounded memory) but
keeps answering the server, so nothing times out and nothing is lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import psycopg
from nats.js.api import RawStreamMsg
from nats.js.errors import NotFoundError

from cdc_platform.bridge.events import BuiltBatch, MessageBuilder
from cdc_platform.bridge.shapes import (
    AnnouncedShape,
    resolve_shape,
    storage_unsettled,
    truncates_of,
)
from cdc_platform.errors import (
    CdcError,
    NatsUnreachable,
    ReplicationConfigError,
    ReplicationError,
    SlotLostError,
)
from cdc_platform.jetstream.connection import close_nats, connect_nats
from cdc_platform.jetstream.kv import put_value
from cdc_platform.lsn import format_lsn, parse_lsn
from cdc_platform.naming import wire_name
from cdc_platform.postgres.catalog import (
    TableSchema,
    published_relation_ids_async,
    published_tables_async,
    table_schema_async,
)
from cdc_platform.protocol.changes import ChangeRecord
from cdc_platform.protocol.pgoutput import Relation
from cdc_platform.publishing.claim_check import ClaimChecks
from cdc_platform.publishing.messages import OutgoingMessage
from cdc_platform.publishing.publisher import JetStreamPublisher
from cdc_platform.publishing.schemas import keeping_storage, schema_entry, stored_schema
from cdc_platform.replication.reader import SlotReader
from cdc_platform.replication.slots import WAL_STATUS_LEVELS, read_slot_async, slot_alerts
from cdc_platform.settings import PlatformSettings
from cdc_platform.telemetry import BridgeMetrics, TelemetryServer
from cdc_platform.wire import (
    CONTROL_EOB_SUBJECT,
    HEARTBEAT_PREFIX,
    MessageSigner,
    ResyncMarker,
    cdc_schema_subject,
    cdc_table_subjects,
    commit_ts_epoch,
    decode_any,
    encoder,
    in_field_order,
    resync_msg_id,
    resync_subject,
)

log = logging.getLogger(__name__)

Observer = Callable[[dict[str, Any]], None]
T = TypeVar("T")
# What the final acknowledgement and closing may take of the shutdown budget, at most.
_CLOSING_SECONDS = 2.0
_EXIT_SECONDS = 0.25  # of which, stopping the telemetry server and the process exiting
_SLOT_RETRY_SECONDS = 1.0  # the first slot check, while the slot does not exist yet
# how long the bridge may read on to tell a TRUNCATE from a rewrite (docs/wire-contract.md "Schema
# changes")
_READ_AHEAD_SECONDS = 5.0


class StopRequested(Exception):
    """A wait given up because a stop was requested (what it was for is not done)."""


class CdcBridge:
    def __init__(self, settings: PlatformSettings, *, metrics: BridgeMetrics | None = None,
                 observer: Observer | None = None, observe_interval: float = 30.0) -> None:
        self.settings = settings
        self.options = settings.bridge
        self.metrics = metrics or BridgeMetrics()
        self.observer = observer
        self.observe_interval = observe_interval
        self.builder = MessageBuilder(settings.encoding.format, self.options.message_mode,
                                      self.options.batch_max_events)
        self.encode = encoder(settings.encoding.format)
        self.stop_requested = asyncio.Event()
        self._stop_deadline = float("inf")  # monotonic: CDC_SHUTDOWN_TIMEOUT after the stop
        self.fatal: BaseException | None = None
        self.reader: SlotReader | None = None
        self.publisher: JetStreamPublisher | None = None
        self._conflicts_counted = 0   # the publisher's duplicate conflicts in the metrics
        self._reading_task: asyncio.Task | None = None  # the one that reads the slot
        self._kv = None
        self._signer: MessageSigner | None = None  # KV values are signed too
        self._claim_checks: ClaimChecks | None = None
        # table -> (fingerprint, relation id, storage) of the schema put in KV: a table dropped
        # and created again under its name, even of the same shape, is another table
        self._published: dict[str, tuple[str, int, int]] = {}
        self._announced: dict[str, AnnouncedShape | None] = {}  # table -> last schema event
        # tables this replication session has read past what the stream held of them (the
        # changes after are not replays: see _replayed)
        self._past_replay: set[str] = set()
        # table -> its shape when this process first published it: what consumers follow
        # until its first schema event (its storage is the rewrite check's first baseline)
        self._published_shapes: dict[str, AnnouncedShape] = {}
        self._js = None
        # (position, published at (monotonic), committed at (epoch)) per published batch
        self._timings: collections.deque = collections.deque(maxlen=100_000)
        self.telemetry: TelemetryServer | None = None

    def request_stop(self) -> None:
        """Graceful stop, called in the bridge's loop (signal handler, HTTP admin, Dagster):
        everything after it (drain, final ack, closing) fits in CDC_SHUTDOWN_TIMEOUT."""
        if not self.stop_requested.is_set():
            budget = self.options.shutdown_timeout_seconds
            self._stop_deadline = time.monotonic() + budget
            log.info("stop requested: draining what is in flight, then the final "
                     "acknowledgement (at most %gs)", budget)
        self.stop_requested.set()

    def _shutdown_left(self, at_most: float = float("inf")) -> float:
        """Seconds left of the shutdown budget (all of ``at_most`` before a stop)."""
        return max(0.0, min(at_most, self._stop_deadline - time.monotonic()))

    def _drain_left(self) -> float:
        """Seconds left to wait for NATS in a stop: the budget less what the final
        acknowledgement and closing take (``_CLOSING_SECONDS``, a quarter of a small budget)."""
        reserve = min(_CLOSING_SECONDS, self.options.shutdown_timeout_seconds / 4)
        return max(0.0, self._stop_deadline - reserve - time.monotonic())

    async def _unless_stopped(self, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result; :class:`StopRequested` once a stop is requested first (it
        is cancelled then, or not started)."""
        task = asyncio.ensure_future(awaitable)
        if self.stop_requested.is_set():
            task.cancel()
        else:
            stop = asyncio.ensure_future(self.stop_requested.wait())
            try:
                await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                if not task.done():
                    task.cancel()
        if task.cancelled() or not task.done():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise StopRequested
        return task.result()

    async def _stoppable_sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.stop_requested.wait()

    async def _connect_nats(self):
        """The NATS connection, waiting for NATS with backoff (one line per attempt) until a
        stop is requested (None then); refused credentials are fatal at once."""
        delay = self.options.reconnect_min_seconds
        while not self.stop_requested.is_set():
            try:
                return await self._unless_stopped(connect_nats(
                    self.settings.nats, name="cdc-platform-bridge", reconnect_forever=True,
                    on_disconnect=self._nats_disconnected, on_reconnect=self._nats_reconnected))
            except StopRequested:
                return None
            except NatsUnreachable as exc:
                if self.stop_requested.is_set():
                    return None
                log.warning("%s; retrying in %.0fs", exc, delay)
            await self._stoppable_sleep(delay)
            delay = min(delay * 2, self.options.reconnect_max_seconds)
        return None

    # -- top level -------------------------------------------------------------------------
    async def run(self) -> None:
        """Stream until :meth:`request_stop`; raises on a fatal error (bad config, lost slot)."""
        nc = await self._connect_nats()
        if nc is None:
            log.info("bridge stopped before NATS could be reached")
            return
        self.metrics.nats_connected.set(1)
        loop = asyncio.get_running_loop()
        if self.options.http_port:
            token = self.options.admin_token
            self.telemetry = TelemetryServer(
                self.metrics, host=self.options.http_host, port=self.options.http_port,
                admin_token=token.get_secret_value() if token else None,
                on_shutdown=self._stop_from(loop), loop=loop)
            self.telemetry.start()
            log.info("telemetry on http://%s:%s/metrics", self.options.http_host,
                     self.telemetry.port)
        side_tasks: list[asyncio.Task] = []
        try:
            js = self._js = nc.jetstream()
            stream = self.settings.topology.cdc.name
            try:
                await js.stream_info(stream)
                self._kv = await js.key_value(self.settings.topology.schemas.bucket)
            except NotFoundError:
                raise CdcError(f"JetStream stream {stream} or KV bucket "
                               f"{self.settings.topology.schemas.bucket} is missing: run "
                               "`cdc-platform provision` first") from None
            signer = self._signer = self.options.signer()
            if signer is not None:
                log.info("signing every message with key %s", signer.public_key)
            self.publisher = JetStreamPublisher(
                nc, stream=stream, mode=self.options.publish_mode,
                max_in_flight_messages=self.options.max_in_flight_messages,
                max_in_flight_bytes=self.options.max_in_flight_bytes,
                control_subject=CONTROL_EOB_SUBJECT, signer=signer)
            self._conflicts_counted = 0
            await self.publisher.start()
            self._claim_checks = ClaimChecks(js, self.settings.topology.large.bucket,
                                             self.settings.encoding.format)
            side_tasks = [asyncio.create_task(coro, name=name) for name, coro in (
                ("heartbeat", self._heartbeat_loop()),
                ("lag-monitor", self._lag_loop()),
                ("metrics-log", self._metrics_log_loop()),
                ("publication-watch", self._publication_watch_loop()),
            )]
            await self._replicate_with_reconnects()
            log.info("bridge stopped; confirmed LSN %s", format_lsn(self.metrics.confirmed_lsn))
        finally:
            for task in side_tasks:
                task.cancel()
            for task in side_tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if self.publisher is not None:
                with contextlib.suppress(Exception):  # (a stop drained it already)
                    await self.publisher.close(timeout=min(5.0, self._drain_left()))
            # what is left of a stop's budget, less the moment the process takes to exit
            await close_nats(nc, max(0.0, self._shutdown_left(2.0) - _EXIT_SECONDS))
            if self.telemetry is not None:
                self.telemetry.stop()
        if self.fatal is not None:
            raise self.fatal

    def _stop_from(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
        """``request_stop`` as called from another thread (the telemetry server's)."""
        def stop() -> None:
            loop.call_soon_threadsafe(self.request_stop)
        return stop

    async def _nats_disconnected(self) -> None:
        self.metrics.nats_connected.set(0)
        if self.publisher is not None:
            self.publisher.connection_changed()

    async def _nats_reconnected(self) -> None:
        self.metrics.nats_connected.set(1)
        self.metrics.nats_reconnects.inc()
        if self.publisher is not None:
            self.publisher.connection_changed()

    async def _replicate_with_reconnects(self) -> None:
        self._reading_task = asyncio.current_task()
        delay = self.options.reconnect_min_seconds
        ever_streamed = False
        lost: SlotLostError | None = None  # CDC_ON_SLOT_LOST=resync: resync once closed
        while not self.stop_requested.is_set():
            reader = SlotReader(self.settings.postgres,
                                status_interval=self.options.status_interval_seconds)
            self.reader = reader
            try:
                await self._unless_stopped(reader.open())
                ever_streamed = True
                delay = self.options.reconnect_min_seconds
                self.metrics.connected.set(1)
                self.metrics.slot_active.set(1)
                await self._publish_all_schemas(reader)
                self.builder.reset()  # the server resends from the last confirmed commit
                await self._stream(reader)
            except StopRequested:
                pass  # stopped while connecting or reading a schema
            except SlotLostError as exc:
                if self.options.on_slot_lost != "resync":
                    raise  # retrying cannot fix it: say what to do
                lost = exc
            except ReplicationConfigError:
                raise  # retrying cannot fix it: say what to do
            except (ReplicationError, psycopg.OperationalError, OSError) as exc:
                if ever_streamed:
                    self.metrics.reconnects.inc()
                log.warning("PostgreSQL %s (%s); %s in %.1fs",
                            "connection lost" if ever_streamed else "unreachable",
                            str(exc).strip() or type(exc).__name__,
                            "reconnecting" if ever_streamed else "retrying", delay)
            finally:
                self.metrics.connected.set(0)
                self.metrics.slot_active.set(0)
                await self._close_reader(reader)
                self.reader = None
            if lost is not None:
                await self._resync(lost)
                lost = None
                continue
            if not self.stop_requested.is_set():
                await self._stoppable_sleep(delay * (0.8 + 0.4 * random.random()))
                delay = min(delay * 2, self.options.reconnect_max_seconds)

    async def _resync(self, lost: SlotLostError) -> None:
        """``CDC_ON_SLOT_LOST=resync``: store a resync marker in CDC (the stream is whole up to
        the lost slot's confirmed position), then drop the slot; the next open creates a new
        one. The marker is stored before the slot is dropped, so a bridge killed in between
        finds the lost slot again and marks again (same message id), and nothing from a new
        slot can precede it. Consumers repair what the gap took by verification
        (docs/verification.md "Item 6")."""
        assert self.publisher is not None
        slot = self.settings.postgres.slot
        async with await self._sql_connection() as conn:
            state = await read_slot_async(conn, slot)
            lost_after = (state.confirmed_flush_lsn or 0) if state is not None else 0
            msg_id = resync_msg_id(slot, lost_after)
            marker: ResyncMarker = in_field_order(ResyncMarker, {  # type: ignore[assignment]
                "type": "resync", "slot": slot, "lost_after": format_lsn(lost_after),
                "reason": str(lost), "timestamp": int(time.time() * 1000), "msg_id": msg_id})
            await self.publisher.publish([OutgoingMessage(
                resync_subject(slot), msg_id, self.encode(dict(marker)))])
            try:
                await self._unless_stopped(self.publisher.flush())
            except StopRequested:
                return  # not stored for sure: the next start finds the lost slot again
            if state is not None:
                await conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        self.metrics.resyncs.inc()
        self.metrics.last_resync_lost_after = lost_after
        log.error("slot %s was lost (%s); marked the gap after %s in CDC (%s) and dropped the "
                  "slot: streaming from a new slot. Mirrors verify and repair what the gap "
                  "took", slot, lost, format_lsn(lost_after), resync_subject(slot))

    async def _close_reader(self, reader: SlotReader) -> None:
        """Final ack: everything stored is confirmed before the connection goes."""
        if self.publisher is not None and self.publisher.stored_position:
            reader.confirm(self.publisher.stored_position)
        self.metrics.confirmed_lsn = reader.confirmed_lsn
        self.metrics.last_ack_lsn.set(reader.confirmed_lsn)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._shutdown_left(10.0)):
                await reader.close()

    # -- the hot loop ------------------------------------------------------------------------
    async def _stream(self, reader: SlotReader) -> None:
        self._past_replay.clear()  # (a new session resends from the confirmed position)
        metrics = self.metrics
        publisher = self.publisher
        assert publisher is not None
        build = self.builder.build
        perf_counter = time.perf_counter
        while not self.stop_requested.is_set():
            # While PubAcks are outstanding, look back soon: an idle stream then reports
            # the final acknowledgement of a burst within ~10 ms.
            batch = await reader.read(timeout=0.01 if publisher.in_flight_messages else 0.1)
            if not batch.wal_messages:
                self._confirm_stored(reader)
                await reader.report_progress()
                continue
            started = perf_counter()
            metrics.wal_messages.inc(batch.wal_messages)
            built = build(batch.events)
            shapes: list[TableSchema] = []
            if built.changed_relations or built.schema_events:
                try:
                    shapes = await self._follow_shape_changes(reader, built)
                except StopRequested:
                    break  # this batch is not published: the next start reads it again
            if built.messages or built.position is not None:
                metrics.last_processing_time_us.set(
                    (perf_counter() - started) * 1e6 / batch.wal_messages)
                if built.position is not None and built.last_commit_ts is not None:
                    self._timings.append((built.position, time.monotonic(),
                                          commit_ts_epoch(built.last_commit_ts), built.transactions))
                await self._publish(reader, built.messages, built.position)
            if shapes:
                await self._put_schemas_once_stored(reader, shapes)
            # counted when read: a change held back for its transaction's next message is
            # published with a later batch, which does not count it again
            metrics.events_published.inc(built.changes)
            for (table, operation), count in built.counts.items():
                metrics.events_by_table.labels(table, operation.lower()).inc(count)
            self._confirm_stored(reader)
            metrics.current_lsn = reader.received_lsn
        # graceful stop: drain what is in flight (bounded), then the final ack in finally
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._drain_left()):
                await publisher.flush()
        self._confirm_stored(reader)

    async def _publish(self, reader: SlotReader, messages, position) -> None:
        """Publish, but keep answering PostgreSQL while the publisher applies backpressure
        (a NATS outage must not make the walsender time us out)."""
        assert self.publisher is not None
        max_payload = self.publisher.max_payload
        if ClaimChecks.oversized(messages, max_payload):  # a rare, large row: not per message
            assert self._claim_checks is not None
            messages = await self._claim_checks.replace_oversized(messages, max_payload)
        # A stop while the publisher applies backpressure drops these messages: they are not
        # confirmed, so the next start sends them again; what is in flight is drained.
        with contextlib.suppress(StopRequested):
            await self._answering(reader, self.publisher.publish(messages, position))

    async def _put_schemas_once_stored(self, reader: SlotReader,
                                       shapes: list[TableSchema]) -> None:
        """KV schemas of a batch's shape changes, once JetStream stored the batch: KV never
        runs ahead of the stream. (A schema put before its event is stored, then a kill,
        made the next start take the rewrite's storage for what consumers hold, and the
        replayed event lost its ``needs_snapshot``.) Schema changes are rare: one flush each."""
        assert self.publisher is not None
        try:
            await self._answering(reader, self.publisher.flush())
        except StopRequested:
            return  # not confirmed either: the next start reads this batch again
        for schema in shapes:
            await self._put_schema(schema)

    async def _answering(self, reader: SlotReader | None, awaitable: Awaitable[T]) -> T:
        """``awaitable``'s result, confirming what is stored and sending PostgreSQL a status
        update every status interval while it waits (a NATS outage must not make the
        walsender time us out); :class:`StopRequested` once a stop is requested first."""
        task = asyncio.ensure_future(self._unless_stopped(awaitable))
        try:
            while True:
                done, _ = await asyncio.wait({task},
                                             timeout=self.options.status_interval_seconds)
                if done:
                    return task.result()
                if reader is not None and reader.replication is not None:
                    self._confirm_stored(reader)
                    await reader.send_status()
        finally:
            task.cancel()  # (when this wait is cancelled itself: a side task stopping)

    def _own_reader(self) -> SlotReader | None:
        """The slot reader, when called from the task that reads the slot (the only one that
        may talk to the walsender): its waits answer PostgreSQL."""
        return self.reader if asyncio.current_task() is self._reading_task else None

    def _confirm_stored(self, reader: SlotReader) -> None:
        assert self.publisher is not None
        stored = self.publisher.stored_position
        if stored is not None:
            reader.confirm(stored)
            timings = self._timings
            if timings and timings[0][0] <= stored:
                now_monotonic, now = time.monotonic(), time.time()
                while timings and timings[0][0] <= stored:
                    _, published_at, committed_at, transactions = timings.popleft()
                    self.metrics.publish_latency.observe(now_monotonic - published_at)
                    self.metrics.commit_to_stored.observe(max(0.0, now - committed_at))
                    self.metrics.transactions.inc(transactions)
        self.metrics.confirmed_lsn = reader.confirmed_lsn
        self.metrics.last_ack_lsn.set(reader.confirmed_lsn)
        self.metrics.in_flight.set(self.publisher.in_flight_messages)
        conflicts = self.publisher.stats.duplicate_conflicts
        if conflicts > self._conflicts_counted:
            self.metrics.duplicate_conflicts.inc(conflicts - self._conflicts_counted)
            self._conflicts_counted = conflicts

    # -- schemas -----------------------------------------------------------------------------
    async def _publish_all_schemas(self, reader: SlotReader) -> None:
        assert reader.catalog is not None
        publication = self.settings.postgres.publication
        for schema, table in await published_tables_async(reader.catalog, publication):
            found = await table_schema_async(reader.catalog, publication, schema, table,
                                             reader.types)
            if found is not None:
                await self._put_schema(await self._as_published(found))

    async def _as_published(self, found: TableSchema) -> TableSchema:
        """``found`` (the catalog's) with the storage the stream's consumers hold: the last
        schema event's, or the one the KV schema recorded (a rewrite while the bridge was down
        must still reach consumers), recorded the first time as the rewrite check's baseline
        until the table's first schema event."""
        table = found.wire_name
        while table not in self._published_shapes:
            assert self._kv is not None
            try:
                kept = keeping_storage(found, await self._answering(
                    self._own_reader(), stored_schema(
                        self._js, self._kv, self.settings.topology.schemas.bucket, found,
                        self._signer)))
            except Exception as exc:  # noqa: BLE001 - NATS away: retry until it is back
                if self.stop_requested.is_set():
                    return found
                log.warning("could not read the schema of %s in KV (%s); retrying", table, exc)
                await self._answering(self._own_reader(), asyncio.sleep(1.0))
                continue
            self._published_shapes[table] = AnnouncedShape.of(kept)
        held = self._announced.get(table) or self._published_shapes[table]
        return dataclasses.replace(found, storage=held.storage)

    async def _follow_shape_changes(self, reader: SlotReader,
                                    built: BuiltBatch) -> list[TableSchema]:
        """``built``'s schema events filled in (or dropped when neither the shape nor the
        storage differs from the announced), and the schemas to put in KV once they are
        stored."""
        catalog = reader.catalog
        assert catalog is not None
        read: dict[int, TableSchema | None] = {}  # id(Relation) -> the catalog's table now

        async def current_of(relation: Relation) -> TableSchema | None:
            # The Relation message is authoritative for the columns at this point of the
            # WAL; the catalog adds identities, storage, nullability, defaults, missing values.
            if id(relation) not in read:
                read[id(relation)] = await table_schema_async(
                    catalog, self.settings.postgres.publication, relation.namespace,
                    relation.name, reader.types)
            return read[id(relation)]

        async def baseline(table: str) -> AnnouncedShape | None:
            return await self._announced_shape(table) or self._published_shapes.get(table)

        read_to = 0  # a new storage may be a TRUNCATE not read yet: read past the catalog
        for slot in built.schema_events:
            current = await current_of(slot.relation)
            table = wire_name(slot.relation.namespace, slot.relation.name)
            if current is not None and storage_unsettled(slot, current, await baseline(table),
                                                         built.schema_events):
                read_to = max(read_to, current.read_at_lsn)
        if read_to:
            await self._read_ahead(reader, built, read_to)
        dropped: set[int] = set()
        shapes: list[TableSchema] = []
        for slot in built.schema_events:  # (in stream order: each compares with the last)
            current = await current_of(slot.relation)
            table = wire_name(slot.relation.namespace, slot.relation.name)
            if await self._replayed(table, slot.change):
                # Consumers hold this change, so they skip anything at its position (the
                # high-water mark): a schema event here would reach none of them, and taking
                # the storage the catalog shows now as announced here would hide a rewrite
                # later in the WAL from the table's next Relation message (its first change
                # after a rewrite always has one).
                dropped.add(slot.index)
                continue
            previous = await self._announced_shape(table)
            change = resolve_shape(slot.relation, slot.change, current, await baseline(table),
                                   truncates_of(slot, built.schema_events), reader.types)
            schema, reason = change.schema, change.reason
            shapes.append(schema)
            if previous is not None and reason is None and (
                    previous.fingerprint, previous.storage) == (schema.fingerprint,
                                                                change.storage):
                dropped.add(slot.index)
                continue
            value = schema.to_wire()
            built.messages[slot.index] = self.builder.schema_event(
                slot, value, previous_fingerprint=previous.fingerprint if previous else None,
                needs_snapshot=reason is not None, reason=reason, storage=change.storage,
                min_snapshot_lsn=schema.read_at_lsn if reason is not None else 0)
            self._announced[table] = AnnouncedShape.of(schema, schema.fingerprint,
                                                       change.storage)
            if reason is not None:
                log.warning("%s: %s; its schema event tells consumers to take a new snapshot",
                            table, reason)
        if dropped:
            built.messages[:] = [message for index, message in enumerate(built.messages)
                                 if index not in dropped]
        return shapes

    async def _read_ahead(self, reader: SlotReader, built: BuiltBatch, lsn: int) -> None:
        """Read on until the walsender has decoded past ``lsn`` (a catalog read's), for at
        most :data:`_READ_AHEAD_SECONDS` and while what ``built`` holds stays within the
        in-flight byte budget, adding to ``built``: a new storage the catalog showed is then
        known to be a TRUNCATE read by now, or taken for a rewrite (a snapshot more, never a
        change lost). A large transaction between the two (100K changes) is read past: a
        bound in messages made its TRUNCATE a "rewrite". (The walsender reports its position
        when asked; nothing is published meanwhile.)"""
        deadline = time.monotonic() + _READ_AHEAD_SECONDS
        held = sum(len(message.payload) for message in built.messages)
        asked = 0.0
        while reader.decoded_lsn < lsn and time.monotonic() < deadline \
                and held < self.options.max_in_flight_bytes \
                and not self.stop_requested.is_set():
            if time.monotonic() - asked >= 0.1:
                await reader.send_status(reply_requested=True)
                asked = time.monotonic()
            batch = await reader.read(timeout=0.05)
            if batch.wal_messages:
                self.metrics.wal_messages.inc(batch.wal_messages)
                later = self.builder.build(batch.events)
                held += sum(len(message.payload) for message in later.messages)
                built.extend(later)

    async def _replayed(self, table: str, change: ChangeRecord) -> bool:
        """Whether the stream already holds an event of ``table`` at or past ``change``'s
        position: a change resent after a restart (published, not yet confirmed to
        PostgreSQL when the bridge stopped). One look at the stream per table and session,
        until the first change it does not hold."""
        if table in self._past_replay:
            return False
        message = await self._last_cdc_message(cdc_table_subjects(table),
                                               f"the last event of {table}")
        stored = _position_of(message.headers or {}) if message is not None else None
        if stored is not None and stored >= (change.commit_lsn, change.ordinal):
            return True
        self._past_replay.add(table)
        return False

    async def _announced_shape(self, table: str) -> AnnouncedShape | None:
        """The shape of ``table``'s last schema event in the stream (None: none there)."""
        if table in self._announced:
            return self._announced[table]
        message = await self._last_cdc_message(cdc_schema_subject(table),
                                               f"the last schema event of {table}")
        found = None
        if message is not None:
            try:
                found = AnnouncedShape.from_event(decode_any(message.data or b""))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("the last schema event of %s is unreadable (%r): announcing its "
                            "shape again", table, exc)
        self._announced[table] = found
        return found

    async def _last_cdc_message(self, subject: str, what: str) -> RawStreamMsg | None:
        """The last message of ``CDC`` on ``subject`` (a wildcard too), or None: none there.
        While NATS is away it asks again every second, answering PostgreSQL meanwhile."""
        assert self._js is not None
        stream = self.settings.topology.cdc.name
        while True:
            try:
                return await self._answering(self._own_reader(),
                                             self._js.get_last_msg(stream, subject))
            except NotFoundError:
                return None
            except Exception as exc:  # NATS away: retry until it is back
                if self.stop_requested.is_set():
                    raise
                log.warning("could not read %s (%s); retrying", what, exc)
                await self._answering(self._own_reader(), asyncio.sleep(1.0))

    async def _put_schema(self, schema: TableSchema) -> None:
        if self._published.get(schema.wire_name) == (schema.fingerprint, schema.relation_id,
                                                     schema.storage):
            return
        key, value = schema_entry(schema, self.encode)
        assert self._kv is not None  # (opened before the first batch)
        while True:
            try:
                await self._answering(self._own_reader(), put_value(
                    self._js, self._kv, self.settings.topology.schemas.bucket, key, value,
                    self._signer))
                break
            except Exception as exc:  # noqa: BLE001 - NATS away: retry until it is back
                if self.stop_requested.is_set():
                    return
                log.warning("could not store schema of %s in KV (%s); retrying", key, exc)
                await self._answering(self._own_reader(), asyncio.sleep(1.0))
        self._published[key] = (schema.fingerprint, schema.relation_id, schema.storage)
        self.metrics.schema_changes.inc()
        log.info("schema of %s published (fingerprint %s)", key, schema.fingerprint)

    # -- side tasks ------------------------------------------------------------------------
    async def _sql_connection(self) -> psycopg.AsyncConnection:
        return await psycopg.AsyncConnection.connect(
            self.settings.postgres.conninfo(application_name="cdc_platform_monitor"),
            autocommit=True)

    async def _heartbeat_loop(self) -> None:
        """A transactional logical message every interval: when the published tables are
        idle the slot still gets a commit to confirm, so WAL does not pile up."""
        conn = None
        while True:
            await asyncio.sleep(self.options.heartbeat_interval_seconds)
            try:
                if conn is None or conn.closed:
                    conn = await self._sql_connection()
                await conn.execute("SELECT pg_logical_emit_message(true, %s, %s)",
                                   (HEARTBEAT_PREFIX, str(int(time.time()))))
                self.metrics.heartbeats.inc()
            except psycopg.Error as exc:
                log.warning("heartbeat failed: %s", exc)
                conn = None

    async def _lag_loop(self) -> None:
        """Slot checks every ``lag_check_interval_seconds`` (lag warnings, a lost slot), and
        observations for the observer (Dagster) every ``observe_interval``: two cadences,
        one query for whichever is due."""
        conn = None
        last_observation = 0.0
        last_events = 0.0
        next_check = next_observation = 0.0
        lost_reported = False
        while True:
            now = time.monotonic()
            check_due = now >= next_check
            observe_due = self.observer is not None and now >= next_observation
            try:
                if check_due or observe_due:
                    if conn is None or conn.closed:
                        conn = await self._sql_connection()
                    state = await read_slot_async(conn, self.settings.postgres.slot)
                    if check_due:
                        # no slot yet (the reader is creating it at start): look again soon,
                        # not a whole interval later
                        next_check = now + (self.options.lag_check_interval_seconds
                                            if state is not None else _SLOT_RETRY_SECONDS)
                    if observe_due:
                        next_observation = now + self.observe_interval
                    if state is not None:
                        lost_reported = lost_reported and state.lost
                        if check_due or state.lost:  # a lost slot is fatal: never wait
                            self._check_lag(state)
                        if observe_due and self.observer is not None:
                            events = self.metrics.value(self.metrics.events_published)
                            rate = ((events - last_events) / (now - last_observation)
                                    if last_observation else 0.0)
                            last_observation, last_events = now, events
                            self.observer({
                                "confirmed_lsn": format_lsn(state.confirmed_flush_lsn or 0),
                                "lag_bytes": state.lag_bytes or 0,
                                "retained_wal_bytes": state.retained_wal_bytes or 0,
                                "events_per_second": round(rate, 1),
                                "events_published": int(events),
                            })
            except SlotLostError as exc:
                if self.options.on_slot_lost == "resync":
                    # the walsender of an invalidated slot is ended by PostgreSQL: the
                    # reader's next open finds the slot lost and resyncs (_resync)
                    if not lost_reported:
                        log.error("%s; resyncing (CDC_ON_SLOT_LOST=resync)", exc)
                    lost_reported = True
                else:
                    self.fatal = exc
                    log.error("%s", exc)
                    self.request_stop()
                    return
            except psycopg.Error as exc:
                log.warning("slot lag check failed: %s", exc)
                conn = None
                retry = time.monotonic() + min(self.options.lag_check_interval_seconds,
                                               self.observe_interval)
                next_check, next_observation = max(next_check, retry), max(next_observation,
                                                                          retry)
            wake = next_check
            if self.observer is not None:
                wake = min(wake, next_observation)
            await asyncio.sleep(max(0.05, wake - time.monotonic()))

    def _check_lag(self, state) -> None:
        if state.lost:
            raise SlotLostError(
                f"slot {state.slot_name} was invalidated (its WAL was removed): changes are "
                "lost. Drop the slot, restart the bridge, and re-snapshot the tables")
        self.metrics.wal_lag_bytes.set(state.lag_bytes or 0)
        self.metrics.retained_wal_bytes.set(state.retained_wal_bytes or 0)
        self.metrics.slot_wal_status.set(WAL_STATUS_LEVELS.get(state.wal_status or "", -1))
        self.metrics.slot_safe_wal_bytes.set(
            -1 if state.safe_wal_size is None else state.safe_wal_size)
        for level, message in slot_alerts(state, lag_warn=self.options.lag_warn_bytes,
                                          lag_critical=self.options.lag_critical_bytes,
                                          safe_wal_warn=self.options.safe_wal_warn_bytes):
            if level == "critical":
                log.error("CRITICAL: %s", message)
            else:
                log.warning("%s", message)

    async def _publication_watch_loop(self) -> None:
        """A table added to the publication gets its schema in KV within seconds, before
        its first change (consumers read the schema to create their tables)."""
        conn = None
        publication = self.settings.postgres.publication
        while True:
            await asyncio.sleep(self.options.publication_poll_seconds)
            try:
                if conn is None or conn.closed:
                    conn = await self._sql_connection()
                relation_ids = await published_relation_ids_async(conn, publication)
                for schema, table in await published_tables_async(conn, publication):
                    published = self._published.get(wire_name(schema, table))
                    if published is not None and published[1] == relation_ids.get(
                            wire_name(schema, table)):
                        continue
                    found = await table_schema_async(conn, publication, schema, table)
                    if found is not None:
                        await self._put_schema(await self._as_published(found))
            except psycopg.Error as exc:
                log.warning("publication check failed: %s", exc)
                conn = None

    async def _metrics_log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.metrics_log_interval_seconds)
            log.info("%s", self.metrics.logfmt())


def _position_of(headers: Mapping[str, str]) -> tuple[int, int] | None:
    """The (commit LSN, last ordinal) a CDC message's ``Nats-Msg-Id`` names: a change's
    ``{commit_lsn}:{ordinal}``, a batch's ``{commit_lsn}:{first}-{last}``, a schema event's
    ``{commit_lsn}:{ordinal}:schema`` (the position of the change it precedes), each maybe
    with a ``:conflict:{hex}`` suffix; None for anything else."""
    commit_lsn, _, rest = headers.get("Nats-Msg-Id", "").partition(":")
    try:
        return parse_lsn(commit_lsn), int(rest.partition(":")[0].rpartition("-")[2])
    except ValueError:
        return None
