"""``cdc-platform mirror verify``: each table's digest recomputed from the rows of a mirror's
SQLite file and compared with the digest the mirror kept as it wrote them
(docs/verification.md, "On demand"). Reading only, in one read transaction (a running
mirror may hold the file): a bucket that differs holds rows changed behind the mirror's back
(deleted, altered or added by another writer, a table restored from an older copy)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cdc_platform.mirror import positions
from cdc_platform.mirror.digests import read_digest, scan_digest
from cdc_platform.mirror.errors import MirrorError
from cdc_platform.mirror.repair import REPAIR_PREFIX
from cdc_platform.mirror.store import SHADOW_PREFIX
from cdc_platform.mirror.verifications import last_verification
from cdc_platform.wire.digest import TableDigest

_LISTED_BUCKETS = 20  # a line names at most this many differing buckets


@dataclass
class TableCheck:
    """One table's comparison: ``differing`` buckets (at 14 bits) with (kept count, file
    count); ``why`` says why it was not compared (None: it was)."""

    table: str
    rows: int = 0
    differing: dict[int, tuple[int, int]] = field(default_factory=dict)
    why: str | None = None
    last: str | None = None  # the last source verification met

    def line(self) -> str:
        if self.why is not None:
            text = f"{self.table}: not compared: {self.why}"
        elif not self.differing:
            text = f"{self.table}: equal ({self.rows} rows)"
        else:
            listed = ", ".join(f"{bucket} (kept {kept} rows, file {found})" for bucket, (
                kept, found) in list(self.differing.items())[:_LISTED_BUCKETS])
            more = len(self.differing) - _LISTED_BUCKETS
            text = (f"{self.table}: {len(self.differing)} of 16384 buckets differ: {listed}"
                    f"{f' and {more} more' if more > 0 else ''}; rows changed behind the "
                    "mirror's back")
        return f"{text}; last source verification: {self.last or 'none'}"


def verify_file(path: str | Path, tables: Sequence[str] = ()) -> list[TableCheck]:
    """Each mirrored table of ``path`` (or of ``tables``) compared; MirrorError when the file
    cannot be read as a mirror or a table asked for is not in it."""
    with positions.reading_file(path) as db:  # (the rows and the kept digests agree)
        return _checks(db, tables)


def _checks(db: sqlite3.Connection, tables: Sequence[str]) -> list[TableCheck]:
    states = {name: positions.read_state(db, name) for name in positions.table_names(db)
              if not name.startswith((SHADOW_PREFIX, REPAIR_PREFIX))}
    missing = [name for name in tables if name not in states]
    if missing:
        raise MirrorError(f"not mirrored in this file: {', '.join(missing)}")
    shapes = positions.load_shapes(db)
    checks = []
    for name in tables or sorted(states):
        state = states[name]
        check = TableCheck(name, last=last_verification(db, name))
        checks.append(check)
        kept = _read_kept(db, name)
        if state is None or state.status != "streaming":
            check.why = f"it is {state.status if state else 'not known'}"
        elif name not in shapes:
            check.why = "its shape is not recorded"
        elif kept is None:
            check.why = ("its digest is not kept (the mirror ran with CDC_MIRROR_DIGESTS=off, "
                         "or the table has more columns than a digest trigger takes)")
        if check.why is not None:
            continue
        assert kept is not None
        scanned = scan_digest(db, shapes[name])
        check.rows = sum(scanned.counts)
        check.differing = {bucket: (kept.counts[bucket], scanned.counts[bucket])
                           for bucket in kept.differing(scanned)}
    return checks


def _read_kept(db: sqlite3.Connection, table: str) -> TableDigest | None:
    try:
        return read_digest(db, table)
    except sqlite3.OperationalError:  # (a file an older mirror wrote: no digests table)
        return None
