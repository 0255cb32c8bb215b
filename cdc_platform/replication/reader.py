"""Reading a logical replication slot as typed change events, with correct acknowledgement.

``SlotReader`` owns one walsender connection and one ordinary SQL connection (catalog
look-ups for non-builtin types, slot state). It:

* resumes from the slot's ``confirmed_flush_lsn`` on every (re)start — never from
  ``pg_current_wal_lsn()``, which would skip every change made while we were away;
* answers primary keepalives at once when the server asks, and sends standby status updates
  at least every ``status_interval`` seconds;
* reports as flushed only what the caller confirmed with :meth:`confirm` (the bridge confirms
  a transaction's end LSN once JetStream stored all of it), except that when nothing is in
  flight it may confirm the server's keepalive position, so idle slots advance. Those rules
  are :class:`~cdc_platform.replication.feedback.Feedback` (pure, unit-tested on its own);
  this class does the I/O.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import psycopg

from cdc_platform.errors import ReplicationConfigError, ReplicationError
from cdc_platform.lsn import format_lsn
from cdc_platform.postgres.catalog import load_types_async
from cdc_platform.protocol.changes import TransactionAssembler, TransactionCommitted
from cdc_platform.protocol.pgoutput import Begin, Relation, decode_message
from cdc_platform.protocol.streaming import (
    XLOGDATA_HEADER_SIZE,
    PrimaryKeepalive,
    parse_copy_data,
    standby_status_update,
)
from cdc_platform.protocol.values import TypeRegistry
from cdc_platform.replication.connection import (
    SESSION_OPTIONS,
    ReplicationConnection,
    is_config_error,
)
from cdc_platform.replication.feedback import Feedback
from cdc_platform.replication.slots import SlotState, check_slot_usable, read_slot_async
from cdc_platform.settings import PostgresSettings

log = logging.getLogger(__name__)

# XLogData 'w': "Int64 The starting point of the WAL data in this message. Int64 The current
# end of WAL on the server." (read without building an XLogData object: hot path)
_XLOGDATA_POSITIONS = struct.Struct(">QQ").unpack_from
_ROW_TAGS = frozenset(b"IUD")  # pgoutput Insert, Update, Delete


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """What one read produced: assembled events in WAL order, and how many raw messages."""

    events: list
    wal_messages: int


class SlotReader:
    def __init__(self, settings: PostgresSettings, *, slot: str | None = None,
                 publications: Sequence[str] | None = None, create_slot: bool = True,
                 status_interval: float = 1.0, read_limit: int = 4096,
                 type_registry: TypeRegistry | None = None) -> None:
        self.settings = settings
        self.slot = slot or settings.slot
        self.publications = list(publications or [settings.publication])
        self.create_slot = create_slot
        self.status_interval = status_interval
        self.read_limit = read_limit
        self.types = type_registry or TypeRegistry()
        self.assembler = TransactionAssembler(self.types)
        self.replication: ReplicationConnection | None = None
        self.catalog: psycopg.AsyncConnection | None = None
        self.start_lsn = 0
        self.feedback = Feedback()
        self._last_status = 0.0
        # how far the walsender has decoded: the highest position of its data and of its
        # keepalives (which it sends when asked: ``send_status(reply_requested=True)``)
        self.decoded_lsn = 0

    @property
    def confirmed_lsn(self) -> int:
        """What status updates report as flushed."""
        return self.feedback.confirmed_lsn

    @property
    def received_lsn(self) -> int:
        """The highest WAL position received."""
        return self.feedback.received_lsn

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self) -> SlotState:
        """Connect, check or create the slot, and start streaming from its confirmed LSN.

        Raises :class:`ReplicationConfigError` for what retrying cannot fix (credentials, no
        such database or publication), :class:`ReplicationError` for the rest."""
        try:
            self.catalog = await psycopg.AsyncConnection.connect(
                self.settings.conninfo(application_name="cdc_platform_catalog",
                                       options=SESSION_OPTIONS),
                autocommit=True)
        except psycopg.OperationalError as exc:
            kind = ReplicationConfigError if is_config_error(exc) else ReplicationError
            raise kind(f"connection to {self.settings.describe()} failed: "
                       f"{str(exc).strip()}") from None
        cursor = await self.catalog.execute(
            "SELECT name FROM unnest(%s::text[]) AS name "
            "WHERE name NOT IN (SELECT pubname FROM pg_publication)", (self.publications,))
        missing = [row[0] for row in await cursor.fetchall()]
        if missing:
            raise ReplicationConfigError(
                f"publication {', '.join(missing)} does not exist in "
                f"{self.settings.describe()}: create it (cdc_platform/sql/10_publication.sql, or "
                "`cdc-platform setup-db`) or set CDC_PUBLICATION")
        state = await read_slot_async(self.catalog, self.slot)
        self.replication = await ReplicationConnection.connect(
            self.settings.conninfo(replication=True, application_name="cdc_platform_bridge"),
            self.settings.describe())
        identity = await self.replication.identify_system()
        if state is None:
            if not self.create_slot:
                raise ReplicationError(f"replication slot {self.slot} does not exist")
            created = await self.replication.create_logical_slot(self.slot)
            log.info("created replication slot %s at %s", self.slot,
                     format_lsn(created.consistent_point))
            state = await read_slot_async(self.catalog, self.slot)
            assert state is not None
        check_slot_usable(state, database=identity.database or self.settings.database)
        # The slot's confirmed position is the only correct resume point.
        self.start_lsn = state.confirmed_flush_lsn or 0
        self.feedback = Feedback(self.start_lsn)
        await self.replication.start_replication(self.slot, self.start_lsn, self.publications)
        log.info("streaming slot %s from %s (publications %s)", self.slot,
                 format_lsn(self.start_lsn), ",".join(self.publications))
        self._last_status = time.monotonic()
        return state

    async def close(self, *, final_status: bool = True) -> None:
        """Final status update with the confirmed LSN, clean CopyDone, disconnect."""
        try:
            if self.replication is not None and final_status:
                try:
                    await self.send_status()
                    await self.replication.end_copy()
                except ReplicationError as exc:
                    log.warning("could not end the replication stream cleanly: %s", exc)
        finally:
            if self.replication is not None:
                self.replication.close()
                self.replication = None
            if self.catalog is not None:
                await self.catalog.close()
                self.catalog = None

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # -- reading -------------------------------------------------------------------------
    async def read(self, timeout: float = 0.5) -> ReadBatch:
        """Events from whatever arrived within ``timeout`` (possibly none)."""
        assert self.replication is not None
        raw = await self.replication.read(
            timeout=min(timeout, self._until_status()), limit=self.read_limit)
        events: list = []
        feed = self.assembler.feed
        take_changes = self.assembler.take_changes
        feedback = self.feedback
        received_lsn = feedback.received_lsn
        index, count = 0, len(raw)
        refused = -1  # where the last run stopped: that message is the general path's
        while index < count:
            payload = raw[index]
            # A run of row changes (bulk writes, busy tables): one compiled call.
            if index != refused and feedback.in_transaction \
                    and payload[0] == 0x77 and len(payload) > XLOGDATA_HEADER_SIZE \
                    and payload[XLOGDATA_HEADER_SIZE] in _ROW_TAGS:  # the message's tag
                taken, wal_end = take_changes(raw, index, events)
                refused = taken
                if taken > index:
                    index = taken
                    received_lsn = max(received_lsn, wal_end)
                    continue
            index += 1
            if payload[0] == 0x77 and len(payload) > XLOGDATA_HEADER_SIZE:  # 'w', the hot path
                wal_start, wal_end = _XLOGDATA_POSITIONS(payload, 1)
            else:
                message = parse_copy_data(payload)
                if isinstance(message, PrimaryKeepalive):
                    feedback.received(received_lsn)
                    self.decoded_lsn = max(self.decoded_lsn, message.wal_end)
                    feedback.keepalive(message.wal_end)
                    if message.reply_requested:
                        await self.send_status(reply_requested=False)
                    continue
                wal_start, wal_end = message.wal_start, message.wal_end
            received_lsn = max(received_lsn, wal_end)
            decoded = decode_message(payload, XLOGDATA_HEADER_SIZE)
            kind = type(decoded)
            if kind is Begin:
                feedback.began()
            elif isinstance(decoded, Relation):
                feedback.received(received_lsn)
                await self._ensure_types(decoded)
            for event in feed(wal_start, decoded):
                events.append(event)
                if type(event) is TransactionCommitted:
                    feedback.committed(event.end_lsn)
        feedback.received(received_lsn)
        self.decoded_lsn = max(self.decoded_lsn, received_lsn)
        if time.monotonic() - self._last_status >= self.status_interval:
            await self.send_status()
        return ReadBatch(events, len(raw))

    def _until_status(self) -> float:
        return max(0.0, self.status_interval - (time.monotonic() - self._last_status))

    async def _ensure_types(self, relation: Relation) -> None:
        """Look up non-builtin column types (enums, domains, arrays of them) once (unknown
        even to the catalog: converted as text)."""
        oids = [c.type_oid for c in relation.columns]
        if self.types.missing_oids(oids):
            assert self.catalog is not None
            await load_types_async(self.catalog, self.types, oids)

    # -- acknowledging -------------------------------------------------------------------
    def confirm(self, lsn: int) -> None:
        """Everything up to ``lsn`` (a commit's end LSN) is durably handled downstream."""
        self.feedback.confirm(lsn)

    @property
    def in_flight(self) -> bool:
        """Received transactions not yet confirmed."""
        return self.feedback.in_flight

    async def send_status(self, *, reply_requested: bool = False) -> None:
        assert self.replication is not None
        write, flush, apply = self.feedback.status()
        await self.replication.send(standby_status_update(
            write, flush, apply, reply_requested=reply_requested))
        self.feedback.reported(flush)
        self._last_status = time.monotonic()

    async def report_progress(self) -> None:
        """Send a status update now if the confirmed LSN moved since the last one.

        For when the stream is idle: the last acknowledgement of a burst then reaches the
        server at once instead of up to ``status_interval`` later, so the slot (and what
        ``pg_replication_slots`` shows) does not lag behind what is stored."""
        if self.feedback.unreported:
            await self.send_status()

    async def slot_state(self) -> SlotState | None:
        assert self.catalog is not None
        return await read_slot_async(self.catalog, self.slot)
