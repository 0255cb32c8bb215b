"""A walsender connection (``replication=database``) over psycopg 3's libpq wrapper.

Only replication commands and the COPY BOTH stream live here; decoding is in
``cdc_platform.protocol``. The socket is non-blocking and driven by the asyncio loop
(``loop.add_reader``): one ``PQconsumeInput`` per readable event, then every complete
CopyData message is taken with ``PQgetCopyData(async=1)`` until libpq says it needs more
input. (The seed bridge called ``PQconsumeInput`` before *every* ``PQgetCopyData``, which
memmoves libpq's whole buffer per message: 4K events/s and 585 MB RSS.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import psycopg
from psycopg import pq
from psycopg.conninfo import make_conninfo
from psycopg.pq import ExecStatus
from psycopg.pq.abc import PGconn as PGconnType
from psycopg.pq.abc import PGresult as PGresultType

from cdc_platform.errors import ReplicationConfigError, ReplicationError
from cdc_platform.lsn import format_lsn, parse_lsn

log = logging.getLogger(__name__)

# Session settings for the walsender: pgoutput's text output follows them, and the value
# converters expect exactly these (see cdc_platform.protocol.values.REQUIRED_SESSION_SETTINGS).
SESSION_OPTIONS = (
    "-c DateStyle=ISO,YMD -c TimeZone=UTC -c IntervalStyle=iso_8601 "
    "-c extra_float_digits=3 -c bytea_output=hex -c client_encoding=UTF8"
)


# SQLSTATE classes and codes retrying cannot fix: invalid authorization (28), invalid
# catalog name: no such database (3D), insufficient privilege (42501), undefined object: no
# such publication (42704).
_FATAL_SQLSTATES = ("28", "3D", "42501", "42704")
# A walsender warning that a publication was skipped (PostgreSQL 18: 55000,
# object_not_in_prerequisite_state; 42704, undefined_object, as up to 17's error).
_PUBLICATION_SKIPPED = ("55000", "42704")
# What libpq says when refusing a connection for the same reasons (no SQLSTATE then), or
# a connection string it cannot use (CDC_PG_DSN `port=abc`: it never tries to connect).
_FATAL_CONNECT_TEXTS = ("password authentication failed", "does not exist",
                        "no pg_hba.conf entry", "permission denied", "must be superuser",
                        "must have replication", "password is required",
                        "authentication failed", "invalid integer value", "invalid port number",
                        "invalid connection option", 'missing "=" after',
                        "unterminated quoted string", "invalid uri", "invalid percent-encoded",
                        "invalid sslmode value", "invalid gssencmode value",
                        "invalid target_session_attrs value")


def is_config_error(exc: BaseException) -> bool:
    """Whether a PostgreSQL error is one retrying cannot fix (see ``_FATAL_SQLSTATES``)."""
    if isinstance(exc, ReplicationConfigError):
        return True
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate:
        return sqlstate.startswith(_FATAL_SQLSTATES)
    text = str(exc).lower()
    return any(marker in text for marker in _FATAL_CONNECT_TEXTS)


@dataclass(frozen=True, slots=True)
class SystemIdentity:
    system_id: str
    timeline: int
    xlog_position: int
    database: str | None


@dataclass(frozen=True, slots=True)
class CreatedSlot:
    slot_name: str
    consistent_point: int
    snapshot_name: str | None
    output_plugin: str


class CopyBothEnded(ReplicationError):
    """The server ended the COPY BOTH stream (CopyDone) or the connection closed."""


class ReplicationConnection:
    """One walsender connection. Not thread-safe; use from one asyncio task."""

    def __init__(self, pgconn: PGconnType, description: str) -> None:
        self._pgconn = pgconn
        self._description = description
        self._streaming = False
        self._loop = asyncio.get_running_loop()
        # Why the server ended COPY BOTH, once it did (raised on every later read).
        self._ended: ReplicationError | None = None
        self._publications: tuple[str, ...] = ()  # those START_REPLICATION named
        pgconn.notice_handler = self._on_notice

    def _on_notice(self, notice: PGresultType) -> None:
        """A NoticeResponse from the walsender: logged; a missing publication ends the stream.

        PostgreSQL 18 no longer fails decoding when a publication named in
        START_REPLICATION is gone: pgoutput warns ``skipped loading publication "x"``
        (SQLSTATE 42704) and goes on sending nothing for its tables. Up to 17 the same case
        was an ERROR that ended the stream; the bridge treats both alike, so a dropped
        publication stops it with the server's words instead of silently streaming nothing."""
        message = (notice.error_message or b"").decode(errors="replace").strip()
        sqlstate = (notice.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
        # (matched by SQLSTATE and the quoted name, not by the text: lc_messages translates it)
        if (self._streaming and self._ended is None and sqlstate in _PUBLICATION_SKIPPED
                and any(f'"{name}"' in message for name in self._publications)):
            self._ended = ReplicationConfigError(
                f"PostgreSQL skipped a publication on {self._description}: {message}")
            return
        log.warning("PostgreSQL on %s: %s", self._description, message)

    # -- connecting ----------------------------------------------------------------
    @classmethod
    async def connect(cls, conninfo: str, description: str) -> ReplicationConnection:
        """``conninfo`` must hold ``replication=database``; ``description`` is for errors
        (no password)."""
        conninfo = make_conninfo(conninfo, options=SESSION_OPTIONS)
        pgconn = await asyncio.to_thread(pq.PGconn.connect, conninfo.encode())
        if pgconn.status != pq.ConnStatus.OK:
            message = pgconn.get_error_message().strip()
            pgconn.finish()
            error = ReplicationError(
                f"replication connection to {description} failed: {message}")
            if is_config_error(error):
                raise ReplicationConfigError(str(error))
            raise error
        pgconn.nonblocking = 1
        return cls(pgconn, description)

    def close(self) -> None:
        if getattr(self._pgconn, "pgconn_ptr", None) is not None:  # not finished yet
            self._pgconn.finish()

    @property
    def server_version(self) -> int:
        return self._pgconn.server_version

    @property
    def backend_pid(self) -> int:
        return self._pgconn.backend_pid

    # -- socket waits ----------------------------------------------------------------
    async def _wait(self, *, write: bool = False, timeout: float | None = None) -> bool:
        """Wait until the socket is readable (or writable); False on timeout.

        The timeout resolves the future itself rather than going through ``asyncio.wait_for``,
        which on Python 3.11 swallows a cancellation that comes as the socket turns ready (a
        stopping bridge's reader then read on instead of stopping)."""
        future = self._loop.create_future()
        fileno = self._pgconn.socket
        add, remove = ((self._loop.add_writer, self._loop.remove_writer) if write
                       else (self._loop.add_reader, self._loop.remove_reader))

        def resolve(ready: bool) -> None:
            if not future.done():
                future.set_result(ready)
        add(fileno, resolve, True)
        deadline = None if timeout is None else self._loop.call_later(timeout, resolve, False)
        try:
            return await future
        finally:
            if deadline is not None:
                deadline.cancel()
            remove(fileno)

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """libpq failures (psycopg raises OperationalError) as ReplicationError."""
        try:
            yield
        except psycopg.OperationalError as exc:
            raise ReplicationError(f"{what} on {self._description}: {exc}") from exc

    async def _flush(self) -> None:
        while True:
            with self._errors("sending"):
                pending = self._pgconn.flush()
            if pending == 0:
                return
            await self._wait(write=True)

    # -- simple commands ---------------------------------------------------------------
    async def execute(self, command: str) -> list[tuple[str | None, ...]]:
        """Run one replication (or SQL) command; rows as text tuples."""
        if self._streaming:
            raise ReplicationError("cannot run commands while streaming")
        verb = command.split()[0]
        with self._errors(f"sending {verb}"):
            self._pgconn.send_query(command.encode())
        await self._flush()
        results = []
        while True:
            while self._pgconn.is_busy():
                await self._wait()
                with self._errors(f"reading the reply to {verb}"):
                    self._pgconn.consume_input()
            result = self._pgconn.get_result()
            if result is None:
                break
            results.append(result)
            if result.status == ExecStatus.COPY_BOTH:
                self._streaming = True
                return []
        rows: list[tuple[str | None, ...]] = []
        for result in results:
            if result.status == ExecStatus.FATAL_ERROR:
                raise _result_error(f"{command.split('(')[0].strip()} failed", result)
            for row in range(result.ntuples):
                values = (result.get_value(row, col) for col in range(result.nfields))
                rows.append(tuple(None if value is None else value.decode() for value in values))
        return rows

    async def identify_system(self) -> SystemIdentity:
        row = (await self.execute("IDENTIFY_SYSTEM"))[0]
        system_id, timeline, xlog_position = _required(row[:3], "IDENTIFY_SYSTEM")
        return SystemIdentity(system_id, int(timeline), parse_lsn(xlog_position), row[3])

    async def create_logical_slot(self, slot: str, *, temporary: bool = False,
                                  snapshot: str = "nothing") -> CreatedSlot:
        """``CREATE_REPLICATION_SLOT ... LOGICAL pgoutput``; ``snapshot`` is ``export``
        (keep this connection idle to keep the snapshot valid), ``use`` or ``nothing``."""
        if snapshot not in ("export", "use", "nothing"):
            raise ValueError(f"snapshot must be export/use/nothing, not {snapshot!r}")
        temp = " TEMPORARY" if temporary else ""
        row = (await self.execute(
            f'CREATE_REPLICATION_SLOT "{slot}"{temp} LOGICAL pgoutput (SNAPSHOT \'{snapshot}\')'
        ))[0]
        name, point, plugin = _required((row[0], row[1], row[3]), "CREATE_REPLICATION_SLOT")
        return CreatedSlot(name, parse_lsn(point), row[2], plugin)

    async def drop_slot(self, slot: str, *, wait: bool = False) -> None:
        await self.execute(f'DROP_REPLICATION_SLOT "{slot}"{" WAIT" if wait else ""}')

    async def start_replication(self, slot: str, start_lsn: int, publications: Sequence[str],
                                *, messages: bool = True, proto_version: int = 1) -> None:
        """Enter COPY BOTH. ``start_lsn`` 0 means "from the slot's confirmed_flush_lsn"."""
        names = ",".join(publications)
        self._publications = tuple(publications)
        options = [f"proto_version '{proto_version}'", f"publication_names '{names}'"]
        if messages:
            options.append("messages 'true'")
        await self.execute(
            f'START_REPLICATION SLOT "{slot}" LOGICAL {format_lsn(start_lsn)} '
            f"({', '.join(options)})"
        )
        if not self._streaming:
            raise ReplicationError(f"START_REPLICATION on {slot} did not enter COPY BOTH")

    # -- streaming -----------------------------------------------------------------------
    def take_available(self, limit: int) -> list[bytes]:
        """Complete CopyData messages already received, without waiting (up to ``limit``)."""
        if self._ended is not None:
            raise self._ended
        messages: list[bytes] = []
        get_copy_data = self._pgconn.get_copy_data
        with self._errors("reading the replication stream"):
            while len(messages) < limit:
                nbytes, data = get_copy_data(1)
                if nbytes > 0:
                    messages.append(data)
                elif nbytes == 0:
                    break
                else:  # -1: the server ended the COPY
                    self._streaming = False
                    self._ended = self._why_ended()
                    if messages:
                        break
                    raise self._ended
        return messages

    def _why_ended(self) -> ReplicationError:
        """The server's own error when it ended the stream (e.g. ``publication "x" does not
        exist``, sent only once decoding starts), not libpq's later "no COPY in progress"."""
        result = self._pgconn.get_result()
        while result is not None:
            if result.status == ExecStatus.FATAL_ERROR:
                return _result_error(
                    f"PostgreSQL ended the replication stream on {self._description}", result)
            result = self._pgconn.get_result()
        return CopyBothEnded(f"the server ended the replication stream on {self._description}")

    async def read(self, timeout: float, limit: int = 4096) -> list[bytes]:
        """Up to ``limit`` CopyData payloads; [] if nothing arrived within ``timeout``."""
        messages = self.take_available(limit)
        if messages:
            return messages
        if not await self._wait(timeout=timeout):
            return []
        with self._errors("reading the replication stream"):
            self._pgconn.consume_input()
        return self.take_available(limit)

    async def send(self, payload: bytes) -> None:
        """Send one CopyData message (e.g. a standby status update) and flush it."""
        while True:
            with self._errors("sending a status update"):
                queued = self._pgconn.put_copy_data(payload)
            if queued == 1:
                break
            await self._wait(write=True)
        await self._flush()

    async def end_copy(self, timeout: float = 10.0) -> None:
        """Send CopyDone and drain until the server finishes the command (clean stop)."""
        if not self._streaming:
            return
        while True:
            with self._errors("ending the replication stream"):
                queued = self._pgconn.put_copy_end()
            if queued == 1:
                break
            await self._wait(write=True)
        await self._flush()
        deadline = self._loop.time() + timeout
        while self._streaming:
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                raise ReplicationError("the server did not end the stream after CopyDone")
            try:
                await self.read(timeout=remaining)  # the server may still send data
            except CopyBothEnded:
                break
        while True:
            while self._pgconn.is_busy():
                await self._wait(timeout=1.0)
                with self._errors("ending the replication stream"):
                    self._pgconn.consume_input()
            if self._pgconn.get_result() is None:
                break


def _required(values: tuple[str | None, ...], command: str) -> list[str]:
    """Values the server always sends for ``command`` (a NULL among them is a protocol
    error, not something to carry on with)."""
    if any(value is None for value in values):
        raise ReplicationError(f"{command} answered with a NULL where a value is required")
    return [value for value in values if value is not None]


def _result_error(what: str, result: PGresultType) -> ReplicationError:
    """A FATAL_ERROR result as a ReplicationError (ReplicationConfigError when retrying cannot
    fix it), with the server's message and SQLSTATE."""
    message = (result.error_message or b"").decode(errors="replace").strip()
    sqlstate = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
    if sqlstate.startswith(_FATAL_SQLSTATES):
        return ReplicationConfigError(f"{what}: {message}")
    return ReplicationError(f"{what}: {message}")
