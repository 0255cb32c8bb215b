"""The platform's view of the mirrors: their states in KV ``mirrors`` (docs/verification.md
Part 2, item 5; written by ``cdc-platform mirror``, mirror/fleet.py) read and judged: which
mirrors are there, which fall behind or are gone, and whether every mirror following a table
met its latest verification equal. A mirror that stopped on purpose (``--once``, SIGTERM)
said so in its last state (``stopped_at``): it is ``stopped``, not gone, while remembered. A
table resyncing after the bridge lost its slot is not equal until verified again. Dagster's
``mirror_fleet`` (defs/fleet/) is a thin layer over this.

The values were written by readers: each is checked for what is used of it, and a value that
is not a mirror's state is reported as unreadable, never trusted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext

from cdc_platform.jetstream.kv import kv_values

# a mirror's verification passed when it says so
PASSING = ("equal", "repaired")
# a table's status while it may lack changes the bridge's lost slot took (not verified since)
RESYNCING = "resyncing"
# a table's status while its schema cannot be mirrored as it is (it needs the source changed)
WAITING_FOR_SCHEMA = "waiting"
# a mirror's outcome that fails nothing yet (WARN): it has not met the verification, or it is
# resyncing
WAITING = (*PASSING, "pending", RESYNCING)


@dataclass(frozen=True)
class MirroredTable:
    status: str
    applied_lsn: str | None
    verification_id: str | None  # of its last verification (None: none met yet)
    verification_status: str | None
    buckets_differing: int = 0
    rows_repaired: int = 0
    reason: str | None = None  # why it is stale or waiting


@dataclass(frozen=True)
class MirrorState:
    """What the judgement uses of a mirror's state value."""

    mirror_id: str
    lag_seconds: float
    lag_bytes: int | None
    updated_at: str | None
    tables: dict[str, MirroredTable]
    stopped_at: str | None = None  # it stopped on purpose then (its last state)

    def summary(self) -> dict[str, Any]:
        """For an observation's metadata: lag, each table's status and last verification."""
        return {"lag_seconds": self.lag_seconds, "lag_bytes": self.lag_bytes,
                "updated_at": self.updated_at, "stopped_at": self.stopped_at,
                "tables": {name: {"status": table.status, "applied_lsn": table.applied_lsn,
                                  "reason": table.reason,
                                  "last_verification": None if table.verification_id is None
                                  else {"verification_id": table.verification_id,
                                        "status": table.verification_status,
                                        "buckets_differing": table.buckets_differing,
                                        "rows_repaired": table.rows_repaired}}
                           for name, table in sorted(self.tables.items())}}


@dataclass
class Fleet:
    """The mirrors KV holds now: readable states, and the keys whose value is not one."""

    states: dict[str, MirrorState] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)  # mirror id -> why

    @property
    def mirror_ids(self) -> set[str]:
        return set(self.states) | set(self.unreadable)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class NotAState(ValueError):
    """A value in KV ``mirrors`` that is not a mirror's state (the message says why)."""


