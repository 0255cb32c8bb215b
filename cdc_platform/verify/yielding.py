"""A verification gives way to CDC: its tasks pause while the bridge is behind.

A verification is background work; the bridge is not. On a machine where both want the same
cores, a verification's tasks (reading COPY and hashing it, and PostgreSQL producing that
COPY) take CPU the bridge, its walsender and nats-server need, and the bridge falls behind.
So, as Vitess's VReplication streams (VDiff's among them) consult the tablet throttler and
gh-ost and pt-table-checksum check replica lag between chunks, a task reads before its COPY
and between blocks of rows how far the bridge is behind (its slot's ``confirmed_flush_lsn`` against
``pg_current_wal_lsn()``, at most every :data:`CHECK_SECONDS`, on a connection of its own)
and, once that is more than ``CDC_VERIFY_YIELD_LAG``, waits until the bridge has caught up:
it has confirmed the WAL that was flushed when the task began to wait
(``pg_current_wal_flush_lsn()`` then), or its lag is down to :data:`CAUGHT_UP_SHARE` of the
limit (the tail of the WAL, a record not flushed whole yet, can stay unsent for seconds, and
the bridge cannot confirm what it was not sent), backing off
from :data:`FIRST_PAUSE_SECONDS` to :data:`LONGEST_PAUSE_SECONDS`. Its COPY waits with it:
PostgreSQL's sending backend blocks on the full socket, so the source's side of the work
pauses too.

Why wait until then rather than only until the lag is under the limit again: a bridge
catching up on many transactions confirms as it goes, so its lag falls steadily; a task going
on at the limit took both cores back (the compiled digest reads and hashes without the GIL)
for the rest of the catch-up, and kept the bridge about that far behind for as long as the
verification read. And why not only until the lag is that small: a bridge keeping up with a
heavy load always shows some lag (it confirms about once a second), which may never be that
small; the point flushed when the task began to wait is reached by any bridge that catches
up, whatever is written meanwhile. What was written meanwhile starts a new wait only if it is
again more than the limit.

Unlike those tools a task yields for a bounded total only (its share of
``CDC_VERIFY_MAX_YIELD``): it holds an exported snapshot (VACUUM cannot remove rows deleted
after it) and its temporary slot's WAL, so a bridge that cannot catch up must not hold them
for ever; past its share a task goes on and says so in the log.

Nor does a task yield while a lock request waits for its table (DDL queued behind the
verification's ACCESS SHARE lock, and every query on the table queued behind that): pausing
then would hold them all up; the task reads on and releases the lock sooner.

Nothing here changes what a task reads or computes: it only waits between blocks of the
same COPY in the same snapshot. No slot, or no bridge streaming from it (the slot inactive):
nothing to give way to, no yielding. A lag that cannot be read (a PostgreSQL error) is said
once in the log and the task goes on without yielding."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass

import psycopg

from cdc_platform.errors import VerificationError
from cdc_platform.lsn import format_lsn
from cdc_platform.snapshot.reader import STOP_CHECK_SECONDS

log = logging.getLogger(__name__)

# A reading task reads the bridge's lag at most this often: a bridge that fell behind gets
# the cores back within it (a check is one query of shared memory, ~0.2 ms)
CHECK_SECONDS = 0.05
CAUGHT_UP_SHARE = 1 / 16  # a lag this share of the limit is caught up (1 MiB by default)
FIRST_PAUSE_SECONDS = 0.05  # a yield's first pause; each next one twice as long ...
LONGEST_PAUSE_SECONDS = 1.0  # ... up to this: the bridge caught up is noticed within it

# One row of pg_replication_slots: cheap (the slots are in shared memory). A slot that no
# bridge streams from is not active; confirmed NULL: a slot that has confirmed nothing yet.
# The lag, and the WAL flushed and confirmed as bytes from 0/0. And whether a lock request
# waits for the table (its locks, in pg_locks).
_LAG_QUERY = """
SELECT active, pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint,
       pg_wal_lsn_diff(pg_current_wal_flush_lsn(), '0/0')::bigint,
       pg_wal_lsn_diff(confirmed_flush_lsn, '0/0')::bigint,
       EXISTS (SELECT FROM pg_locks WHERE locktype = 'relation' AND NOT granted
               AND database = (SELECT oid FROM pg_database
                               WHERE datname = current_database())
               AND relation = %(table)s::regclass)
