"""``cdc-platform mirror status``: what a mirror's SQLite file holds, read without writing
(a running mirror may hold it)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from cdc_platform.lsn import format_lsn
from cdc_platform.mirror.positions import CONSISTENT_TABLE, STATE_TABLE, reading_file
from cdc_platform.mirror.repair import REPAIR_PREFIX
from cdc_platform.mirror.store import SHADOW_PREFIX


def status_lines(path: str | Path) -> list[str]:
    """One line per table and one for the LSN every streaming table is consistent at."""
    with reading_file(path) as db:  # (tables and the LSN agree)
        rows = db.execute(
            f"SELECT wire_table, status, snapshot_id, cutover_lsn, applied_commit_lsn,"
            f" stream_seq, reason FROM {STATE_TABLE}").fetchall()
        try:
            consistent = db.execute(f"SELECT lsn FROM {CONSISTENT_TABLE}").fetchone()
        except sqlite3.OperationalError:  # (a file an older mirror wrote)
            consistent = None
    shown = []
    for table, status, snapshot_id, cutover, applied, seq, reason in rows:
        if table.startswith(SHADOW_PREFIX):
            table = table[len(SHADOW_PREFIX):]
            status = ("loading its snapshot" if status == "bootstrapping"
                      else "snapshot loaded, catching up" if status == "streaming" else status)
            status = f"(shadow) {status}"
        elif table.startswith(REPAIR_PREFIX):
            table = table[len(REPAIR_PREFIX):]
            status = ("loading its repair snapshot" if status == "bootstrapping"
                      else "repair snapshot loaded, catching up" if status == "streaming"
                      else status)
            status = f"(repair shadow) {status}"
        shown.append((table, status, snapshot_id, cutover, applied, seq, reason))
    lines = []
    for table, status, snapshot_id, cutover, applied, seq, reason in sorted(shown):
        line = (f"{table}: {status}; snapshot {snapshot_id} at lsn {format_lsn(cutover)}; "
                f"applied through {format_lsn(applied) if applied else '-'}; "
                f"CDC sequence {seq}")
        lines.append(line + (f"; {reason}" if reason else ""))
    lines.append("consistent lsn (every streaming table): "
                 + (consistent[0] if consistent and consistent[0] else "not known"))
    return lines
