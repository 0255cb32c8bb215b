"""Splitting a table into ctid block ranges, one per Spark task. Pure: no I/O.

A range ``[start, end)`` of heap blocks is read with a TID range scan (PostgreSQL 14+)::

    WHERE ctid >= '(start,0)'::tid AND ctid < '(end,0)'::tid

The first range starts at block 0 and the last one has no upper bound, so together they
cover every block of the table, including blocks appended after the size was measured
(rows in them are invisible to the exported snapshot anyway, but nothing relies on that).
Ranges work for every heap table, with or without a primary key, and within one snapshot a
range always yields the same rows in the same (physical) order: that is what makes a
retried task publish identical chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from psycopg import sql

DEFAULT_RANGE_BYTES = 64 * 1024**2
DEFAULT_RANGES_PER_CORE = 2


@dataclass(frozen=True, slots=True)
class BlockRange:
    """Blocks ``start`` .. ``end - 1`` (``end`` None: to the end of the table)."""

    index: int
    start: int
    end: int | None

    def predicate(self) -> sql.Composable:
        """The ``WHERE`` condition selecting this range's tuples."""
        lower = sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({self.start},0)"))
        if self.end is None:
            return lower
        return sql.SQL("{} AND ctid < {}::tid").format(lower, sql.Literal(f"({self.end},0)"))


def range_count(total_blocks: int, block_size: int, parallelism: int, *,
                range_bytes: int = DEFAULT_RANGE_BYTES,
                ranges_per_core: int = DEFAULT_RANGES_PER_CORE) -> int:
    """How many ranges: enough to keep every core busy (``ranges_per_core`` each, so a slow
    range does not leave cores idle at the end) and none larger than ``range_bytes``; never
    more ranges than blocks, and at least one."""
    if total_blocks <= 0:
        return 1
    by_size = math.ceil(total_blocks * block_size / range_bytes)
    wanted = max(ranges_per_core * max(parallelism, 1), by_size)
    return max(1, min(wanted, total_blocks))


def plan_ranges(total_blocks: int, count: int) -> list[BlockRange]:
    """``count`` contiguous ranges of (nearly) equal block counts covering the table."""
    if count < 1:
        raise ValueError("count must be at least 1")
    count = min(count, max(total_blocks, 1))
    bounds = [round(i * total_blocks / count) for i in range(count + 1)]
    return [BlockRange(i, bounds[i], bounds[i + 1] if i + 1 < count else None)
            for i in range(count)]
