"""COPY text lines -> encoded, size-bounded snapshot chunks. Pure: no I/O.

A :class:`Chunker` takes the COPY text of one block range, in blocks of complete lines in the
order ``COPY`` produced them, converts it column by column with the CDC converters
(``cdc_platform.protocol.values``; fields decoded as ``copy_text`` does) and cuts it into
chunks of at most ``chunk_rows`` rows whose message (payload + headers) fits
the server's ``max_payload`` after encoding and compression. Every decision depends only on
the rows and their order, never on how the bytes arrived, so reading the same range of the
same snapshot again yields byte-identical chunks with the same numbers: a retried Spark task
republishes the same ``Nats-Msg-Id`` values and JetStream drops the copies.

Chunk payload (msgpack map or JSON object)::

    {"table", "operation": "snapshot", "snapshot_id", "chunk", "lsn",   # the seed's fields
     "data": [{column: value, ...}, ...],                                # typed like CDC
     "partition", "schema_fingerprint"}

Chunk numbers are ``partition * 1_000_000 + n`` (n = 0, 1, ... within the range): unique and
deterministic within the snapshot, **not contiguous**; the meta message says how many chunks
there are (``batch_count``) and which numbers each partition used (``chunks``).

Size: a chunk is first cut on an estimate (line length plus the per-row key overhead, scaled
by the compression ratio of the previous chunk), then encoded; if the message is still too
large it is split in halves until every part fits. A single row that does not fit becomes a
chunk of its own marked ``oversized``: the publisher sends it as a claim check
(docs/wire-contract.md "Large values").
"""

from __future__ import annotations

import contextlib
import gc
import logging
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, repeat
from operator import add
from typing import TYPE_CHECKING, Any

import msgpack
import zstandard

from cdc_platform.errors import ConversionError, SnapshotError
from cdc_platform.protocol import values
from cdc_platform.protocol.copy_text import unescape
from cdc_platform.speedups import compiled_twin
from cdc_platform.wire import (
    CONTENT_ENCODING_ZSTD,
    CONTENT_TYPES,
    HEADER_CONTENT_ENCODING,
    HEADER_CONTENT_TYPE,
    HEADER_MSG_ID,
    HEADER_SCHEMA_FINGERPRINT,
    HEADER_ZSTD_DICT,
    Format,
    chunk_msg_id,
    encoder,
    snapshot_chunk_subject,
)
from cdc_platform.wire.digest import RowDigester, TableDigest, digest_columns

log = logging.getLogger(__name__)

CHUNK_NUMBER_STRIDE = 1_000_000
OPERATION = "snapshot"
# The size estimate is only an estimate: cut at this share of the budget so that the exact
# check after encoding rarely has to split a chunk.
_ESTIMATE_FILL = 0.9
# Header bytes beyond "Key: value\r\n" lines: "NATS/1.0\r\n" and the final "\r\n".
_HEADER_FRAME = len("NATS/1.0\r\n\r\n")
Converter = Callable[[str], Any]


# The column kinds of pack_rows; anything else is ROW_CALL (the converter, then msgpack).
ROW_KEEP = 0  # the text is the value
ROW_INT = 1
ROW_FLOAT = 2
ROW_BOOL = 3
ROW_TIMESTAMPTZ = 4
ROW_CALL = 5

#: ``(fields, count, width, packed_names, kinds, converters, unescape) -> rows``: ``count``
#: rows of COPY text fields each packed straight into its msgpack row map (the bytes of
#: converting the fields and packing the map). Compiled only: the pure code converts the
#: fields and packs the row maps (:meth:`Chunker.rows_of`).
pack_rows: Callable[[list[str], int, int, tuple[bytes, ...], tuple[int, ...],
                     tuple[Converter, ...], Callable[[str], str]], list[bytes]] | None = None
#: ``(digest, digester, fields, count, width, kinds, converters, unescape) -> rows``: ``count``
#: rows of COPY text fields hashed straight into a table digest (the hashes of converting
#: the fields, all rows or none). Compiled only: the pure code converts the columns and
#: digests them (:meth:`Chunker.digest`).
digest_fields: Callable[[TableDigest, RowDigester, list[str], int, int, tuple[int, ...],
                         tuple[Converter, ...], Callable[[str], str]], int] | None = None
