"""A repair snapshot's buckets (docs/verification.md Part 2, item 4): which rows it keeps,
selected by PostgreSQL where it can hash the key (``postgres/key_hash.py``), else by the task
after converting the key columns as the chunker converts them. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import chain

from psycopg import sql

from cdc_platform.postgres.catalog import TableSchema
from cdc_platform.postgres.key_hash import (
    MAX_SQL_BITS,
    bucket_predicate,
    bucket_ranges,
    sql_key_kinds,
)
from cdc_platform.snapshot.chunks import Chunker, ChunkLayout, Converter
from cdc_platform.wire.digest import HASH_BITS, MAX_HELD_BITS, RowDigester


@dataclass(frozen=True, slots=True)
class BucketSelection:
    """Buckets ``buckets`` of a table at ``bits`` bits (sorted, distinct): the rows whose key
    hash's top ``bits`` bits are one of them."""

    bits: int
    buckets: tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not 0 <= self.bits <= min(MAX_HELD_BITS,
                                                                   MAX_SQL_BITS):
            raise ValueError(f"bits must be 0..{min(MAX_HELD_BITS, MAX_SQL_BITS)}, "
                             f"not {self.bits}")
        if not self.buckets or any(not 0 <= bucket < 1 << self.bits
                                   for bucket in self.buckets):
            raise ValueError(f"buckets must be a non-empty list of numbers below 2^{self.bits}")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError("buckets must be sorted and distinct")

    @classmethod
    def of(cls, bits: int, buckets: Sequence[int]) -> BucketSelection:
        """The selection of ``buckets`` in any order, repeats dropped."""
        return cls(bits, tuple(sorted(set(buckets))))

    @classmethod
    def union(cls, selections: Iterable[tuple[int, Sequence[int]]]) -> BucketSelection:
        """One selection holding every row of ``selections`` (``(bits, buckets)`` each), at
        the finest of their bits: what one repair run of several requests reads."""
        wanted = list(selections)
        bits = max(bits for bits, _ in wanted)
        return cls.of(bits, [finer for coarse_bits, buckets in wanted for bucket in buckets
                             for finer in range(bucket << (bits - coarse_bits),
                                                (bucket + 1) << (bits - coarse_bits))])

    @property
    def share(self) -> float:
        """The share of the table's buckets selected."""
        return len(self.buckets) / (1 << self.bits)

    def to_text(self) -> str:
        """``bits:ranges``, e.g. ``10:3-5,9``: short enough for a run tag at any size."""
        return f"{self.bits}:" + ",".join(
            str(first) if first == last else f"{first}-{last}"
            for first, last in bucket_ranges(self.buckets))

    @classmethod
    def from_text(cls, text: str) -> BucketSelection:
        """What :meth:`to_text` wrote; ValueError when it is not that."""
        bits, _, ranges = text.partition(":")
        buckets: list[int] = []
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            buckets.extend(range(int(first), int(last or first) + 1))
        return cls(int(bits), tuple(buckets))

    def sql_predicate(self, schema: TableSchema) -> sql.Composable | None:
        """The ``WHERE`` condition selecting the rows in PostgreSQL, or None when its key
        must be hashed in the task (:class:`BucketFilter`)."""
        kinds = sql_key_kinds(schema.columns, schema.primary_key)
        return None if kinds is None else bucket_predicate(kinds, self.bits, self.buckets)


class BucketFilter:
    """The lines of COPY text blocks whose key falls in ``selection``, for keys PostgreSQL
    cannot hash: the key columns (a table without a primary key: every column) converted by
    ``Chunker.rows_of`` with the snapshot's own converters (a value none accepts stays text,
    as in the chunk), then ``RowDigester.key_hash``."""

    def __init__(self, layout: ChunkLayout, converters: Sequence[Converter],
                 selection: BucketSelection) -> None:
        key = layout.key_columns or tuple(range(len(layout.columns)))
        names = tuple(layout.columns[index] for index in key)
        self._parser = Chunker(replace(layout, zstd_level=None, dictionary=None,
                                       dictionary_id=None), converters, 0)
        self._keys = Chunker(replace(layout, columns=names, key_columns=tuple(range(len(key))),
                                     zstd_level=None, dictionary=None, dictionary_id=None),
                             [converters[index] for index in key], 0)
        self._key = key
        self._width = len(layout.columns) + (1 if layout.with_ctid else 0)
        self._digester = RowDigester(names, names)
        self._shift = HASH_BITS - selection.bits
        self._buckets = frozenset(selection.buckets)

    def keep(self, block: bytes | bytearray | str) -> str:
        """The complete lines of ``block`` (COPY text) whose key is in the buckets."""
        lines, fields, escapes = self._parser.parse(block)
        if not lines:
            return ""
        width = self._width
        key_fields = list(chain.from_iterable(zip(*(fields[index::width]
                                                    for index in self._key), strict=True)))
        rows, _ = self._keys.rows_of(key_fields, len(lines), escapes, {})
        shift, buckets = self._shift, self._buckets
        kept = [line for line, key_hash in zip(lines, map(self._digester.key_hash, rows),
                                               strict=True)
                if key_hash >> shift in buckets]
        return "".join(line + "\n" for line in kept)