FROM pg_replication_slots WHERE slot_name = %(slot)s
"""


@dataclass(frozen=True, slots=True)
class YieldPolicy:
    """When a verification's tasks give way to the bridge (travels with the tasks' spec)."""

    slot: str  # the bridge's slot
    lag_bytes: int  # a task waits while the bridge is more than this behind; 0: never
    budget_seconds: float  # each task waits at most this long in all

    @property
    def enabled(self) -> bool:
        return self.lag_bytes > 0 and self.budget_seconds > 0


class BridgeGate:
    """One task's yielding: ``await gate.give_way()`` between blocks of rows,
    ``await gate.close()`` at the end. ``yielded_seconds``: how long it waited in all.
    ``stop``, once set (the verification ended: cancelled, or another task failed), makes
    ``give_way`` raise :class:`VerificationError` at once, also in a pause: a task running
    in a thread, which no cancellation reaches, then ends instead of holding the exported
    snapshot it imported for up to its share of ``CDC_VERIFY_MAX_YIELD``."""

    def __init__(self, policy: YieldPolicy | None, conninfo: str, table: str,
                 what: str, stop: threading.Event | None = None) -> None:
        self.policy = policy
        self.yielded_seconds = 0.0
        self._conninfo = conninfo
        self._table = table  # the table read, quoted and qualified
        self._what = what  # names the task in the log
        self._off = policy is None or not policy.enabled
        self._next_check = 0.0  # the first block is checked at once
        self._lock_waiting = False  # a lock request for the table was seen (said once)
        self._conn: psycopg.AsyncConnection | None = None
        self._stop = stop

    async def give_way(self) -> None:
        """Return at once unless a check is due; else wait while the bridge is behind, within
        what is left of the task's share."""
        self._raise_if_stopped()
        if self._off or time.monotonic() < self._next_check:
            return
        assert self.policy is not None
        pause = FIRST_PAUSE_SECONDS
        episode = 0.0
        caught_up_at = 0  # the WAL flushed when the task began to wait
        while (position := await self._position()) is not None:
            lag, flushed, confirmed = position
            if not episode and lag <= self.policy.lag_bytes:
                break
            if episode and (confirmed >= caught_up_at
                            or lag <= self.policy.lag_bytes * CAUGHT_UP_SHARE):
                break
            left = self.policy.budget_seconds - self.yielded_seconds
            if left <= 0:
                log.warning("%s: yielded %.1fs in all to the bridge, its share of "
                            "CDC_VERIFY_MAX_YIELD; going on while the bridge is %s behind "
                            "(slot %s)", self._what, self.yielded_seconds, _mib(lag),
                            self.policy.slot)
                self._off = True
                break
            if not episode:
                caught_up_at = flushed
                log.info("%s: the bridge is %s behind (slot %s; CDC_VERIFY_YIELD_LAG %s): "
                         "yielding until it has confirmed %s", self._what, _mib(lag),
                         self.policy.slot, _mib(self.policy.lag_bytes), format_lsn(flushed))
            wait = min(pause, left)
            await self._pause(wait)
            episode += wait
            self.yielded_seconds += wait
            pause = min(pause * 2, LONGEST_PAUSE_SECONDS)
        if episode and not self._off:
            log.info("%s: the bridge caught up after %.1fs", self._what, episode)
        self._next_check = time.monotonic() + CHECK_SECONDS

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, looking at ``stop`` every STOP_CHECK_SECONDS."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(left if self._stop is None else min(left, STOP_CHECK_SECONDS))
            self._raise_if_stopped()

    def _raise_if_stopped(self) -> None:
        if self._stop is not None and self._stop.is_set():
            raise VerificationError(f"{self._what}: stopped, the verification ended")

    async def _position(self) -> tuple[int, int, int] | None:
        """(bytes of WAL the bridge has not confirmed, the WAL flushed, what the bridge
        confirmed), positions in bytes from 0/0; None: no bridge streams the slot, or a lock
        request waits for the table (or they cannot be read: then the task stops
        checking)."""
        assert self.policy is not None
        try:
            if self._conn is None:
                self._conn = await psycopg.AsyncConnection.connect(
                    self._conninfo, autocommit=True,
                    application_name="cdc_platform_verify_lag")
            cursor = await self._conn.execute(
                _LAG_QUERY, {"slot": self.policy.slot, "table": self._table or None})
            row = await cursor.fetchone()
        except psycopg.Error as exc:
            log.warning("%s: cannot read the bridge's lag (%s); not yielding to it",
                        self._what, str(exc).strip())
            self._off = True
            return None
        if row is None:
            return None
        active, lag, flushed, confirmed, lock_waiting = row
        if lock_waiting:
            if not self._lock_waiting:
                log.info("%s: a lock request (DDL?) waits for the table: reading on, not "
                         "yielding", self._what)
            self._lock_waiting = True
            return None
        return (int(lag), int(flushed), int(confirmed)) if active and confirmed is not None \
            else None

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


def _mib(size: int) -> str:
    return f"{size / 1024**2:.1f} MiB"


def lower_own_priority(nice: int) -> int:
    """Run the calling thread, and the threads and processes it starts from now on, at nice
    value ``nice`` (on Linux a thread's own; call it before starting any), or leave it where
    it is when that is higher already; the nice value it runs at."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > current:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    return max(nice, current)