#: ``(digest, digester, text, width, kinds, converters, unescape) -> rows``: a block's COPY
#: text hashed into a table digest without a Python str per field (:meth:`Chunker.digest`
#: of :meth:`Chunker.parse`'s fields), the GIL released while it hashes rows whose fields
#: need no Python (the range tasks of one process hash at once); None hands a malformed
#: block back. Compiled only.
digest_block: Callable[[TableDigest, RowDigester, str, int, tuple[int, ...],
                        tuple[Converter, ...], Callable[[str], str]], int | None] | None = None


def _compiled_kinds(converters: Sequence[Converter]) -> tuple[int, ...] | None:
    """The compiled row packer's column kinds (``ROW_*``), None without it."""
    if pack_rows is None:
        return None
    special = {int: ROW_INT, float: ROW_FLOAT, values._bool: ROW_BOOL,
               values.timestamptz: ROW_TIMESTAMPTZ, values.timestamptz_python: ROW_TIMESTAMPTZ}
    special.update(dict.fromkeys(values.TEXT_CONVERTERS, ROW_KEEP))
    return tuple(special.get(convert, ROW_CALL) for convert in converters)


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _array_header(count: int) -> bytes:
    """The msgpack array header msgpack itself writes for ``count`` items."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 65536:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def chunk_number(partition: int, n: int) -> int:
    if not 0 <= n < CHUNK_NUMBER_STRIDE:
        raise SnapshotError(f"partition {partition} needs more than {CHUNK_NUMBER_STRIDE} "
                            "chunks: plan more ranges (smaller range_bytes)")
    return partition * CHUNK_NUMBER_STRIDE + n


def headers_size(headers: dict[str, str]) -> int:
    """Bytes the NATS header block takes (the server counts them in ``max_payload``)."""
    return _HEADER_FRAME + sum(len(k.encode()) + len(v.encode()) + 4
                               for k, v in headers.items())


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Everything that shapes a table's chunks (picklable: it travels to Spark tasks)."""

    table: str
    snapshot_id: str
    lsn: str
    schema_fingerprint: str
    columns: tuple[str, ...]
    # Indexes (into ``columns``) of the primary key, named in errors. Empty: the COPY has
    # one extra last field, the row's ctid, used instead (and never sent).
    key_columns: tuple[int, ...]
    format: Format = "msgpack"
    chunk_rows: int = 10_000
    max_payload: int = 1024 * 1024
    zstd_level: int | None = None  # None: no compression
    dictionary: bytes | None = field(default=None, repr=False)
    dictionary_id: int | None = None

    @property
    def with_ctid(self) -> bool:
        return not self.key_columns

    def headers(self, chunk: int) -> dict[str, str]:
        headers = {HEADER_MSG_ID: chunk_msg_id(self.snapshot_id, chunk),
                   HEADER_CONTENT_TYPE: CONTENT_TYPES[self.format],
                   HEADER_SCHEMA_FINGERPRINT: self.schema_fingerprint}
        if self.zstd_level is not None:
            headers[HEADER_CONTENT_ENCODING] = CONTENT_ENCODING_ZSTD
            if self.dictionary_id is not None:
                headers[HEADER_ZSTD_DICT] = str(self.dictionary_id)
        return headers

    def payload_budget(self) -> int:
        """Largest payload that fits ``max_payload`` with the headers of any chunk."""
        widest = self.headers(chunk_number(CHUNK_NUMBER_STRIDE - 1, CHUNK_NUMBER_STRIDE - 1))
        return self.max_payload - headers_size(widest)

    def compressor(self) -> zstandard.ZstdCompressor | None:
        if self.zstd_level is None:
            return None
        if self.dictionary is None:
            return zstandard.ZstdCompressor(level=self.zstd_level, write_content_size=True)
        dictionary = zstandard.ZstdCompressionDict(self.dictionary)
        dictionary.precompute_compress(level=self.zstd_level)
        return zstandard.ZstdCompressor(dict_data=dictionary, write_content_size=True)


