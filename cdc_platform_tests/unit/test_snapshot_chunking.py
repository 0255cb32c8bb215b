"""Snapshot planning and chunking without any server: block ranges, chunk cuts, sizes, ids."""

from __future__ import annotations

import itertools
import json
import random
import re
from types import SimpleNamespace

import msgpack
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_platform.consumer.snapshots import decompressor
from cdc_platform.errors import ConversionError
from cdc_platform.protocol.copy_text import iter_rows
from cdc_platform.protocol.values import TypeRegistry, convert_row
from cdc_platform.snapshot.chunks import (
    CHUNK_NUMBER_STRIDE,
    Chunker,
    ChunkLayout,
    chunk_number,
    headers_size,
)
from cdc_platform.snapshot.dictionary import train
from cdc_platform.snapshot.plan import BlockRange, plan_ranges, range_count
from cdc_platform.wire import dictionary_key

# -- plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks,count", [(0, 1), (1, 1), (1, 4), (10, 3), (1000, 7),
                                          (123457, 64)])
def test_ranges_cover_every_block_once(blocks, count):
    ranges = plan_ranges(blocks, count)
    assert ranges[0].start == 0 and ranges[-1].end is None
    assert [r.index for r in ranges] == list(range(len(ranges)))
    for left, right in itertools.pairwise(ranges):
        assert left.end == right.start and left.end > left.start  # contiguous, non-empty
    assert len(ranges) == min(count, max(blocks, 1))
    sizes = [(r.end if r.end is not None else blocks) - r.start for r in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_range_count_follows_cores_and_size():
    assert range_count(0, 8192, 8) == 1
    assert range_count(3, 8192, 8) == 3  # never more ranges than blocks
    assert range_count(1000, 8192, 2) == 4  # 8 MB: 2 ranges per core
    assert range_count(100_000, 8192, 2) == 13  # 781 MiB: by size, 64 MiB each
    gigabyte = 1024**3 // 8192
    assert range_count(gigabyte, 8192, 2) == 16  # 1 GiB / 64 MiB
    assert range_count(gigabyte, 8192, 32) == 64  # 2 x 32 cores


def test_range_predicates():
    assert BlockRange(0, 0, 10).predicate().as_string(None) == \
        "ctid >= '(0,0)'::tid AND ctid < '(10,0)'::tid"
    assert BlockRange(3, 30, None).predicate().as_string(None) == "ctid >= '(30,0)'::tid"


# -- chunking -----------------------------------------------------------------------------------
INT8, TEXT, FLOAT8, JSONB, TEXT_ARRAY, BYTEA, BOOL = 20, 25, 701, 3802, 1009, 17, 16
COLUMNS = [("id", INT8), ("name", TEXT), ("score", FLOAT8), ("doc", JSONB),
           ("tags", TEXT_ARRAY), ("blob", BYTEA), ("ok", BOOL)]


def converters(columns=COLUMNS):
    return TypeRegistry().for_columns([SimpleNamespace(type_oid=oid) for _, oid in columns])


def layout(**overrides):
    values = {"table": "sales/orders", "snapshot_id": "snap-1", "lsn": "1/ABCDEF00",
                  "schema_fingerprint": "f1", "columns": tuple(n for n, _ in COLUMNS),
                  "key_columns": (0,), "chunk_rows": 100, "max_payload": 1024 * 1024}
    values.update(overrides)
    return ChunkLayout(**values)


def line(i: int) -> bytes:
    """A COPY text row: escapes, NULL, empty string, NaN, arrays with quotes."""
    name = ["plain", "", "tab\\there", "back\\\\slash", "new\\nline", "\\\\N"][i % 6]
    score = ["1.5", "NaN", "-Infinity", "0"][i % 4]
    blob = "\\N" if i % 5 == 0 else "\\\\x00ff"
    doc = f'{{"a": [1, 2], "k": {i}}}'
    tags = '{a,"b c",NULL,"q\\\\"x"}'
    ok = "\\N" if i % 3 == 0 else ("t" if i % 2 else "f")
    return "\t".join([str(i), name, score, doc, tags, blob, ok]).encode()


def rows_of(chunks, fmt="msgpack", dictionary=None):
    rows = []
    for chunk in chunks:
        payload = chunk.payload
        if chunk.headers.get("Content-Encoding") == "zstd":
            payload = decompressor(dictionary).decompress(payload)
        decoded = (msgpack.unpackb(payload, raw=False) if fmt == "msgpack"
                   else json.loads(payload))
        assert decoded["chunk"] == chunk.number and len(decoded["data"]) == chunk.rows
        rows += decoded["data"]
    return rows


def block(lines):
    return b"".join(line + b"\n" for line in lines)


def run(chunker, lines, batch_sizes=None):
    """Feed ``lines`` in blocks of random (or the given) numbers of lines."""
    out = []
    position = 0
    rng = random.Random(1)
    while position < len(lines):
        size = batch_sizes or rng.randint(1, 50)
        out += chunker.add(block(lines[position:position + size]))
        position += size
    return out + chunker.finish()


def test_values_are_typed_like_cdc_and_fields_are_the_seeds():
    chunks = run(Chunker(layout(), converters(), partition=2), [line(i) for i in range(12)])
    (chunk,) = chunks
    payload = msgpack.unpackb(chunk.payload, raw=False)
    assert {k: payload[k] for k in ("table", "operation", "snapshot_id", "chunk", "lsn",
                                    "partition", "schema_fingerprint")} == {
        "table": "sales/orders", "operation": "snapshot", "snapshot_id": "snap-1",
        "chunk": 2 * CHUNK_NUMBER_STRIDE, "lsn": "1/ABCDEF00", "partition": 2,
        "schema_fingerprint": "f1"}
    rows = payload["data"]
    assert rows[0] == {"id": 0, "name": "plain", "score": 1.5, "doc": '{"a": [1, 2], "k": 0}',
                       "tags": ["a", "b c", None, 'q"x'], "blob": None, "ok": None}
    assert rows[1]["name"] == "" and rows[1]["blob"] == b"\x00\xff" and rows[1]["ok"] is True
    assert rows[2]["name"] == "tab\there" and rows[2]["score"] == float("-inf")
    assert rows[3]["name"] == "back\\slash" and rows[4]["name"] == "new\nline"
    assert rows[5]["name"] == "\\N"  # the two characters, not NULL
    assert rows[1]["score"] != rows[1]["score"]  # NaN
    assert chunk.subject == f"init.snap.sales/orders.snap-1.{2 * CHUNK_NUMBER_STRIDE}"
    assert chunk.headers == {"Nats-Msg-Id": f"snap-1:{2 * CHUNK_NUMBER_STRIDE}",
                             "Content-Type": "application/msgpack",
                             "Cdc-Schema-Fingerprint": "f1"}


def test_chunks_hold_at_most_chunk_rows_and_numbers_are_per_partition():
    chunker = Chunker(layout(chunk_rows=100), converters(), partition=3)
    chunks = run(chunker, [line(i) for i in range(1050)])
    assert [c.rows for c in chunks] == [100] * 10 + [50]
    assert [c.number for c in chunks] == [3 * CHUNK_NUMBER_STRIDE + n for n in range(11)]
    assert [r["id"] for r in rows_of(chunks)] == list(range(1050))
    assert chunker.stats.rows == 1050 and chunker.stats.chunks == 11


def test_cuts_do_not_depend_on_how_the_bytes_arrived():
    lines = [line(i) for i in range(3000)]
    first = run(Chunker(layout(max_payload=20_000, chunk_rows=10_000), converters(), 0), lines)
    again = run(Chunker(layout(max_payload=20_000, chunk_rows=10_000), converters(), 0), lines,
                batch_sizes=1)
    whole = Chunker(layout(max_payload=20_000, chunk_rows=10_000), converters(), 0)
    once = whole.add(block(lines)) + whole.finish()
    assert len(first) > 10
    assert [(c.number, c.payload, c.headers) for c in first] == \
        [(c.number, c.payload, c.headers) for c in again] == \
        [(c.number, c.payload, c.headers) for c in once]


@pytest.mark.parametrize("zstd", [False, True])
@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_every_message_fits_max_payload_with_its_headers(fmt, zstd):
    max_payload = 8_000
    chunker = Chunker(layout(max_payload=max_payload, chunk_rows=10_000, format=fmt,
                             zstd_level=3 if zstd else None), converters(), 0)
    # rows of very different sizes, some incompressible
    rng = random.Random(5)
    lines = []
    for i in range(2000):
        blob = rng.randbytes(rng.choice([0, 10, 200, 1500])).hex()
        lines.append(f"{i}\tx\t{i}\t{{}}\t{{}}\t\\\\x{blob}\tt".encode())
    chunks = run(chunker, lines)
    assert all(len(c.payload) + headers_size(c.headers) <= max_payload for c in chunks)
    assert [r["id"] for r in rows_of(chunks, fmt)] == list(range(2000))


def test_an_optimistic_estimate_is_split_until_it_fits():
    # "1" in COPY text is one byte; as a float8 it encodes to nine: the estimate is too low
    columns = [("id", INT8)] + [(f"f{i}", FLOAT8) for i in range(20)]
    chunker = Chunker(layout(columns=tuple(n for n, _ in columns), max_payload=30_000,
                             chunk_rows=10_000), converters(columns), 0)
    lines = [("\t".join([str(i)] + ["1"] * 20)).encode() for i in range(5000)]
    chunks = run(chunker, lines)
    assert chunker.stats.splits > 0
    assert all(len(c.payload) + headers_size(c.headers) <= 30_000 for c in chunks)
    assert [r["id"] for r in rows_of(chunks)] == list(range(5000))


def test_a_row_over_max_payload_becomes_an_oversized_chunk_of_its_own(caplog):
    """Published as a claim check (docs/wire-contract.md "Large values"); the log names its key."""
    caplog.set_level("INFO")
    chunker = Chunker(layout(max_payload=4_000), converters(), 0)
    big = f"7\t{'x' * 5000}\t1\t{{}}\t{{}}\t\\N\tt".encode()
    chunks = run(chunker, [line(1), line(2), big])
    assert [c.oversized for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].rows == 1 and rows_of(chunks[-1:])[0]["name"] == "x" * 5000
    assert [r["id"] for r in rows_of(chunks)] == [1, 2, 7]
    assert re.search(r"sales/orders: row id=7 encodes to \d+ bytes", caplog.text)


def test_without_primary_key_the_ctid_names_the_row_and_is_not_sent(caplog):
    caplog.set_level("INFO")
    columns = (("a", INT8), ("b", TEXT))
    lay = layout(columns=("a", "b"), key_columns=(), max_payload=4_000)
    chunker = Chunker(lay, converters(columns), 0)
    rows = rows_of(chunker.add(b"1\tx\t(0,1)\n1\tx\t(0,2)\n") + chunker.finish())
    assert rows == [{"a": 1, "b": "x"}, {"a": 1, "b": "x"}]
    chunker = Chunker(lay, converters(columns), 0)
    chunks = run(chunker, [b"1\tx\t(4,1)", b"2\t" + b"y" * 5000 + b"\t(4,2)"])
    assert chunks[-1].oversized and "row ctid=(4,2) (no primary key)" in caplog.text


def test_a_row_of_the_wrong_width_is_an_error_not_a_silent_truncation():
    chunker = Chunker(layout(), converters(), 0)
    with pytest.raises(ConversionError, match="has 6 fields, expected 7"):
        run(chunker, [line(1), b"1\ta\t1\t{}\t{}\tt"])


def test_zstd_with_a_dictionary_round_trips_and_says_so():
    typed = rows_of(run(Chunker(layout(chunk_rows=10_000), converters(), 0),
                        [line(i) for i in range(3000)]))
    trained = train(typed, "msgpack", level=3, dictionary_bytes=8192, chunk_rows=50)
    assert trained is not None and trained.dictionary_id
    assert trained.sample_ratio_with < trained.sample_ratio_without  # small chunks: it helps
    lay = layout(chunk_rows=50, zstd_level=3, dictionary=trained.data,
                 dictionary_id=trained.dictionary_id)
    chunker = Chunker(lay, converters(), 0)
    chunks = run(chunker, [line(i) for i in range(3000)])
    assert chunks[0].headers["Content-Encoding"] == "zstd"
    assert chunks[0].headers["Cdc-Zstd-Dict"] == str(trained.dictionary_id)
    assert zstandard.get_frame_parameters(chunks[0].payload).dict_id == trained.dictionary_id
    plain = run(Chunker(layout(chunk_rows=50), converters(), 0), [line(i) for i in range(3000)])
    # packed: NaN == NaN
    assert msgpack.packb(rows_of(chunks, dictionary=trained.data)) == msgpack.packb(
        rows_of(plain))
    assert chunker.stats.bytes_compressed < chunker.stats.bytes_raw
    assert dictionary_key("sales/orders", 42) == "sales/orders.42"


def test_too_few_samples_means_no_dictionary():
    assert train([{"a": 1}] * 10, "msgpack", level=3) is None


def test_chunk_numbers_are_bounded_per_partition():
    assert chunk_number(7, 999_999) == 7_999_999
    with pytest.raises(Exception, match="more than 1000000 chunks"):
        chunk_number(7, CHUNK_NUMBER_STRIDE)


# -- equivalences --------------------------------------------------------------------------------
def copy_text_field(value: str | None) -> str:
    """What COPY TO prints for a text value."""
    if value is None:
        return "\\N"
    return (value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
            .replace("\r", "\\r"))


field_values = st.one_of(st.none(), st.text(alphabet=st.sampled_from(
    ["a", "é", "😀", "\\", "\t", "\n", "\r", "N", "x", "0", " ", '"', "{", "}"]), max_size=8))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(field_values, field_values), min_size=1, max_size=30))
