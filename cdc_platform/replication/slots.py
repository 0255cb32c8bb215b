"""The replication slot seen from SQL: state, lag, and the checks made before streaming."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from cdc_platform.errors import ReplicationError, SlotLostError
from cdc_platform.lsn import parse_lsn

_SLOT_QUERY = """
SELECT slot_name, plugin, slot_type, database, active, active_pid,
       restart_lsn::text, confirmed_flush_lsn::text, wal_status,
       pg_current_wal_lsn()::text,
       pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint,
       pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint,
       safe_wal_size
FROM pg_replication_slots WHERE slot_name = %s
"""


@dataclass(frozen=True, slots=True)
class SlotState:
    slot_name: str
    plugin: str | None
    slot_type: str
    database: str | None
    active: bool
    active_pid: int | None
    restart_lsn: int | None
    confirmed_flush_lsn: int | None
    wal_status: str | None  # reserved | extended | unreserved | lost
    current_wal_lsn: int
    retained_wal_bytes: int | None  # WAL the slot pins (current - restart_lsn)
    lag_bytes: int | None  # WAL not yet confirmed (current - confirmed_flush_lsn)
    # WAL that can still be written before the slot is in danger of losing what it needs
    # (max_slot_wal_keep_size); None when that is unlimited (-1) or the slot is lost
    safe_wal_size: int | None = None

    @property
    def lost(self) -> bool:
        return self.wal_status == "lost"


def _lsn(text: str | None) -> int | None:
    return None if text is None else parse_lsn(text)


def read_slot(conn: psycopg.Connection, slot: str) -> SlotState | None:
    row = conn.execute(_SLOT_QUERY, (slot,)).fetchone()
    return _to_state(row)


async def read_slot_async(conn: psycopg.AsyncConnection, slot: str) -> SlotState | None:
    cursor = await conn.execute(_SLOT_QUERY, (slot,))
    return _to_state(await cursor.fetchone())


def _to_state(row) -> SlotState | None:
    if row is None:
        return None
    (name, plugin, slot_type, database, active, active_pid, restart, confirmed, wal_status,
     current, retained, lag, safe_wal_size) = row
    return SlotState(name, plugin, slot_type, database, active, active_pid, _lsn(restart),
                     _lsn(confirmed), wal_status, parse_lsn(current), retained, lag,
                     safe_wal_size)


#: wal_status as a gauge value (bridge_slot_wal_status)
WAL_STATUS_LEVELS = {"reserved": 0, "extended": 1, "unreserved": 2, "lost": 3}


def slot_alerts(state: SlotState, *, lag_warn: int, lag_critical: int,
                safe_wal_warn: int) -> list[tuple[str, str]]:
    """``(level, message)`` for everything about the slot worth a person's attention, most
    urgent first; level is ``critical`` or ``warning``.

    PostgreSQL says how close a slot is to being invalidated before it happens: wal_status
    ``extended`` (WAL kept past max_wal_size for the slot), ``unreserved`` (past
    max_slot_wal_keep_size: the next checkpoint removes it) and ``safe_wal_size`` (WAL that can
    still be written before that). Lag alone says nothing of that limit.
    """
    alerts: list[tuple[str, str]] = []
    name = state.slot_name
    if state.wal_status == "unreserved":
        alerts.append(("critical", (
            f"slot {name}: wal_status=unreserved, the WAL it needs is past "
            "max_slot_wal_keep_size and the next checkpoint will invalidate the slot unless "
            "the bridge catches up now")))
    elif state.wal_status == "extended":
        alerts.append(("warning", (
            f"slot {name}: wal_status=extended, PostgreSQL keeps WAL past max_wal_size for "
            "this slot")))
    if state.safe_wal_size is not None and state.safe_wal_size < safe_wal_warn:
        level = "critical" if state.safe_wal_size < safe_wal_warn // 4 else "warning"
        alerts.append((level, (
            f"slot {name}: only {max(state.safe_wal_size, 0) // 2**20} MB of WAL can still be "
            "written before the slot is invalidated (safe_wal_size; raise "
            "max_slot_wal_keep_size or catch up)")))
    lag = state.lag_bytes or 0
    behind = f"slot {name} lags {lag // 2**20} MB behind (wal_status={state.wal_status})"
    if lag >= lag_critical:
        alerts.append(("critical", f"{behind}: NATS or the bridge is not keeping up"))
    elif lag >= lag_warn:
        alerts.append(("warning", behind))
    return sorted(alerts, key=lambda alert: alert[0] != "critical")


def check_slot_usable(state: SlotState, *, database: str, reader_pid: int | None = None) -> None:
    """Refuse a slot we must not stream from, saying what to do about it."""
    if state.slot_type != "logical" or state.plugin != "pgoutput":
        raise ReplicationError(
            f"slot {state.slot_name} is {state.slot_type}/{state.plugin}, not a logical "
            "pgoutput slot: drop it or choose another CDC_SLOT")
    if state.database != database:
        raise ReplicationError(
            f"slot {state.slot_name} belongs to database {state.database}, not {database}")
    if state.lost:
        raise SlotLostError(
            f"slot {state.slot_name} was invalidated (its WAL was removed, probably past "
            "max_slot_wal_keep_size): changes were lost. Drop the slot "
            f"(SELECT pg_drop_replication_slot('{state.slot_name}')), restart the bridge to "
            "create a new one, and re-snapshot every table consumers mirror")
    if state.active and state.active_pid != reader_pid:
        raise ReplicationError(
            f"slot {state.slot_name} is already being read by walsender pid "
            f"{state.active_pid}: only one reader per slot (stop the other bridge/CDC run)")
