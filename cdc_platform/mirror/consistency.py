"""Consistency across tables: the mirror's file shows only states the source had.

Each table is bootstrapped from a snapshot at its own LSN, so two tables loaded one after the
other are at different points of the source's history until the stream has carried both to
the same one. So a table is never loaded in place: its snapshot goes into a *shadow* (the
table ``SHADOW_PREFIX + table`` of the same file, with its own row in the state table),
chunk by chunk in short transactions while the other tables keep following `CDC`; then the
shadow follows `CDC` like any table (its events are applied to the shadow), and it is swapped
in (dropped and renamed in one SQLite transaction) at the first commit where it and every
streaming table equal the source at one LSN. That LSN is recorded with the rows in the
same transaction (``CONSISTENT_TABLE``), so a reader holding one read transaction sees the
tables and the point they are consistent at. A stale table stops changing (it cannot follow)
and leaves the set the recorded LSN speaks for (its status says so) until its shadow is
swapped in.

Points. A table whose snapshot has cutover LSN ``s`` and whose last applied transaction
committed at ``h`` equals the source at every LSN from ``point = max(s, h + 1)`` up to its
next change. Within one pass over the stream, every followed table holds every transaction
of the pass up to the last whole one read, ``c`` (a table ahead of the pass, from an earlier
pass, had no change between its position and the pass's). So all of them equal the source at
``c + 1`` when every point is at most ``c + 1``; tables whose points are all the same are at
that point. Anything else is not known to be consistent: a shadow waits, and the record says
"not known" (NULL) only when a commit changed a streaming table while its points disagree.

Liveness. A shadow whose cutover is ahead of the others waits for a transaction at or after
it. When the pass has read the whole stream, the stream's last message (any table's, or a
watermark marker) serves too: stream order is commit order, so every transaction that
committed before it is in the followed tables. A source that writes nothing at all never
provides one: after ``IDLE_SWAP_SECONDS`` with nothing to read, the shadows are swapped in
anyway and the record says NULL (not known) until the next change proves a point.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from cdc_platform.mirror.store import SHADOW_PREFIX

IDLE_SWAP_SECONDS = 2.0


def shadow_name(table: str) -> str:
    """The local table ``table``'s snapshot is loaded into and caught up in."""
    return SHADOW_PREFIX + table


def shadow_event(event: Mapping[str, Any], shadow: str) -> dict[str, Any]:
    """``event`` applied to the shadow ``shadow`` instead of its table (a schema event's
    ``table_schema`` too: it names the table the store alters)."""
    rewritten = dict(event)
    rewritten["table"] = shadow
    schema = event.get("table_schema")
    if isinstance(schema, Mapping):
        rewritten["table_schema"] = {**schema, "table": shadow}
    return rewritten


def table_point(cutover_lsn: int, applied_commit_lsn: int) -> int:
    """The first LSN at which a table equals the source (see the module docstring)."""
    return max(cutover_lsn, applied_commit_lsn + 1 if applied_commit_lsn else 0)


def consistent_point(points: Iterable[int], read_through: int | None) -> int | None:
    """The LSN at which tables at ``points`` all equal the source, when the pass has read
    every transaction up to ``read_through`` (the commit LSN of its last whole one; None:
    none yet); None when it is not known."""
    listed = list(points)
    if not listed:
        return None
    top = max(listed)
    if read_through is not None and top <= read_through + 1:
        return read_through + 1
    return top if all(point == top for point in listed) else None


def joining(visible: Mapping[str, int], shadows: Mapping[str, int],
            read_through: int | None) -> tuple[list[str], int | None]:
    """(the shadows that can be swapped in now, keeping the streaming tables consistent; the
    point the file is then consistent at). ``visible`` and ``shadows``: table -> point."""
    points = list(visible.values())
    chosen = []
    for table, point in sorted(shadows.items(), key=lambda item: item[1]):
        if consistent_point([*points, point], read_through) is not None:
            chosen.append(table)
            points.append(point)
    return chosen, consistent_point(points, read_through)
