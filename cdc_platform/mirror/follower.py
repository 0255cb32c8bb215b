"""The mirror: exact SQLite copies of published tables, from the wire contract alone.

Each table is bootstrapped from a snapshot (a recent one in `INIT` whose cutover point `CDC`
still holds, or one asked for on ``snapshot.request.{table}``) into a shadow, chunk by chunk
while the other tables go on; every table (shadows included) follows `CDC` from the lowest
position any of them needs, one whole PostgreSQL transaction per SQLite commit, and a shadow
is swapped in where it meets the others at one LSN (docs/mirror.md, mirror/consistency.py).
Positions live in the SQLite file with the rows, so a mirror killed at any point resumes with
nothing lost and nothing applied twice. A table the stream can no
longer carry (a rewrite, a change no ALTER follows, events gone by retention, a divergence) is
marked stale, said so, and bootstrapped again; the other tables go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from cdc_platform.consumer.claim_checks import resolve_payload
from cdc_platform.consumer.requests import SnapshotRequester, SnapshotRequestFailed
from cdc_platform.consumer.schemas import schema_relation_id, schema_value
from cdc_platform.consumer.snapshots import (
    MarkerNotInCdcYet,
    NoMetaThere,
    SnapshotMeta,
    SnapshotUnusable,
    cutover_start_seq,
    meta_at,
    repair_meta_at,
    repair_refusal,
    reusable_snapshot,
    snapshot_relation_id,
)
from cdc_platform.errors import CdcError
from cdc_platform.jetstream.connection import close_nats, connect_nats
from cdc_platform.jetstream.kv import kv_values
from cdc_platform.jetstream.pull import PulledMessage, PullReader
from cdc_platform.lsn import format_lsn, parse_lsn_cached
from cdc_platform.mirror.columns import TableShape, sqlite_folded
from cdc_platform.mirror.consistency import (
    IDLE_SWAP_SECONDS,
    consistent_point,
    joining,
    shadow_event,
    shadow_name,
    table_point,
)
from cdc_platform.mirror.errors import DivergenceError, MirrorError, SchemaNotMirrorable
from cdc_platform.mirror.fleet import MirrorStateReporter, default_mirror_id
from cdc_platform.mirror.lock import holding
from cdc_platform.mirror.meetings import Meetings, OnVerification
from cdc_platform.mirror.positions import TableState
from cdc_platform.mirror.repair import (
    REPAIR_PREFIX,
    Repair,
    RepairedBuckets,
    why_not_repaired,
)
from cdc_platform.mirror.snapshots import BootstrapProgress, decode_chunk, read_chunks
from cdc_platform.mirror.store import SHADOW_PREFIX, MirrorStore
from cdc_platform.mirror.transactions import StreamGap, TransactionCollector
from cdc_platform.mirror.verifications import VerificationResult
from cdc_platform.naming import parse_wire_name
from cdc_platform.settings import MirrorSettings, PlatformSettings
from cdc_platform.wire import (
    CDC_PREFIX,
    CHANGE_OPERATIONS,
    CONTROL_TOKEN,
    HEADER_CLAIM_CHECK,
    RESYNC_SUBJECT_PREFIX,
    SCHEMA_OPERATION,
    VERIFY_SUBJECT_PREFIX,
    WATERMARK_SUBJECT_PREFIX,
    SignatureVerifier,
    commit_ts_epoch,
    decode_any,
    decode_payload,
    payload_format,
    verify_digest_subject,
)

log = logging.getLogger(__name__)
_SCHEMA_GRACE_SECONDS = 3.0  # a table without a schema in KV waits this long for it at start

Report = Callable[[str], None]
_OPERATIONS = frozenset({*CHANGE_OPERATIONS, SCHEMA_OPERATION})
# fields of every event the mirror never reads: left out when decoding (docs/wire-contract.md
# "Change event")
_UNREAD = frozenset({"schema", "relation_id", "lsn", "xid", "subject", "schema_fingerprint",
                     "unchanged_toast"})
# whole transactions committed together at most (else: what one batch read held)
_GROUP_EVENTS = 10_000
# signatures are checked on this many worker threads, each given this many messages at least
_VERIFY_THREADS = os.cpu_count() or 1
_VERIFY_SLICE = 32
_INT64_MAX = (1 << 63) - 1
# how long a snapshot of another table than the KV schema's may wait for KV to catch up
_KV_CATCH_UP_SECONDS = 30.0
# Snapshots in a row whose chunks cannot be used before a person is needed (each is asked
# for past the last one's cutover LSN, so a new one is taken each time).
_UNUSABLE_SNAPSHOTS = 3
_CONTROL_PREFIX = f"{CDC_PREFIX}.{CONTROL_TOKEN}."  # markers, digest messages
# how often a table whose schema SQLite cannot hold looks for a new one in KV
_SCHEMA_POLL_SECONDS = 2.0


class _Restart(Exception):
    """Leave the follow loop: bootstrap what is stale, then follow again."""


def check_sqlite_names(tables: Sequence[str], in_file: Sequence[str]) -> None:
    """MirrorError unless each of ``tables`` has a SQLite name of its own in a file that holds
    ``in_file``: SQLite's names ignore ASCII case (PostgreSQL's quoted names do not), so
    ``Users`` and ``users`` would be one table, each bootstrap replacing the other's rows;
    and names starting ``sqlite_`` or ``_cdc_`` are SQLite's own and the mirror's."""
    mirrored = {sqlite_folded(name): name for name in in_file
                if not name.startswith((SHADOW_PREFIX, REPAIR_PREFIX))}
    for table in tables:
        folded = sqlite_folded(table)
        if folded.startswith(("sqlite_", "_cdc_")):
            raise MirrorError(f"{table}: SQLite keeps names starting sqlite_ for itself and the "
                              "mirror names starting _cdc_: a table so named cannot be mirrored")
        other = mirrored.setdefault(folded, table)
        if other != table:
            raise MirrorError(
                f"tables {other!r} and {table!r} differ only in case, and SQLite's names ignore "
                "case: they cannot be mirrored into one file (mirror them into separate files)")


class Mirror:
    """Keeps ``tables`` of the platform mirrored in the SQLite file ``sqlite_path``."""

    def __init__(self, settings: PlatformSettings, tables: Iterable[str],
                 sqlite_path: str | Path, *, durable: str | None = None,
                 options: MirrorSettings | None = None, report: Report | None = None,
                 on_verification: OnVerification | None = None) -> None:
        self.settings = settings
        self.tables = list(dict.fromkeys(tables))
        if not self.tables:
            raise MirrorError("no tables to mirror")
        for table in self.tables:
            try:
                parse_wire_name(table)
            except ValueError:
                raise MirrorError(f"{table!r} is not a wire table name (public tables: "
                                  "users; others: schema/table, with =XX escapes)") from None
        check_sqlite_names(self.tables, ())
        self.path = Path(sqlite_path)
        self.durable = durable
        self.options = options or MirrorSettings()
        self.report = report or (lambda line: log.info("%s", line))
        # told each source verification met (docs/verification.md "Meeting a verification")
        self.on_verification = on_verification
        self.meetings: Meetings | None = None
        self.verified: dict[str, VerificationResult] = {}  # table -> its last verification
        self.position = 0  # the `CDC` sequence every followed table is mirrored up to
        self.applied_events = 0
        self.applied_transactions = 0
        self.bootstraps = 0
        self.init_bytes = 0  # chunk bytes read from `INIT` (bootstraps and repairs)
        # None: every message is taken as the platform's; else only those it verifies
        self.verifier = self.options.verifier()
        # refused for their signature (docs/wire-contract.md "Signatures")
        self.refused_messages = 0
        self._last_commit_ts: str | None = None
        # monotonic times of the first event read and the last commit (apply rate figures)
        self.first_event_at: float | None = None
        self.last_commit_at: float | None = None
        self._loaders: dict[str, asyncio.Task] = {}  # table -> its bootstrap under way
        # tables not streaming in the file yet (loading, or caught up in a shadow, or stale)
        self.bootstrapping: set[str] = set(self.tables)
        self._loaded = asyncio.Event()  # a shadow is loaded: follow it from the next pass
        # table -> why its snapshot's schema cannot be mirrored (it waits for the next one)
        self.waiting: dict[str, str] = {}
        self._until_caught_up = False  # (set by run())
        self.pending_events = 0  # events not applied yet, as last looked up
        # table -> its repair under way (mirror/repair.py), and the task loading it
        self.repairs: dict[str, Repair] = {}
        self._repair_tasks: dict[str, asyncio.Task] = {}
        self.rows_repaired = 0
        # tables that may miss changes a lost slot took (a resync marker), until verified:
        # their changes are made to fit meanwhile (docs/verification.md "Item 6")
        self.resyncing: set[str] = set()
        # resyncing table -> the first verification whose marker came after the resync
        # marker: only it (or its repair) can end the resyncing (an earlier one's point may be
        # before the lost changes). Not kept in the file: after a restart, the next one.
        self._resync_verifications: dict[str, str] = {}
        # what a repair started from the follow loop needs (set by run())
        self._session: tuple[NatsClient, JetStreamContext, MirrorStore, asyncio.Event] | None \
            = None
        # its state in KV `mirrors`; report_now() after a verification or a repair
        self.fleet = MirrorStateReporter(
            self.options.mirror_id or default_mirror_id(self.path), self.path, self.tables,
            bucket=settings.topology.mirrors.bucket,
            interval_seconds=self.options.state_interval_seconds,
            lag_seconds=lambda: self.lag_seconds(self.pending_events),
            stream_last_lsn=self.stream_last_lsn, waiting=self.waiting)

    # -- top level ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event | None = None, *,
                  until_caught_up: bool = False) -> None:
        """Mirror until ``stop`` is set (or, with ``until_caught_up``, until every table
        streams and nothing is pending). Raises :class:`MirrorError` on what needs a human:
        a table that is not published, a corrupt database, a schema it cannot map;
        :class:`MirrorRunning` at once when another mirror runs on the file."""
        with holding(self.path):
            await self._run(stop or asyncio.Event(), until_caught_up)

    async def _run(self, stop: asyncio.Event, until_caught_up: bool) -> None:
        self._until_caught_up = until_caught_up
        # a corrupt file is an error before anything else
        store = MirrorStore(self.path, digests=self.options.digests)
        check_sqlite_names(self.tables, store.tables())
        store.most_logged = self.options.verify_log_rows
        self.meetings = Meetings(store, scan=self.options.verify_scan == "at_marker",
                                 report=self.report, on_verification=self._verified)
        for name in store.tables():  # a repair under way when it stopped: asked for anew
            if name.startswith(REPAIR_PREFIX):  # by the next verification that differs
                store.drop_shadow(name)
        self.resyncing = store.resyncing()
        try:
            nc = await connect_nats(self.settings.nats, name="cdc-platform-mirror",
                                    reconnect_forever=True,
                                    inbox_prefix=self.options.inbox_prefix)
            js = nc.jetstream()
            self._session = (nc, js, store, stop)
            reporting = asyncio.create_task(self.fleet.run(js))
            on_purpose = False  # stopped or caught up, not ended by an error
            try:
                await self._check_published(js)
                while not stop.is_set():
                    try:
                        if await self._follow(nc, js, store, stop, until_caught_up):
                            break
                    except _Restart:
                        continue
                on_purpose = True
            finally:
                self.fleet.stop()
                reporting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reporting
                await self._stop_loaders()
                await self._stop_repairs()
                if on_purpose:  # the fleet shows it stopped, not gone (a crash: gone)
                    await self.fleet.publish_stopped(js)
                self._session = None
                await close_nats(nc, 5.0)
        finally:
            store.close()

    async def _check_published(self, js: JetStreamContext) -> None:
        """Every table must have a schema in KV: the bridge publishes one for each table of
        the publication, so a table without one is not published (say so, do not wait)."""
        bucket = self.settings.topology.schemas.bucket
        try:
            kv = await js.key_value(bucket)
        except NotFoundError:
            raise MirrorError(f"the KV bucket {bucket!r} does not exist: is the platform "
                              "provisioned (cdc-platform provision) and this the right "
                              "NATS server?") from None
        missing = list(self.tables)
        # a bridge starting puts the schemas just after its slot exists: a mirror started
        # with it gets a moment (_SCHEMA_GRACE_SECONDS) before "not published"
        deadline = time.monotonic() + _SCHEMA_GRACE_SECONDS
        while True:
            for table in list(missing):
                try:
                    await kv.get(table)
                    missing.remove(table)
                except NotFoundError:  # KeyNotFoundError and KeyDeletedError are NotFoundErrors
                    pass
            if not missing or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
        if missing:
            try:
                known = ", ".join(await kv_values(js, bucket)) or "none"
            except (NatsError, TimeoutError) as exc:  # (only a hint: the error comes either way)
                known = f"(not listed: {type(exc).__name__})"
            raise MirrorError(
                f"not published: {', '.join(missing)} (no schema in KV {bucket!r}); add the "
                f"table(s) to the publication. Published tables: {known}")

    # -- bootstrap ---------------------------------------------------------------------------
    def _start_loaders(self, nc: NatsClient, js: JetStreamContext, store: MirrorStore,
                       stop: asyncio.Event, local: Mapping[str, str]) -> None:
        """A loader for every table that neither streams nor has a caught-up shadow (the
        snapshots are asked for at once and taken in parallel); one already under way goes
        on across passes."""
        self._check_loaders()
        for table in self.tables:
            if table in local or table in self._loaders:
                continue
            state, shadow = store.state(table), store.state(shadow_name(table))
            latest = shadow or state
            if latest is None:
                why = "first start"
            elif any(s is not None and s.status == "bootstrapping" for s in (state, shadow)):
                why = "an interrupted bootstrap"
            else:
                why = latest.reason or latest.status
            min_lsn = max(s.stale_lsn if s is not None else 0 for s in (state, shadow))
            self.report(f"{table}: bootstrapping ({why})")
            self._loaders[table] = asyncio.create_task(
                self._load(nc, js, store, table, min_lsn, stop), name=f"bootstrap {table}")

    def _check_loaders(self) -> None:
        """Raise what a loader failed with (it needs a person); forget finished ones."""
        for table, task in list(self._loaders.items()):
            if task.done():
                del self._loaders[table]
                error = None if task.cancelled() else task.exception()
                if error is not None:
                    raise error

    async def _stop_loaders(self) -> None:
        for task in self._loaders.values():
            task.cancel()
        for task in self._loaders.values():
            with contextlib.suppress(BaseException):
                await task
        self._loaders.clear()

    async def _load(self, nc: NatsClient, js: JetStreamContext, store: MirrorStore,
                    table: str, min_lsn: int, stop: asyncio.Event) -> None:
        """Load a snapshot of ``table`` into its shadow, chunk by chunk, each in a short
        transaction of its own between the follower's (the other tables keep following);
        then the shadow follows the stream until it is swapped in (mirror/consistency.py).
        A snapshot whose chunks cannot be used (gone from `INIT`, unreadable, not adding up
        to its meta) gives way to a newer one, a few times in a row at most. One whose
        schema SQLite cannot hold makes the table wait for its next schema in KV (a run
        until caught up ends on it: it would wait for good)."""
        attempt = 0
        while attempt < _UNUSABLE_SNAPSHOTS:
            attempt += 1
            meta, start_seq = await self._snapshot(nc, js, table, min_lsn, stop)
            if meta is None or stop.is_set():
                return  # stopped while waiting
            try:
                if start_seq is None:
                    start_seq = await self._cutover_point(js, table, meta, stop)
                    if start_seq is None:
                        return  # stopped while waiting
                await self._load_snapshot(js, store, table, meta, start_seq, stop)
                return
            except SchemaNotMirrorable as exc:
                if self._until_caught_up:
                    raise  # (a run that ends once caught up would wait for good)
                # (its other tables go on; a snapshot asked for at once would be as unusable)
                self.report(f"{table}: {exc}; waiting for its schema to change")
                self.waiting[table] = str(exc)
                self.fleet.report_now()
                try:
                    if not await self._schema_changed(js, table, meta.schema_fingerprint, stop):
                        return  # stopped while waiting
                finally:
                    self.waiting.pop(table, None)
                    self.fleet.report_now()
                attempt, min_lsn = 0, max(min_lsn, meta.lsn + 1)
            except SnapshotUnusable as exc:
                if attempt == _UNUSABLE_SNAPSHOTS:
                    raise MirrorError(f"{table}: {_UNUSABLE_SNAPSHOTS} snapshots in a row are "
                                      f"unusable, the last: {exc}") from exc
                self.report(f"{table}: snapshot {meta.snapshot_id} is unusable ({exc}); "
                            "asking for a newer one")
                # past its cutover LSN: neither reused nor given again by the sensor (the
                # shadow's rows so far go with the next begin_bootstrap)
                min_lsn = max(min_lsn, meta.lsn + 1)

    async def _schema_changed(self, js: JetStreamContext, table: str, fingerprint: str,
                              stop: asyncio.Event) -> bool:
        """Until ``table``'s schema in KV `schemas` is another than ``fingerprint`` (False:
        stopped first). Read every few seconds: one KV get, the bridge's own schema value."""
        bucket = self.settings.topology.schemas.bucket
        while not stop.is_set():
            with contextlib.suppress(NatsError, TimeoutError, ValueError, TypeError,
                                     AttributeError):
                value = await schema_value(js, bucket, table, self.verifier)
                if value is not None and decode_any(value).get("fingerprint") != fingerprint:
                    return True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_SCHEMA_POLL_SECONDS):
                    await stop.wait()
        return False

    async def _load_snapshot(self, js: JetStreamContext, store: MirrorStore, table: str,
                             meta: SnapshotMeta, start_seq: int, stop: asyncio.Event,
                             shadow: str | None = None) -> bool:
        """One snapshot into the shadow (``shadow``: another than the bootstrap's, a
        repair's); whether it was loaded (False: stopped first). :class:`SnapshotUnusable`:
        its chunks cannot be."""
        assert meta.table_schema is not None  # (_snapshot returns only metas that carry it)
        repairing = shadow is not None
        shadow = shadow or shadow_name(table)
        try:
            shape = dataclasses.replace(TableShape.from_schema(meta.table_schema), table=shadow)
        except MirrorError as exc:
            raise SchemaNotMirrorable(str(exc)) from exc
        await _between_transactions(store)
        store.begin_bootstrap(shape, meta.snapshot_id, meta.lsn)
        progress = BootstrapProgress(table, meta.row_count, meta.batch_count, time.monotonic())
        last_report = time.monotonic()
        from_json = meta.format == "json"
        names = tuple(c.name for c in shape.columns)
        columns = None if from_json else names
        with contextlib.ExitStack() as stack:
            # msgpack chunks straight into SQLite where the compiled loader takes them (on
            # its own connection: only while the follower has no transaction open)
            compiled = stack.enter_context(store.chunk_loader(shadow, columns)) \
                if columns else None

            loaded: list[bytes] = []  # chunks the compiled loader wrote, to digest

            def load(data: bytes, seen: set[int]) -> tuple[int, int] | None:
                assert compiled is not None
                if store.in_transaction:
                    return None
                taken = compiled(data, seen)
                if taken is not None and store.keeps_digests and not store.loads_digested:
                    loaded.append(data)
                return taken

            def hashes(data: bytes) -> tuple[int, list[bytes]]:
                chunk = decode_chunk(data, columns)
                return rows_hashes(chunk.rows, as_tuples=chunk.as_tuples)

            def rows_hashes(rows: list[Any], *, as_tuples: bool) -> tuple[int, list[bytes]]:
                return store.loaded_hashes(shadow, rows if as_tuples else [
                    tuple(row.get(name) for name in names) for row in rows])
            async for chunk in read_chunks(js, meta, stream=self.settings.topology.init.name,
                                           progress=progress.update, columns=columns,
                                           load=load if compiled is not None else None,
                                           verifier=self.verifier, received=self._received):
                while loaded:  # (its own connection: the store's triggers did not see it)
                    # hashed on a worker thread: the other tables' changes go on meanwhile
                    hashed = await asyncio.to_thread(hashes, loaded.pop())
                    await _between_transactions(store)
                    store.digest_loaded(hashed)
                if chunk.loaded is None:
                    as_tuples = chunk.as_tuples and columns is not None
                    rows = (chunk.rows if as_tuples or not from_json
                            else [shape.from_json(r) or {} for r in chunk.rows])
                    # hashed on a worker thread, not row by row in the store's triggers
                    chunk_hashes = (await asyncio.to_thread(rows_hashes, rows,
                                                            as_tuples=as_tuples)
                                    if store.keeps_digests else None)
                    await _between_transactions(store)
                    if as_tuples and columns is not None:
                        store.load_tuples(shadow, columns, rows, has_nan=chunk.has_nan,
                                          hashes=chunk_hashes)
                    else:
                        store.load_rows(shadow, rows, hashes=chunk_hashes)
                if time.monotonic() - last_report >= self.options.status_interval_seconds:
                    last_report = time.monotonic()
                    self.report(progress.line())
                if stop.is_set():
                    return False  # left "bootstrapping": the next start begins it again
                await asyncio.sleep(0)  # the follower's turn
        await _between_transactions(store)
        store.finish_bootstrap(shadow, stream_seq=start_seq - 1)
        self._loaded.set()
        if repairing:
            self.report(f"{table}: repair snapshot {meta.snapshot_id} loaded ({meta.row_count} "
                        f"rows, cutover lsn {meta.raw.get('lsn')}); its buckets are replaced "
                        "once it is consistent with the other tables")
            return True
        self.bootstraps += 1
        self.report(f"{progress.line()}; done (snapshot {meta.snapshot_id}, cutover lsn "
                    f"{meta.raw.get('lsn')}, following {self.settings.topology.cdc.name} "
                    f"from sequence {start_seq}; swapped in once consistent with the other "
                    "tables)")
        return True

    async def _snapshot(self, nc: NatsClient, js: JetStreamContext, table: str, min_lsn: int,
                        stop: asyncio.Event) -> tuple[SnapshotMeta | None, int | None]:
        """A snapshot to bootstrap from and the `CDC` sequence to follow from (None: still to
        be found, :meth:`_cutover_point`): a recent one already in `INIT` (with a cutover LSN
        of at least ``min_lsn``: after what made the table stale), by the rule the snapshot
        sensor answers requests with, or one requested (and shared by whoever asks
        meanwhile). ``(None, None)``: stopped meanwhile."""
        init = self.settings.topology.init.name
        relation_id = await self._relation_id(js, table)
        reused = await reusable_snapshot(js, table, self.options.snapshot_max_age_seconds,
                                         init, min_lsn, relation_id=relation_id,
                                         verifier=self.verifier)
        if reused is not None:
            meta = await self._meta(js, table, reused)
            if meta is not None and meta.table_schema is not None:  # else taken by an older
                # platform (or not by the platform): ask anew
                self.report(f"{table}: using snapshot {meta.snapshot_id} taken "
                            f"{time.time() - meta.timestamp:.0f}s ago")
                return meta, reused["cdc_start_seq"]
        while True:
            reply = await self._request_snapshot(nc, js, table, min_lsn, relation_id, stop)
            if reply is None:
                return None, None
            meta = await self._meta(js, table, reply)
            if meta is not None:
                break
            self.report(f"{table}: the snapshot answered is not signed by a trusted key; "
                        "asking again")
            await asyncio.sleep(1.0)
        if meta.table_schema is None:
            raise MirrorError(f"{table}: snapshot {meta.snapshot_id}'s meta has no "
                              "table_schema (taken by an older platform): upgrade the "
                              "snapshot job")
        # a table dropped and created again: the bridge puts the new one's schema within
        # seconds (docs/operations.md "Running the CDC bridge"), the sensor snapshots the new one
        patience = time.monotonic() + _KV_CATCH_UP_SECONDS
        while relation_id is not None and snapshot_relation_id(meta) != relation_id:
            if time.monotonic() > patience:
                raise MirrorError(
                    f"{table}: snapshot {meta.snapshot_id} is of the table with oid "
                    f"{snapshot_relation_id(meta)}, the schema in KV of the one with oid "
                    f"{relation_id}: was the table dropped and created again while the "
                    "bridge was stopped? Start the mirror again once the bridge runs")
            await asyncio.sleep(1.0)
            relation_id = await self._relation_id(js, table)
        return meta, None

    async def _cutover_point(self, js: JetStreamContext, table: str, meta: SnapshotMeta,
                             stop: asyncio.Event) -> int | None:
        """The `CDC` sequence to follow ``meta``'s snapshot from (None: stopped meanwhile).
        Its watermark marker is not in `CDC` while the bridge is behind (or not running): a
        passing state, waited out with growing pauses and said in the progress line; a
        person is needed only when it lasts ``snapshot_wait_seconds``. But once `CDC` holds
        a message committed at or past the snapshot's ``lsn`` (read before the marker is
        looked for) and still no marker, the marker never comes: stream order is commit
        order, and the watermark committed below ``lsn``, so a slot that decodes it stores
        it first; that slot was lost or replaced after the watermark was written.
        :class:`SnapshotUnusable` then (a newer snapshot is asked for)."""
        started = time.monotonic()
        last_report = -math.inf
        pause = 0.5
        while True:
            stream_lsn = await self.stream_last_lsn(js)
            try:
                return await cutover_start_seq(js, meta, self.verifier)
            except MarkerNotInCdcYet as exc:
                if stream_lsn is not None and stream_lsn >= meta.lsn:
                    raise SnapshotUnusable(
                        f"{exc} and never will be: {meta.cdc_stream} holds a change committed "
                        f"at {format_lsn(stream_lsn)}, past its cutover lsn "
                        f"{format_lsn(meta.lsn)} (the bridge's slot was lost or replaced "
                        "after its watermark)") from None
                waited = time.monotonic() - started
                if waited > self.options.snapshot_wait_seconds:
                    raise MirrorError(f"{exc} after {waited:.0f}s: is the CDC bridge "
                                      "running?") from None
            if time.monotonic() - last_report >= self.options.status_interval_seconds:
                last_report = time.monotonic()
                self.report(f"{table}: waiting for the bridge to publish the watermark marker "
                            f"of snapshot {meta.snapshot_id} to {meta.cdc_stream} (the bridge "
                            f"is behind; {time.monotonic() - started:.0f}s)")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await stop.wait()
                return None
            pause = min(pause * 2, 10.0)

    async def _relation_id(self, js: JetStreamContext, table: str) -> int | None:
        """The oid of the table ``table`` names in KV ``schemas`` (which table the stream
        follows; None: unreadable). A snapshot of another table of that name (one dropped
        since) must not bootstrap it."""
        return await schema_relation_id(js, self.settings.topology.schemas.bucket, table,
                                        self.verifier)

    async def _meta(self, js: JetStreamContext, table: str,
                    done: Mapping[str, Any]) -> SnapshotMeta | None:
        """The meta a ``done`` reply names (``meta_seq`` in `INIT`); None when it is not
        signed by a trusted key (said and counted)."""
        try:
            meta = await meta_at(js, self.settings.topology.init.name, done, self.verifier)
        except NoMetaThere as exc:
            raise MirrorError(f"{table}: {exc}") from exc
        if meta is None:
            self.refused_messages += 1
        return meta

    async def _request_snapshot(self, nc: NatsClient, js: JetStreamContext, table: str,
                                min_lsn: int, relation_id: int | None,
                                stop: asyncio.Event) -> dict[str, Any] | None:
        """Ask on ``snapshot.request.{table}`` and wait for ``done`` (docs/wire-contract.md
        "Snapshot requests"); refused or failed is a :class:`MirrorError` with the reason."""
        try:
            return await self._requester(nc, js).request(table, min_lsn, relation_id, stop)
        except SnapshotRequestFailed as exc:
            raise MirrorError(str(exc)) from exc

    # -- repair (mirror/repair.py) -----------------------------------------------------------
    def verification_met(self, follow: _Following, result: VerificationResult) -> None:
        """After a verification of a streaming table differs: repair its buckets, or (too
        many, or no key to find them by) bootstrap it again. Between transactions."""
        table = result.table
        if self._session is None or follow.local.get(table) != table:
            return
        nc, js, store, stop = self._session
        if result.status == "equal":
            self._resynced(store, table, result.verification_id)
        if result.status != "differ" or table in self.repairs:
            return
        why = why_not_repaired(result, store.shape(table))
        if why is not None:
            follow.bootstrap_again(table, why, result.lsn)
            self._resynced(store, table, result.verification_id)
            return
        repair = self.repairs[table] = Repair(table, result.verification_id, result.lsn,
                                              result.bits,
                                              tuple(sorted(result.buckets_differing)))
        self._repair_tasks[table] = asyncio.create_task(
            self._repair(nc, js, store, repair, stop), name=f"repair {table}")

    async def _repair(self, nc: NatsClient, js: JetStreamContext, store: MirrorStore,
                      repair: Repair, stop: asyncio.Event) -> None:
        """Ask for a repair snapshot of ``repair``'s buckets and load it into its shadow
        (which the follower then catches up and replaces the buckets' rows from); a repair
        that cannot be had, or whose snapshots are unusable a few times in a row, gives way
        to a full bootstrap of the table, as an unusable bootstrap snapshot does."""
        table = repair.table
        why = "no repair snapshot"
        try:
            for _ in range(_UNUSABLE_SNAPSHOTS):
                try:
                    done = await self._requester(nc, js).request_repair(
                        table, repair.bits, repair.buckets, stop)
                    if done is None:
                        return  # stopped
                    meta = await repair_meta_at(js, self.settings.topology.init.name, done,
                                                self.verifier)
                    if meta is None:
                        self.refused_messages += 1
                        why = "the repair snapshot's meta is not signed by a trusted key"
                        continue
                    state = store.state(table)
                    refusal = repair_refusal(meta, table, state.fingerprint if state else "",
                                             repair.bits, repair.buckets)
                    if refusal is not None or meta.table_schema is None:
                        raise SnapshotUnusable(refusal or f"repair snapshot {meta.snapshot_id} "
                                               "has no table_schema")
                    start_seq = await self._cutover_point(js, table, meta, stop)
                    if start_seq is None or not await self._load_snapshot(
                            js, store, table, meta, start_seq, stop, shadow=repair.shadow):
                        return  # stopped
                    repair.loaded = True
                    return
                except (SnapshotUnusable, NoMetaThere) as exc:
                    why = str(exc)
                    self.report(f"{table}: the repair is unusable ({exc})")
        except (SnapshotRequestFailed, MirrorError) as exc:
            why = str(exc)
        except (NatsError, TimeoutError) as exc:  # NATS away: the next verification asks again
            log.warning("%s: the repair of verification %s stopped (%s)", table,
                        repair.verification_id, exc)
            await _between_transactions(store)
            self._give_up_repair(store, table)
            return
        await _between_transactions(store)
        self._give_up_repair(store, table)
        store.mark_stale(table, f"its repair failed ({why})", repair.lsn)
        self.bootstrapping.add(table)  # (at once: its rows are not the source's now)
        # (bootstrapped from a snapshot past the verification: whole again, as for too many)
        self._resynced(store, table, repair.verification_id)
        self.report(f"{table}: its repair failed ({why}); bootstrapping again")
        self._loaded.set()  # (the follow loop starts over, bootstrapping it)

    def _received(self, size: int) -> None:
        self.init_bytes += size

    def _requester(self, nc: NatsClient, js: JetStreamContext) -> SnapshotRequester:
        topology, options = self.settings.topology, self.options
        return SnapshotRequester(
            nc, js, requests_stream=topology.requests.name, init_stream=topology.init.name,
            max_age_seconds=options.snapshot_max_age_seconds,
            wait_seconds=options.snapshot_wait_seconds,
            status_interval_seconds=options.status_interval_seconds, report=self.report,
            verifier=self.verifier)

    def resync_marker(self, follow: _Following, seq: int, marker: Mapping[str, Any]) -> None:
        """A resync marker at ``seq`` (between transactions): the followed tables that had
        not read past it may miss changes from its ``lost_after`` on. Each keeps following,
        its changes made to fit, until a verification met finds it equal or its differing
        buckets are repaired (the platform verifies every table after a resync)."""
        if marker.get("type") != "resync" or not isinstance(marker.get("lost_after"), str):
            raise ValueError("not a resync marker")
        assert self._session is not None
        store = self._session[2]
        tables = [table for table, name in follow.local.items()
                  if (state := store.state(name)) is not None and state.stream_seq < seq
                  and table not in self.resyncing]
        if not tables:
            return
        store.set_resyncing(tables, marker["lost_after"])
        self.resyncing.update(tables)
        for table in tables:
            self._resync_verifications.pop(table, None)
        self.report(f"{', '.join(tables)}: the bridge lost its slot (changes after "
                    f"{marker['lost_after']} may be missing); following tolerantly until "
                    "verified")

    def verify_marker_met(self, table: str, verification_id: str) -> None:
        """A verify marker of ``table``: the first after a resync marker is the verification
        that ends the table's resyncing."""
        if table in self.resyncing:
            self._resync_verifications.setdefault(table, verification_id)

    def _resynced(self, store: MirrorStore, table: str, verification_id: str) -> None:
        """``table`` is whole again if ``verification_id`` came after its resync marker."""
        if table in self.resyncing and \
                self._resync_verifications.get(table) == verification_id:
            self.resyncing.discard(table)
            del self._resync_verifications[table]
            store.set_resyncing([table], None)

    def repaired(self, repair: Repair, deleted: int, inserted: int, lsn: int | None) -> None:
        """``repair``'s buckets were replaced (recorded with the rows, in one transaction)."""
        if self._session is not None:
            self._resynced(self._session[2], repair.table, repair.verification_id)
        self.repairs.pop(repair.table, None)
        self._repair_tasks.pop(repair.table, None)
        self.rows_repaired += inserted
        last = self.verified.get(repair.table)
        if last is not None and last.verification_id == repair.verification_id:
            last.status = "repaired"
        shown = format_lsn(lsn) if lsn is not None else "not known yet (the source is idle)"
        self.report(f"{repair.table}: repaired {len(repair.buckets)} of {1 << repair.bits} "
                    f"buckets (verification {repair.verification_id}): {deleted} rows "
                    f"deleted, {inserted} inserted; every table consistent at lsn {shown}")
        self.fleet.report_now()

    def _give_up_repair(self, store: MirrorStore, table: str) -> None:
        """Forget ``table``'s repair and drop its shadow (between transactions)."""
        repair = self.repairs.pop(table, None)
        task = self._repair_tasks.pop(table, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if repair is not None:
            store.drop_shadow(repair.shadow)

    async def _stop_repairs(self) -> None:
        for task in self._repair_tasks.values():
            task.cancel()
        for task in self._repair_tasks.values():
            with contextlib.suppress(BaseException):
                await task
        self._repair_tasks.clear()
        self.repairs.clear()

    # -- following ---------------------------------------------------------------------------
    async def _follow(self, nc: NatsClient, js: JetStreamContext, store: MirrorStore,
                      stop: asyncio.Event, until_caught_up: bool) -> bool:
        """Apply `CDC` until stopped (False), caught up with ``until_caught_up`` (True), or a
        table needs a new snapshot (:class:`_Restart`)."""
        stream = self.settings.topology.cdc.name
        local = {}  # followed table -> the local table its events go to (itself, or a shadow)
        for table in self.tables:
            if _streaming(store.state(table)):
                local[table] = table
            elif _streaming(store.state(shadow_name(table))):
                local[table] = shadow_name(table)
        self.bootstrapping = {table for table in self.tables if local.get(table) != table}
        for table in list(self.repairs):  # a table bootstrapped again needs no repair
            if local.get(table) != table:
                self._give_up_repair(store, table)
        # table -> its repair whose shadow is loaded: the shadow follows too
        repair_shadows = {table: repair for table, repair in self.repairs.items()
                          if repair.loaded and _streaming(store.state(repair.shadow))}
        self._start_loaders(nc, js, store, stop, local)
        self._loaded.clear()
        if not local:  # nothing to follow until a shadow is loaded
            while not stop.is_set():
                self._check_loaders()
                if self._loaded.is_set():
                    raise _Restart
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._loaded.wait()
            return False
        followed = list(local)
        start = store.resume_seq([*local.values(),
                                  *(repair.shadow for repair in repair_shadows.values())])
        first = (await js.stream_info(stream)).state.first_seq
        if start < first:
            for table, name in local.items():
                state = store.state(name)
                needed = (state.stream_seq if state else 0) + 1
                if needed < first:
                    reason = (f"{stream} no longer holds the events it needs (it needs "
                              f"sequence {needed}, the stream begins at {first}: retention)")
                    store.mark_stale(name, reason)
                    self.report(f"{table}: {reason}; bootstrapping again")
            raise _Restart
        self.position = start - 1
        reader = await self._subscribe(nc, js, stream, followed, start)
        # a table holds every transaction committed before its point: the pass may begin
        # inside one (its events of it before the start), which must not be waited for
        positions = store.positions(local.values())
        held = {table: table_point(positions[name][1], positions[name][2])
                for table, name in local.items() if name in positions}
        collector = TransactionCollector(followed, keep_events=False, held=held)
        follow = _Following(self, js, store, collector, local, repair_shadows)
        verifying = self.verifier is not None
        last_status = last_message = time.monotonic()
        try:
            while not stop.is_set():
                self._check_loaders()
                try:
                    messages = await reader.fetch(self.options.fetch_batch, timeout=1.0)
                except Exception as exc:  # noqa: BLE001 - NATS away or the consumer gone
                    log.warning("reading %s failed (%s): following again from the last "
                                "commit", stream, exc)
                    await asyncio.sleep(1.0)
                    raise _Restart from None
                for message in await follow.authentic(messages) if verifying else messages:
                    if message.subject.startswith(_CONTROL_PREFIX):  # a marker, a digest
                        await follow.control(message)
                    elif message.has_header(HEADER_CLAIM_CHECK):  # in the object store
                        try:
                            await follow.claim_checked(message)
                        except (NatsError, TimeoutError) as exc:
                            log.warning("reading the object of claim check %s on %s failed "
                                        "(%s): following again from the last commit",
                                        message.stream_seq, message.subject, exc)
                            await asyncio.sleep(1.0)
                            raise _Restart from None
                    else:  # most messages: no await per message
                        follow.payload(message, message.data)
                    if follow.stale or follow.must_restart:
                        raise _Restart  # what this batch held after it comes again
                follow.commit()
                if follow.stale or follow.must_restart:
                    raise _Restart
                now = time.monotonic()
                if messages:
                    last_message = now
                between = not follow.open and collector.pending is None
                if between and self._loaded.is_set():
                    raise _Restart  # follow the loaded shadow too
                if between:
                    follow.swap_shadows()
                    follow.finish_repairs()
                if messages and self.durable:
                    with contextlib.suppress(Exception):
                        await reader.ack(messages[-1])  # the server's view of progress only
                idle = not messages and collector.pending is None
                if idle or now - last_status >= self.options.status_interval_seconds:
                    pending = await self._pending(js, reader, store, follow.local_followed,
                                                  collector)
                    if now - last_status >= self.options.status_interval_seconds:
                        last_status = now
                        self.report(self.status_line(pending,
                                                     len(followed) - len(follow.shadowed)))
                    if pending == 0 and between and (follow.shadowed or follow.repair_shadows):
                        # read to the end: the stream's last message (any table's) bounds
                        # where the followed tables are
                        end = await _commit_lsn_at(js, stream, self.position, self.verifier)
                        if end is not None:
                            follow.read_through = max(follow.read_through or 0, end - 1)
                            follow.swap_shadows()
                            follow.finish_repairs()
                        if now - last_message >= IDLE_SWAP_SECONDS:
                            follow.swap_shadows(idle=True)
                            follow.finish_repairs(idle=True)
                    if (pending == 0 and until_caught_up and collector.pending is None
                            and not follow.shadowed and not self._loaders
                            and not self.repairs):
                        return True
                await asyncio.sleep(0)  # a loader's turn
            return False
        finally:
            follow.abandon()  # an incomplete transaction is read again on the next pass
            await reader.stop()
            if not self.durable:
                with contextlib.suppress(Exception):
                    await js.delete_consumer(stream, reader.consumer)

    async def _subscribe(self, nc: NatsClient, js: JetStreamContext, stream: str,
                         followed: Sequence[str], start: int) -> PullReader:
        subjects = [f"{CDC_PREFIX}.{table}.>" for table in followed]
        # verify markers (every marker: few) and the followed tables' digest messages, in
        # stream order with the changes (one consumer, several filters)
        # resync markers: the bridge lost its slot (docs/wire-contract.md "Resync marker")
        subjects += [f"{WATERMARK_SUBJECT_PREFIX}.*", f"{RESYNC_SUBJECT_PREFIX}.*",
                     *(f"{verify_digest_subject(table, '*')}" for table in followed)]
        config = ConsumerConfig(
            durable_name=self.durable, filter_subjects=subjects,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start,
            max_ack_pending=-1, ack_policy=AckPolicy.ALL if self.durable else AckPolicy.NONE,
            inactive_threshold=None if self.durable else 300.0)
        if self.durable:
            # positions live in SQLite: the durable starts where the database says
            with contextlib.suppress(NotFoundError):
                await js.delete_consumer(stream, self.durable)
        info = await js.add_consumer(stream, config)
        reader = PullReader(nc, stream, info.name, batch=self.options.fetch_batch)
        await reader.start()
        return reader

    async def _pending(self, js: JetStreamContext, reader: PullReader, store: MirrorStore,
                       followed: Sequence[str], collector: TransactionCollector) -> int:
        """Events not yet handed to the follower; when none (and no transaction is open),
        every followed table is mirrored up to the stream's last sequence: recorded, so a
        restart does not re-read other tables' traffic and retention is judged from there."""
        last = (await js.stream_info(reader.stream)).state.last_seq  # before the consumer's
        info = await js.consumer_info(reader.stream, reader.consumer)
        # delivered is not applied: messages on their way or buffered count as pending
        delivered = (info.delivered.consumer_seq or 0) if info.delivered else 0
        pending = int(info.num_pending or 0) + reader.unread(delivered)
        if pending == 0 and collector.pending is None and last > self.position:
            store.advance(followed, last)
            self.position = last
        self.pending_events = pending
        return pending

    def _verified(self, table: str, result: VerificationResult) -> None:
        self.verified[table] = result
        self.fleet.report_now()  # (the fleet's state shows it at once)
        if self.on_verification is not None:
            self.on_verification(table, result)

    async def stream_last_lsn(self, js: JetStreamContext) -> int | None:
        """The commit LSN of `CDC`'s last message: how far the source is."""
        stream = self.settings.topology.cdc.name
        last = (await js.stream_info(stream)).state.last_seq
        return await _commit_lsn_at(js, stream, last, self.verifier) if last else None

    def lag_seconds(self, pending: int) -> float:
        """How far behind the source's commit time the mirror is, with ``pending`` events
        not applied yet (0: none pending)."""
        if pending and self._last_commit_ts:
            with contextlib.suppress(TypeError, ValueError, OverflowError):  # (not a time)
                return max(0.0, time.time() - commit_ts_epoch(self._last_commit_ts))
        return 0.0

    def status_line(self, pending: int, streaming: int) -> str:
        behind = self.lag_seconds(pending)
        return (f"mirror: {streaming} table(s) streaming, {self.applied_transactions:,} "
                f"transactions / {self.applied_events:,} events applied, {pending:,} events "
                f"behind, {behind:.1f}s behind the source commit time; position "
                f"{self.position}"
                + (f"; {self.refused_messages:,} unsigned or badly signed messages refused"
                   if self.refused_messages else "")
                + (f"; resyncing (not verified since the bridge lost its slot): "
                   f"{', '.join(sorted(self.resyncing))}" if self.resyncing else "")
                + ("; last verifications: " + ", ".join(
                    f"{table} {result.status}" for table, result in sorted(
                        self.verified.items())) if self.verified else ""))


class _Following:
    """One pass over the stream: messages -> events -> whole transactions in SQLite."""

    def __init__(self, mirror: Mirror, js: JetStreamContext, store: MirrorStore,
                 collector: TransactionCollector,
                 local: Mapping[str, str] | Sequence[str],
                 repair_shadows: Mapping[str, Repair] | None = None) -> None:
        if not isinstance(local, Mapping):  # tables followed as they are, no shadow
            local = {table: table for table in local}
        self.mirror = mirror
        self.js = js
        self.store = store
        self.collector = collector
        self.followed = list(local)
        self._followed = set(local)
        self._subject_prefixes = {table: f"{CDC_PREFIX}.{table}." for table in local}
        # followed table -> the local table its events are applied to: itself, or the
        # shadow it is being bootstrapped in (mirror/consistency.py)
        self.local = dict(local)
        self.shadowed = {table: name for table, name in local.items() if name != table}
        # table -> its repair whose shadow this pass follows: the table applies every event
        # (those of the repaired buckets tolerantly, from the moment a repair is asked for),
        # its repair shadow those of the buckets (mirror/repair.py)
        self.repair_shadows = dict(repair_shadows or {})
        self._repaired_buckets: dict[str, tuple[Repair, RepairedBuckets]] = {}
        self._tables = {name: table for table, name in local.items()}
        self._tables.update((repair.shadow, table)
                            for table, repair in self.repair_shadows.items())
        self.read_through: int | None = None  # commit LSN of the pass's last whole one
        # One SQLite transaction holds whole PostgreSQL transactions (and then, maybe, the
        # one being read) until commit(): a commit per batch read instead of one per
        # transaction, which is most of the cost of small transactions. It commits only
        # between transactions, so the mirror still holds all of one or none.
        self.open = False
        self.applied_in_open = 0  # events of the transaction being read, applied in it
        self.group_seq: int | None = None  # the last stream sequence of its whole ones
        self.group_transactions = 0
        self.group_commit_lsn = 0
        self.group_commit_ts: str | None = None
        self.must_restart = False  # whole transactions were rolled back: read them again
        self.first = True  # the first transaction of this pass may have begun before it
        self.stale: dict[str, str] = {}

    async def authentic(self, messages: Sequence[PulledMessage]) -> list[PulledMessage]:
        """``messages`` signed by a trusted key, in order; each other one is said and
        counted, and never reaches the database, so it moves no position either. Checked on
        worker threads, which libsodium's verification lets run at once (it releases the
        GIL): 1.6x as fast with a second core free, the same when the cores are busy."""
        verifier = self.mirror.verifier
        assert verifier is not None
        size = max(_VERIFY_SLICE, -(-len(messages) // _VERIFY_THREADS))
        if len(messages) <= size:
            refusals = _refusals(verifier, messages)
        else:
            loop = asyncio.get_running_loop()
            parts = await asyncio.gather(*(
                loop.run_in_executor(None, _refusals, verifier, messages[start:start + size])
                for start in range(0, len(messages), size)))
            refusals = [refusal for part in parts for refusal in part]
        kept = []
        for message, refusal in zip(messages, refusals, strict=True):
            if refusal is None:
                kept.append(message)
            else:
                self.mirror.refused_messages += 1
                log.error("refused message %s on %s: %s", message.stream_seq, message.subject,
                          refusal)
        return kept

    async def claim_checked(self, message: PulledMessage) -> None:
        """The events of a message whose payload is an object (docs/wire-contract.md "Large
        values")."""
        try:
            data = await resolve_payload(self.js, message.data, message.headers)
        except (ValueError, TypeError, KeyError, CdcError) as exc:
            log.error("refused message %s on %s: %s", message.stream_seq, message.subject, exc)
            return
        self.payload(message, data)

    def payload(self, message: PulledMessage, data: bytes) -> None:
        """Every event of one message."""
        seq = message.stream_seq
        if self.mirror.first_event_at is None:
            self.mirror.first_event_at = time.monotonic()
        fmt = payload_format(data)
        try:
            try:
                decoded = decode_payload(data, fmt, _UNREAD)
            except (ValueError, RecursionError) as exc:  # (msgpack's and json's errors are
                # ValueErrors; JSON nested deeper than Python recurses is a RecursionError)
                detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                raise ValueError(f"not a {fmt} payload ({detail})") from None
            events = decoded if isinstance(decoded, list) else [decoded]
            from_json = fmt == "json"
            for event in events:
                _check_event(event, message.subject, self._subject_prefixes)
        except (ValueError, TypeError, KeyError, CdcError) as exc:
            # not an event of the contract (forged or corrupt): never applied. If it stood
            # for a real change, the transaction comes up short and the table re-bootstraps.
            log.error("refused message %s on %s: %s", seq, message.subject, exc)
            return
        for event in events:
            self.event(event, seq, from_json)
            if self.stale:
                return

    @property
    def local_followed(self) -> list[str]:
        return [*self.local.values(),
                *(repair.shadow for repair in self.repair_shadows.values())]

    def event(self, event: Mapping[str, Any], seq: int, from_json: bool) -> None:
        try:
            fresh, done = self.collector.offer(event, seq)
        except StreamGap as gap:
            pending = self.collector.pending
            # the tables its missing events are of, as far as the stream tells
            seen = {*pending.counts, *(t for t, _ in pending.schema_events)} if pending else set()
            tables = sorted(seen & self._followed or self._followed)
            if pending is not None and self._before(tables, pending.commit_lsn):
                # nothing of it applies to them (a transaction cut short, or forged, before
                # their cutover; apply() skipped what it was handed): its missing events lose
                # nothing. (Taken for a gap, it made a table stale, bootstrapped again from a
                # snapshot after it: for ever.)
                self.collector.reset()
            else:
                self.abandon()
                if not (self.first and pending is not None and self.applied_in_open == 0):
                    self._mark_stale(tables, str(gap), parse_lsn_cached(event["commit_lsn"]))
                    return
                # began before this pass started and held nothing new: not a gap
                self.first = False
            fresh, done = self.collector.offer(event, seq)
        table = event["table"]
        if self.shadowed:
            shadow = self.shadowed.get(table)
            if shadow is not None:
                event = shadow_event(event, shadow)
        # (the event to the repair shadow too, when of its buckets)
        tolerant, repaired = table in self.mirror.resyncing, None
        repair = self.mirror.repairs.get(table) if self.mirror.repairs else None
        if repair is not None and self._buckets(repair).holds(event, from_json=from_json):
            tolerant = True
            if table in self.repair_shadows:
                repaired = shadow_event(event, repair.shadow)
        # (once a transaction is open, apply() itself skips what the positions cover)
        if fresh and (self.open or not self.store.covers(event)
                      or (repaired is not None and not self.store.covers(repaired))):
            if not self.open:
                self.store.begin()
                self.open, self.applied_in_open = True, 0
            try:
                # a row under repair may be missing or extra in the table: its changes are
                # made to fit, never a divergence (its rows are replaced from the shadow)
                self.store.apply(event, from_json=from_json, tolerant=tolerant)
                if repaired is not None:
                    self.store.apply(repaired, from_json=from_json, tolerant=True)
            except DivergenceError as exc:
                self.abandon()
                # (a batch of another table may have been flushed before this event: the
                # error names that table.) A snapshot past the transaction that did not fit:
                # one at its commit LSN would apply it again, and again.
                self._mark_stale([exc.table or event["table"]], str(exc),
                                 parse_lsn_cached(event["commit_lsn"]) + 1)
                return
            self.applied_in_open += 1
        if done is not None:
            self.read_through = done.commit_lsn
            self.first = False
            self.applied_in_open = 0
            if self.open:
                self.group_seq = done.last_seq
                self.group_transactions += 1
                self.group_commit_lsn = done.commit_lsn
                self.group_commit_ts = event.get("commit_ts")
                # (while a verification logs deltas, each transaction is its own commit: a
                # log row names its transaction's commit LSN)
                if self.store.open_events >= _GROUP_EVENTS or self.store.logging:
                    self.commit()

    async def control(self, message: PulledMessage) -> None:
        """A watermark marker or a digest message (docs/verification.md "Meeting a
        verification"): a verification of a followed table is met here, in stream order,
        after what was applied before it is committed. One that is not what it says is
        said and skipped: it stops nothing."""
        meetings = self.mirror.meetings
        assert meetings is not None
        try:
            payload = decode_any(message.data)
            if message.subject.startswith(f"{RESYNC_SUBJECT_PREFIX}."):
                if not isinstance(payload, Mapping):
                    raise ValueError("not a resync marker")
                self.commit()
                self.mirror.resync_marker(self, message.stream_seq, payload)
                return
            if message.subject.startswith(f"{WATERMARK_SUBJECT_PREFIX}."):
                marker = meetings.verify_marker(payload, self.local)
                if marker is None:
                    return
                self.commit()
                vid, table, marker_lsn = marker
                self.mirror.verify_marker_met(table, vid)
                meetings.marker(vid, table, marker_lsn,
                                streaming=self.local.get(table) == table,
                                inside_transaction=self.collector.pending is not None)
                return
            table, _, vid = message.subject[len(VERIFY_SUBJECT_PREFIX) + 1:].rpartition(".")
            if table not in self._followed:
                raise ValueError(f"a digest message of {table!r:.80}, not followed")
            self.commit()
            result = await meetings.digest(payload, table, vid)
            if result is not None:
                self.mirror.verification_met(self, result)
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            log.error("refused message %s on %s: %s: %s", message.stream_seq, message.subject,
                      type(exc).__name__, exc)

    def _before(self, tables: list[str], commit_lsn: int) -> bool:
        """Whether no event of the transaction ``commit_lsn`` applies to ``tables``: it
        precedes each one's cutover or high-water mark (as committed), its shadow's too when
        it is bootstrapped aside."""
        for table in [*tables, *(self.shadowed[t] for t in tables if t in self.shadowed),
                      *(self.repair_shadows[t].shadow for t in tables
                        if t in self.repair_shadows)]:
            state = self.store.state(table)
            if (state is not None and state.status == "streaming"
                    and commit_lsn >= state.cutover_lsn
                    and commit_lsn >= state.applied_commit_lsn):
                return False
        return True

    def commit(self) -> None:
        """Commit the whole transactions applied since the last commit, with the positions
        they reached (nothing while a transaction is still being read)."""
        if not self.open or self.group_seq is None or self.collector.pending is not None:
            return
        try:
            self._record_consistent_lsn()
            applied = self.store.commit(self.group_seq, self.local_followed,
                                        self.group_commit_lsn)
        except DivergenceError as exc:  # a batch flushed at commit did not fit
            self.open = False  # (the store rolled back)
            self.abandon()
            self._mark_stale([exc.table] if exc.table else list(self.followed), str(exc),
                             self.group_commit_lsn + 1)
            return
        self.open = False
        mirror = self.mirror
        mirror.applied_events += applied.events
        mirror.applied_transactions += self.group_transactions
        mirror.last_commit_at = time.monotonic()
        mirror.position = max(mirror.position, self.group_seq)
        mirror._last_commit_ts = self.group_commit_ts
        self.group_seq, self.group_transactions = None, 0
        for name, reason in applied.stale.items():
            table = self._tables.get(name, name)
            self.stale[table] = reason
            mirror.bootstrapping.add(table)  # (at once: its rows are not the source's now)
            mirror.report(f"{table}: {reason}; bootstrapping again")

    def _points(self, tables: Sequence[str]) -> tuple[dict[str, int], bool]:
        """(each streaming local table of ``tables`` -> its point (mirror/consistency.py),
        whether the open transaction changed any of them)."""
        points, changed = {}, False
        for name, (status, cutover, high_water, touched) in self.store.positions(
                tables).items():
            if status == "streaming":
                points[name] = table_point(cutover, high_water)
                changed = changed or touched
        return points, changed

    def _record_consistent_lsn(self) -> None:
        """In the open transaction, the LSN the streaming tables are consistent at; left as
        it is while the pass re-reads what they hold already (nothing of theirs changed)."""
        points, changed = self._points([t for t in self.followed if t not in self.shadowed])
        lsn = consistent_point(points.values(), self.read_through)
        if lsn is not None or changed:
            self.store.record_consistent_lsn(lsn)

    def swap_shadows(self, *, idle: bool = False) -> None:
        """Swap in the caught-up shadows that keep the file consistent (with ``idle``: every
        one, the point then not known; see mirror/consistency.py). Between transactions
        only: the file holds whole ones of every table."""
        if not self.shadowed:
            return
        visible, _ = self._points([t for t in self.followed if t not in self.shadowed])
        shadows, _ = self._points(list(self.shadowed.values()))
        ready = {self._tables[name]: point for name, point in shadows.items()}
        chosen, lsn = joining(visible, ready, self.read_through)
        if idle and not chosen:
            chosen, lsn = list(ready), None
        if not chosen:
            return
        self.store.swap_in({table: self.shadowed[table] for table in chosen}, lsn)
        for table in chosen:
            del self._tables[self.shadowed.pop(table)]
            self.local[table] = self._tables[table] = table
            self.mirror.bootstrapping.discard(table)
        shown = format_lsn(lsn) if lsn is not None else "not known yet (the source is idle)"
        self.mirror.report(f"{', '.join(chosen)}: swapped in; every table consistent at lsn "
                           f"{shown}")
        self.mirror.fleet.report_now()  # (streaming now: the fleet need not wait to show it)

    def finish_repairs(self, *, idle: bool = False) -> None:
        """Replace the buckets of each repair whose shadow has caught up, at the point the
        shadows of bootstraps are swapped in at (with ``idle``: now, the point then not
        known). Between transactions only."""
        if not self.repair_shadows:
            return
        visible, _ = self._points([t for t in self.followed if t not in self.shadowed])
        shadows, _ = self._points([repair.shadow for repair in self.repair_shadows.values()])
        ready = {self._tables[name]: point for name, point in shadows.items()}
        for table, point in ready.items():
            chosen, lsn = joining(visible, {table: point}, self.read_through)
            if not chosen and not idle:
                continue
            repair = self.repair_shadows.pop(table)
            deleted, inserted = self.store.replace_buckets(
                table, repair.shadow, repair.bits, repair.buckets, repair.verification_id,
                lsn if chosen else None)
            del self._tables[repair.shadow]
            self.mirror.repaired(repair, deleted, inserted, lsn if chosen else None)

    def _buckets(self, repair: Repair) -> RepairedBuckets:
        """Which events are of ``repair``'s buckets."""
        known = self._repaired_buckets.get(repair.table)
        if known is None or known[0] is not repair:
            known = self._repaired_buckets[repair.table] = (repair, RepairedBuckets(
                self.store.shape(repair.table), repair.bits, repair.buckets))
        return known[1]

    def bootstrap_again(self, table: str, reason: str, at_lsn: int) -> None:
        """``table`` is bootstrapped again from a snapshot at ``at_lsn`` at least."""
        self._mark_stale([table], reason, at_lsn)

    def abandon(self) -> None:
        """Roll back the open transaction (its events come again on the next pass)."""
        if self.open:
            self.store.rollback()
            self.open = False
        if self.group_seq is not None:
            self.must_restart = True  # whole transactions went with it
        self.group_seq, self.group_transactions, self.applied_in_open = None, 0, 0
        self.collector.reset()

    def _mark_stale(self, tables: list[str], reason: str, at_lsn: int) -> None:
        for name in tables:
            table = self._tables.get(name, name)  # (a shadow's name: its table's)
            self.store.mark_stale(self.local.get(table, table), reason, at_lsn)
            self.stale[table] = reason
            self.mirror.bootstrapping.add(table)  # (at once: its rows are not the source's now)
            self.mirror.report(f"{table}: {reason}; bootstrapping again")


def _check_event(event: Any, subject: str, subject_prefixes: dict[str, str]) -> None:
    """What the mirror relies on before an event goes near the database
    (``subject_prefixes``: the followed tables -> the subject prefix of their events)."""
    if type(event) is not dict:
        raise TypeError(f"not an event map (nor a batch of them) but {type(event).__name__}")
    table = event.get("table")
    prefix = subject_prefixes.get(table) if type(table) is str else None
    if prefix is None or not subject.startswith(prefix):
        raise ValueError(f"an event of table {table!r} on subject {subject}")
    operation = event.get("operation")
    if operation not in _OPERATIONS:
        raise ValueError(f"unknown operation {operation!r}")
    _stored_lsn(event["commit_lsn"])
    ordinal = event.get("ordinal")
    if type(ordinal) is not int or ordinal < 0 or ordinal > _INT64_MAX:
        raise ValueError(f"ordinal {ordinal!r}")
    if "tx_tables" in event:  # (on a table's last change in its transaction only)
        _check_tx_tables(event["tx_tables"])
    if (operation == "INSERT" or operation == "UPDATE") and type(event.get("data")) is not dict:
        raise ValueError(f"{operation} without a data map")
    if operation == "INSERT" and not event["data"]:
        raise ValueError("an INSERT without values")


async def _commit_lsn_at(js: JetStreamContext, stream: str, seq: int,
                         verifier: SignatureVerifier | None) -> int | None:
    """The commit LSN of the message at ``seq`` of ``stream`` (an event, a batch, a watermark
    marker), None when it has none to read or ``verifier`` refuses it. Stream order is commit
    order: every transaction that committed before it was stored before it."""
    try:
        message = await js.get_msg(stream, seq=seq)
        if verifier is not None and verifier.refusal(
                message.subject or "", message.headers or {}, message.data or b"") is not None:
            return None
        decoded = decode_any(message.data or b"")
        event = decoded[-1] if isinstance(decoded, list) and decoded else decoded
        return parse_lsn_cached(event["commit_lsn"]) if isinstance(event, dict) else None
    except (NatsError, TimeoutError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _refusals(verifier: SignatureVerifier, messages: Sequence[PulledMessage]
              ) -> list[str | None]:
    return [verifier.refusal(message.subject, message.headers, message.data)
            for message in messages]


async def _between_transactions(store: MirrorStore) -> None:
    """Until the follower has no transaction open (a chunk of a shadow is written between
    two of its transactions, never inside one it may roll back)."""
    while store.in_transaction:
        await asyncio.sleep(0.005)


def _check_tx_tables(tx_tables: Any) -> None:
    if type(tx_tables) is not dict:
        raise ValueError(f"tx_tables {tx_tables!r:.200} is not a map of tables to counts")
    for name, count in tx_tables.items():
        if type(name) is not str or type(count) is not int:
            raise ValueError(f"tx_tables {tx_tables!r:.200} is not a map of tables to counts")


@functools.lru_cache(maxsize=256)  # (one text per transaction, as parse_lsn_cached)
def _stored_lsn(text: str) -> int:
    """An event's LSN, which the mirror stores as an SQLite integer (int64)."""
    lsn = parse_lsn_cached(text)
    if lsn > _INT64_MAX:
        raise ValueError(f"commit_lsn {text} is beyond any PostgreSQL LSN")
    return lsn


def _streaming(state: TableState | None) -> bool:
    return state is not None and state.status == "streaming"