def test_columnar_decoding_is_copy_text_parse_line(rows):
    columns = (("a", TEXT), ("b", TEXT))
    chunker = Chunker(layout(columns=("a", "b"), key_columns=(0,)), converters(columns), 0)
    text = "".join(f"{copy_text_field(a)}\t{copy_text_field(b)}\n" for a, b in rows)
    expected = [dict(zip(("a", "b"), convert_row(converters(columns), fields)))
                for fields in iter_rows(text)]
    assert expected == [{"a": a, "b": b} for a, b in rows]  # the test's own escaping is right
    assert chunker.rows(text) == expected


def reference_cuts(sizes: list[int], chunk_rows: int, limit: float) -> list[int]:
    """The cutting rule row by row (fixed limit): rows per chunk."""
    cuts, rows, size = [], 0, 0
    for row_size in sizes:
        if rows and size + row_size > limit:
            cuts.append(rows)
            rows, size = 0, 0
        rows += 1
        size += row_size
        if rows >= chunk_rows:
            cuts.append(rows)
            rows, size = 0, 0
    return cuts + ([rows] if rows else [])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=300),
       st.integers(min_value=1, max_value=40), st.integers(min_value=1, max_value=60))
def test_vectorized_cuts_follow_the_row_by_row_rule(lengths, chunk_rows, block_rows):
    columns = (("id", INT8), ("body", TEXT))
    lay = layout(columns=("id", "body"), chunk_rows=chunk_rows, max_payload=1 << 30)
    chunker = Chunker(lay, converters(columns), 0)
    chunker._limit = limit = 5_000.0  # a fixed limit, as in the reference
    chunker._raw_limit = lambda: limit
    lines = [f"{i}\t{'x' * n}".encode() for i, n in enumerate(lengths)]
    chunks = run(chunker, lines, batch_sizes=block_rows)
    overhead = chunker._row_overhead
    assert [c.rows for c in chunks] == reference_cuts(
        [len(line) + overhead for line in lines], chunk_rows, limit)


def test_a_block_must_end_at_a_row_boundary():
    chunker = Chunker(layout(), converters(), 0)
    with pytest.raises(ConversionError, match="row boundary"):
        chunker.add(line(1) + b"\n" + line(2))