@dataclass(frozen=True, slots=True)
class Chunk:
    number: int
    subject: str
    headers: dict[str, str]
    payload: bytes
    rows: int
    raw_size: int  # encoded size before compression
    # one row whose chunk is over max_payload: published as a claim check (docs/wire-contract.md
    # "Large values"); never set on a chunk of several rows (those are split instead)
    oversized: bool = False


@dataclass(slots=True)
class ChunkStats:
    rows: int = 0
    chunks: int = 0
    bytes_raw: int = 0
    bytes_compressed: int = 0  # = bytes_raw when not compressed
    splits: int = 0  # chunks cut again because the estimate was too optimistic


class Chunker:
    """Cuts one partition's rows into chunks; see the module docstring."""

    def __init__(self, layout: ChunkLayout, converters: Sequence[Converter],
                 partition: int) -> None:
        if len(converters) != len(layout.columns):
            raise ValueError("one converter per column")
        self.layout = layout
        self.partition = partition
        self.stats = ChunkStats()
        self._names = layout.columns
        self._converters = tuple(converters)
        self._width = len(layout.columns) + (1 if layout.with_ctid else 0)
        self._encode = encoder(layout.format)
        self._compressor = layout.compressor()
        self._compress = self._compressor.compress if self._compressor else None
        self._budget = layout.payload_budget()
        if self._budget <= 0:
            raise SnapshotError(f"max_payload {layout.max_payload} leaves no room for a chunk")
        # Per row, the encoding repeats every column name as a map key (+ a few bytes).
        self._row_overhead = sum(len(name.encode()) + 4 for name in self._names) + 2
        self._ratio = 1.0  # compressed/raw of the last chunk: scales the estimate
        self._pending: list[list[str]] = []  # flat field lists of rows not emitted yet
        self._pending_rows = 0
        self._pending_size = 0
        self._pending_escapes = False
        self._next = 0
        self._limit = self._raw_limit()
        # msgpack with the compiled twin: rows are packed straight from the COPY
        # fields (same bytes as packing the row maps), the chunk around them by hand.
        self._digest_kinds = _compiled_kinds(self._converters)
        self._compiled_kinds = self._digest_kinds if layout.format == "msgpack" else None
        if self._compiled_kinds is not None:
            pack = msgpack.Packer(use_bin_type=True, datetime=False).pack
            self._packed_names = tuple(pack(name) for name in self._names)
            head = {"table": layout.table, "operation": OPERATION,
                    "snapshot_id": layout.snapshot_id}
            self._chunk_head = b"".join(pack(k) + pack(v) for k, v in head.items())
            self._chunk_key = pack("chunk")
            self._chunk_lsn = pack("lsn") + pack(layout.lsn) + pack("data")
            self._chunk_tail = (pack("partition") + pack(partition) + pack("schema_fingerprint")
                                + pack(layout.schema_fingerprint))

    # -- parsing ------------------------------------------------------------------------------
    def parse(self, block: bytes | bytearray | str) -> tuple[list[str], list[str], bool]:
        """A block of complete COPY text lines -> (its lines, every field in row order,
        whether any field holds a backslash, i.e. an escape or a NULL).

        Splitting the whole block at once is splitting each line (COPY text never has a raw
        tab or newline inside a field); fields are decoded later, column by column, exactly
        as ``copy_text.parse_line`` decodes them.
        """
        text = block if isinstance(block, str) else block.decode()
        if not text:
            return [], [], False
        if text[-1] != "\n":
            raise ConversionError("COPY text block does not end at a row boundary")
        lines = text.split("\n")
        lines.pop()
        fields = text.replace("\n", "\t").split("\t")
        fields.pop()
        width = self._width
        if len(fields) != len(lines) * width:
            found = next((line.count("\t") + 1 for line in lines
                          if line.count("\t") + 1 != width), "?")
            raise ConversionError(f"{self.layout.table}: COPY row has {found} fields, "
                                  f"expected {width}")
        return lines, fields, "\\" in text

    def rows(self, block: bytes | bytearray | str) -> list[dict[str, Any]]:
        """Typed row maps of a block, without chunking (dictionary samples)."""
        lines, fields, escapes = self.parse(block)
        return self.rows_of(fields, len(lines), escapes, {})[0] if lines else []

    def rows_of(self, fields: list[str], count: int, escapes: bool = True,
                raw: dict[int, list[str]] | None = None,
                ) -> tuple[list[dict[str, Any]], Sequence[str] | None]:
        """``count`` rows of flat ``fields`` -> typed row maps (and the ctids, for tables
        without a primary key): ``columns_of``'s columns zipped into rows."""
        columns = self.columns_of(fields, escapes, raw)
        if self._names:
            names = self._names
            data = [dict(zip(names, row, strict=True))
                    for row in zip(*columns[:len(names)], strict=True)]
        else:
            data = [{} for _ in range(count)]
        return data, (columns[-1] if self.layout.with_ctid else None)

    def digest(self, digest: TableDigest, digester: RowDigester, fields: list[str], count: int,
               escapes: bool = True, raw: dict[int, list[str]] | None = None) -> int:
        """Add ``count`` rows of flat ``fields`` to ``digest`` (``digester`` made with the
        layout's columns, in order): ``digest_columns`` of ``columns_of``'s values, hashed
        straight from the fields by the compiled twin where it is built. With ``raw``, a
        text no converter accepts is hashed as text (``columns_of``); the number added."""
        if digest_fields is not None and self._digest_kinds is not None:
            try:
                return digest_fields(digest, digester, fields, count, self._width,
                                     self._digest_kinds, self._converters, unescape)
            except (ValueError, TypeError, ArithmeticError, ConversionError):
                if raw is None:
                    raise  # (nothing was added)
        columns = self.columns_of(fields, escapes, raw)
        return digest_columns(digest, digester, columns[:len(self._names)], count)

    def digest_block(self, digest: TableDigest, digester: RowDigester,
                     block: bytes | bytearray | str, raw: dict[int, list[str]] | None = None
                     ) -> int:
        """Add a block's rows (complete COPY text lines) to ``digest``: :meth:`digest` of
        :meth:`parse`'s fields, the compiled twin reading the text itself where it is built;
        the number added."""
        text = block if isinstance(block, str) else block.decode()
        if digest_block is not None and self._digest_kinds is not None:
            try:
                added = digest_block(digest, digester, text, self._width, self._digest_kinds,
                                     self._converters, unescape)
            except (ValueError, TypeError, ArithmeticError, ConversionError):
                if raw is None:
                    raise  # (nothing was added)
                added = None
            if added is not None:
                return added
        lines, fields, escapes = self.parse(text)
        return self.digest(digest, digester, fields, len(lines), escapes, raw) if lines else 0

    def columns_of(self, fields: list[str], escapes: bool = True,
                   raw: dict[int, list[str]] | None = None) -> list[list[Any]]:
        """The rows of flat ``fields`` -> their typed values column by column, in the
        layout's column order (then the ctids, for tables without a primary key): what
        ``wire.digest.digest_columns`` hashes without building row maps.

        Column by column, one converter call per value (``map`` when the column has neither
        escapes nor NULLs). Per field this is ``copy_text.parse_line``: NULL iff the field
        is ``\\N``, else ``unescape(field)``; then the column's converter. A text no
        converter accepts stays text: ``raw`` gets ``{row index: [column, ...]}``
        (docs/wire-contract.md "Type mapping"), so one odd value never stops a snapshot.
        """
        width = self._width
        columns: list[Any] = [fields[i::width] for i in range(width)]
        for index, convert in enumerate(self._converters):
            column = columns[index]
            try:
                if escapes and "\\" in "".join(column):
                    if convert in values.TEXT_CONVERTERS:
                        columns[index] = [None if f == "\\N" else unescape(f) for f in column]
                    else:
                        columns[index] = [None if f == "\\N" else convert(unescape(f))
                                          for f in column]
                elif convert not in values.TEXT_CONVERTERS:
                    columns[index] = list(map(convert, column))
            except (ValueError, TypeError, ArithmeticError, ConversionError):
                if raw is None:
                    raise
                columns[index] = self._convert_leniently(index, column, convert, raw)
        return columns

    def _convert_leniently(self, index: int, column: list[str], convert: Any,
                           raw: dict[int, list[str]]) -> list[Any]:
        """One column value by value: what a converter refuses stays text, named in ``raw``."""
        out: list[Any] = []
        for row_index, copy_field in enumerate(column):
            if copy_field == "\\N":
                out.append(None)
                continue
            text = unescape(copy_field) if "\\" in copy_field else copy_field
            try:
                out.append(convert(text))
            except (ValueError, TypeError, ArithmeticError, ConversionError):
                out.append(text)
                raw.setdefault(row_index, []).append(self._names[index])
        return out

    # -- cutting ------------------------------------------------------------------------------
    def _raw_limit(self) -> float:
        return self._budget * _ESTIMATE_FILL / max(self._ratio, 0.02)

    def add(self, block: bytes | bytearray | str) -> list[Chunk]:
        """Complete COPY text lines, each ending with ``\\n``, in order -> finished chunks.

        Row by row the rule is: a row joins the pending chunk, unless the chunk has rows and
        the row would take its estimated size over the limit (then the chunk is emitted
        first); a chunk reaching ``chunk_rows`` rows is emitted at once. Applied with
        cumulative sizes and one bisection per chunk instead of a Python step per row.
        """
        lines, fields, escapes = self.parse(block)
        count = len(lines)
        if not count:
            return []
        width = self._width
        cumulative = list(accumulate(map(add, map(len, lines), repeat(self._row_overhead))))
        max_rows = self.layout.chunk_rows
        out: list[Chunk] = []
        position = 0
        while position < count:
            base = cumulative[position - 1] if position else 0
            if self._pending_rows and \
                    self._pending_size + cumulative[position] - base > self._limit:
                out += self._emit_pending()
                continue
            fit = bisect_right(cumulative, base + self._limit - self._pending_size,
                               position, count) - position
            take = min(max(fit, 1), max_rows - self._pending_rows)
            self._pending.append(fields[position * width:(position + take) * width])
            self._pending_rows += take
            self._pending_size += cumulative[position + take - 1] - base
            self._pending_escapes |= escapes
            position += take
            if self._pending_rows >= max_rows:
                out += self._emit_pending()
        return out

    def finish(self) -> list[Chunk]:
        """The last, partial chunk (if any rows are left)."""
        return self._emit_pending() if self._pending_rows else []

    def _emit_pending(self) -> list[Chunk]:
        pending, count, escapes = self._pending, self._pending_rows, self._pending_escapes
        self._pending, self._pending_rows, self._pending_size = [], 0, 0
        self._pending_escapes = False
        fields = pending[0] if len(pending) == 1 else list(chain.from_iterable(pending))
        out: list[Chunk] = []
        with _gc_paused():  # no cycles here; collections during millions of allocations cost
            if self._compiled_kinds is not None:
                try:
                    assert pack_rows is not None  # (_compiled_kinds is only set with it)
                    rows = pack_rows(fields, count, self._width, self._packed_names,
                                     self._compiled_kinds, self._converters, unescape)
                except (ValueError, TypeError, ArithmeticError, ConversionError):
                    pass  # a value the converters refuse: the general path keeps it as text
                else:
                    self._encode_packed(rows, 0, fields, out)
                    return out
            raw: dict[int, list[str]] = {}
            data, ctids = self.rows_of(fields, count, escapes, raw)
            self._encode_fitting(data, 0, ctids, out, raw)
        return out

    def _encode_packed(self, rows: list[bytes], offset: int, fields: list[str],
                       out: list[Chunk]) -> None:
        """:meth:`_encode_fitting` for rows packed by the compiled packer: the chunk map is
        written around them, byte for byte what msgpack writes for the chunk's map."""
        number = chunk_number(self.partition, self._next)
        count = len(rows)
        raw = b"".join((b"\x88", self._chunk_head, self._chunk_key, msgpack.packb(number),
                        self._chunk_lsn, _array_header(count), *rows, self._chunk_tail))
        payload = self._compress(raw) if self._compress is not None else raw
        if len(payload) > self._budget:
            if count == 1:
                width = self._width
                data, ctids = self.rows_of(fields[offset * width:(offset + 1) * width], 1,
                                           raw={})
                self._log_oversized(data[0], ctids, 0, len(payload))
                self._finish_chunk(number, 1, raw, payload, out, oversized=True)
                return
            self.stats.splits += 1
            half = count // 2
            self._encode_packed(rows[:half], offset, fields, out)
            self._encode_packed(rows[half:], offset + half, fields, out)
            return
        self._finish_chunk(number, count, raw, payload, out)

    def _encode_fitting(self, data: list[dict[str, Any]], offset: int,
                        ctids: Sequence[str] | None, out: list[Chunk],
                        raw_cells: dict[int, list[str]] | None = None) -> None:
        """Encode ``data`` as one chunk, or split it in halves until every part fits.
        ``raw_cells``: the unconverted cells of the whole batch, by row index (``offset`` is
        ``data[0]``'s)."""
        layout = self.layout
        number = chunk_number(self.partition, self._next)
        payload_map: dict[str, Any] = {
            "table": layout.table, "operation": OPERATION, "snapshot_id": layout.snapshot_id,
            "chunk": number, "lsn": layout.lsn, "data": data, "partition": self.partition,
            "schema_fingerprint": layout.schema_fingerprint}
        cells: list[tuple[int, str]] = [
            (row_index - offset, column)
            for row_index, columns in sorted((raw_cells or {}).items())
            if offset <= row_index < offset + len(data) for column in columns]
        if cells:
            payload_map["raw_cells"] = [list(cell) for cell in cells]
            first_row, first_column = cells[0]
            log.error("%s: no converter accepts %d value(s) of snapshot %s, first %s of row %s: "
                      "sent as the text PostgreSQL printed, listed in the chunk's raw_cells",
                      layout.table, len(cells), layout.snapshot_id, first_column,
                      self._describe_key(data[first_row], ctids, offset + first_row))
        encoded = self._encode(payload_map)
        payload = self._compress(encoded) if self._compress is not None else encoded
        if len(payload) > self._budget:
            if len(data) == 1:
                self._log_oversized(data[0], ctids, offset, len(payload))
                self._finish_chunk(number, 1, encoded, payload, out, oversized=True)
                return
            self.stats.splits += 1
            half = len(data) // 2
            self._encode_fitting(data[:half], offset, ctids, out, raw_cells)
            self._encode_fitting(data[half:], offset + half, ctids, out, raw_cells)
            return
        self._finish_chunk(number, len(data), encoded, payload, out)

    def _finish_chunk(self, number: int, rows: int, raw: bytes, payload: bytes,
                      out: list[Chunk], *, oversized: bool = False) -> None:
        layout = self.layout
        self._next += 1
        self._ratio = len(payload) / len(raw) if raw else 1.0
        self._limit = self._raw_limit()
        stats = self.stats
        stats.rows += rows
        stats.chunks += 1
        stats.bytes_raw += len(raw)
        stats.bytes_compressed += len(payload)
        out.append(Chunk(number, snapshot_chunk_subject(layout.table, layout.snapshot_id, number),
                         layout.headers(number), payload, rows, len(raw), oversized))

    def _log_oversized(self, row: dict[str, Any], ctids: Sequence[str] | None, offset: int,
                       size: int) -> None:
        log.info("%s: row %s encodes to %d bytes, over the %d a chunk may use: sent as a "
                 "claim check", self.layout.table, self._describe_key(row, ctids, offset), size,
                 self._budget)

    def _describe_key(self, row: dict[str, Any], ctids: Sequence[str] | None,
                      offset: int) -> str:
        if ctids is not None:
            return f"ctid={ctids[offset]} (no primary key)"
        return ", ".join(f"{self._names[i]}={row[self._names[i]]!r}"
                         for i in self.layout.key_columns)


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.snapshot import chunks as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    pack_rows, digest_fields, digest_block = (_twin.pack_rows, _twin.digest_fields,
                                              _twin.digest_block)