def parse_state(mirror_id: str, data: bytes) -> MirrorState:
    """A state value (:class:`NotAState`: not one)."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise NotAState("not JSON") from None
    if not isinstance(value, dict):
        raise NotAState("not a JSON object")
    if value.get("mirror_id") != mirror_id:
        raise NotAState(f"mirror_id {str(value.get('mirror_id'))[:80]!r} is not its key")
    lag = value.get("lag_seconds")
    if (not isinstance(lag, (int, float)) or isinstance(lag, bool) or not math.isfinite(lag)
            or lag < 0):
        raise NotAState("lag_seconds is not a number of seconds")
    tables = value.get("tables")
    if not isinstance(tables, dict):
        raise NotAState("tables is not an object")
    parsed = {}
    for name, table in tables.items():
        if not isinstance(table, dict) or not isinstance(table.get("status"), str):
            raise NotAState(f"table {name[:80]!r} has no status")
        verification = table.get("last_verification")
        if not isinstance(verification, dict):
            verification = {}
        parsed[name] = MirroredTable(
            status=table["status"], applied_lsn=_text(table.get("applied_lsn")),
            verification_id=_text(verification.get("verification_id")),
            verification_status=_text(verification.get("status")),
            buckets_differing=_count(verification.get("buckets_differing")),
            rows_repaired=_count(verification.get("rows_repaired")),
            reason=_text(table.get("reason")))
    lag_bytes = value.get("lag_bytes")
    return MirrorState(mirror_id, float(lag), lag_bytes if isinstance(lag_bytes, int) else None,
                       _text(value.get("updated_at")), parsed, _text(value.get("stopped_at")))


async def read_fleet(js: JetStreamContext, bucket: str) -> Fleet:
    """Every mirror's state in KV ``bucket`` (by :func:`kv_values`: no consumer needed,
    so a user that may only read the bucket can)."""
    fleet = Fleet()
    for mirror_id, value in (await kv_values(js, bucket)).items():
        try:
            fleet.states[mirror_id] = parse_state(mirror_id, value)
        except NotAState as exc:
            fleet.unreadable[mirror_id] = str(exc)
    return fleet


@dataclass(frozen=True)
class Judgement:
    passed: bool
    description: str
    metadata: dict[str, Any]
    warning_only: bool = False  # failed, but nothing is wrong yet (severity WARN)


def seen_since(last_seen: Mapping[str, float], fleet: Fleet, now: float,
               keep_seconds: float) -> dict[str, float]:
    """Each mirror's last time seen: those in ``fleet`` now, the others as ``last_seen``
    says while it is at most ``keep_seconds`` old (then a gone mirror is forgotten)."""
    seen = {mirror_id: when for mirror_id, when in last_seen.items()
            if now - when <= keep_seconds}
    seen.update(dict.fromkeys(fleet.mirror_ids, now))
    return seen


def stopped_since(last_stopped: Mapping[str, str], fleet: Fleet,
                  seen: Mapping[str, float]) -> dict[str, str]:
    """Each mirror that stopped on purpose -> when: those whose state says so now, and those
    ``last_stopped`` remembers whose state is gone since (the bucket's TTL) while ``seen``
    (:func:`seen_since`) still remembers them. One that reports running again is not."""
    stopped = {mirror_id: when for mirror_id, when in last_stopped.items()
               if mirror_id in seen and mirror_id not in fleet.mirror_ids}
    stopped.update((mirror_id, state.stopped_at) for mirror_id, state in fleet.states.items()
                   if state.stopped_at is not None)
    return stopped


def freshness(fleet: Fleet, last_seen: Mapping[str, float], lag_critical_seconds: float,
              stopped: Mapping[str, str] | None = None) -> Judgement:
    """``mirrors_fresh``: failed when a mirror is more than ``lag_critical_seconds`` behind
    the source, when one has a table waiting (its schema cannot be mirrored: it follows
    nothing of it until the source changes), when one that was seen (``last_seen``) is gone,
    or when one's state is unreadable. A mirror that stopped on purpose (``stopped``:
    :func:`stopped_since`) is neither gone nor judged by its lag (it follows nothing until
    started again)."""
    stopped = stopped or {}
    lagging = {mirror_id: state.lag_seconds for mirror_id, state in fleet.states.items()
               if state.lag_seconds > lag_critical_seconds and mirror_id not in stopped}
    waiting = {mirror_id: {name: table.reason for name, table in sorted(state.tables.items())
                           if table.status == WAITING_FOR_SCHEMA}
               for mirror_id, state in fleet.states.items() if mirror_id not in stopped}
    waiting = {mirror_id: tables for mirror_id, tables in waiting.items() if tables}
    gone = sorted(set(last_seen) - fleet.mirror_ids - set(stopped))
    problems = [f"{len(lagging)} behind by more than {lag_critical_seconds:.0f}s"] * bool(
        lagging) + [f"{len(waiting)} with a table waiting for a schema it can mirror ("
                    + "; ".join(f"{mirror_id}: {', '.join(tables)}"
                                for mirror_id, tables in list(waiting.items())[:5])
                    + ")"] * bool(waiting) + [f"{len(gone)} gone"] * bool(gone) + [
        f"{len(fleet.unreadable)} unreadable"] * bool(fleet.unreadable)
    lags = [state.lag_seconds for mirror_id, state in fleet.states.items()
            if mirror_id not in stopped]
    running = len(set(fleet.states) - set(stopped))
    return Judgement(
        passed=not problems,
        description=(("mirrors: " + ", ".join(problems)) if problems
                     else f"{running} mirror(s) within {lag_critical_seconds:.0f}s of the "
                     "source") + (f"; {len(stopped)} stopped" if stopped else ""),
        metadata={"mirrors": len(fleet.mirror_ids), "max_lag_seconds": max(lags, default=0.0),
                  "lagging": lagging, "waiting": waiting, "gone": gone,
                  "unreadable": fleet.unreadable,
                  "stopped": dict(sorted(stopped.items()))})


def equality(table: str, verification_id: str, states: Iterable[MirrorState]) -> Judgement | None:
    """``mirrors_equal_source`` of ``table`` for its latest verification: passed when every
    mirror following the table met it ``equal`` or ``repaired``; failed (ERROR) when one
    found it differ or not comparable, (WARN) while some have not met it yet or are
    resyncing (the bridge lost its slot since their last verification: whatever they met
    before, they may lack changes until the next one finds them equal). None: no mirror
    follows the table."""
    followers = [state for state in states if table in state.tables]
    if not followers:
        return None
    outcome: dict[str, str] = {}
    differing = repaired = 0
    for state in followers:
        mirrored = state.tables[table]
        met = mirrored.verification_id == verification_id
        outcome[state.mirror_id] = (mirrored.verification_status or "?") if met else "pending"
        if mirrored.status == RESYNCING and outcome[state.mirror_id] in (*PASSING, "pending"):
            outcome[state.mirror_id] = RESYNCING
        if met:
            differing += mirrored.buckets_differing
            repaired += mirrored.rows_repaired
    failing = sorted(m for m, status in outcome.items() if status not in WAITING)
    pending = sorted(m for m, status in outcome.items() if status == "pending")
    resyncing = sorted(m for m, status in outcome.items() if status == RESYNCING)
    not_comparable = sorted(m for m, status in outcome.items() if status == "not_comparable")
    if failing:
        description = f"{len(failing)} of {len(followers)} mirror(s) not equal: " + ", ".join(
            f"{m} ({outcome[m]})" for m in failing[:20])
    elif pending or resyncing:
        waiting = []
        if pending:
            waiting.append(f"{len(pending)} of {len(followers)} mirror(s) have not met "
                           f"verification {verification_id} yet")
        if resyncing:
            waiting.append(f"{len(resyncing)} of {len(followers)} mirror(s) resyncing after "
                           "the bridge lost its slot (not verified since): "
                           + ", ".join(resyncing[:20]))
        description = "; ".join(waiting)
    else:
        description = f"{len(followers)} mirror(s) equal the source at {verification_id}"
    return Judgement(
        passed=not failing and not pending and not resyncing, description=description,
        metadata={"verification_id": verification_id, "mirrors": outcome,
                  "buckets_differing": differing, "rows_repaired": repaired,
                  "not_comparable": not_comparable, "pending": pending,
                  "resyncing": resyncing},
        warning_only=not failing)
