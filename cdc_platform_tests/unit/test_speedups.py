"""The compiled twins (``cdc_platform/_speedups``) against the pure-Python code they stand for.

Each compiled function must give what the Python code gives -- the same values, the same
bytes, the same exception type -- on bytes captured from PostgreSQL, on every truncation of
them, and on generated inputs.
"""

from __future__ import annotations

import ast
import json
import math
import os
import struct
import subprocess
import sys
import threading
import time
from datetime import datetime
from decimal import Decimal
from pathlib import Path

import msgpack
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import cdc_platform
from cdc_platform.bridge.events import MessageBuilder
from cdc_platform.protocol import changes, pgoutput, values
from cdc_platform.protocol.changes import TransactionAssembler
from cdc_platform.protocol.pgoutput import UNCHANGED_TOAST, decode_message
from cdc_platform.speedups import TWINNED, compiled_twin

PGOUTPUT = compiled_twin("cdc_platform.protocol.pgoutput")
CHANGES = compiled_twin("cdc_platform.protocol.changes")
VALUES = compiled_twin("cdc_platform.protocol.values")
EVENTS = compiled_twin("cdc_platform.bridge.events")
CHUNKS = compiled_twin("cdc_platform.snapshot.chunks")
FRAMING = compiled_twin("cdc_platform.publishing.framing")
PUBLISHER = compiled_twin("cdc_platform.publishing.publisher")

DATA = Path(__file__).resolve().parents[1] / "data" / "pgoutput"
TUPLE_TAGS = {ord("I"), ord("U"), ord("D")}


def test_twinned_names_every_twin():
    """speedups.TWINNED (what the build checks and the stub test cover) lists every .pyx of
    _speedups but the shared reader, each at the path of a pure module that exists."""
    package = Path(cdc_platform.__file__).parent
    speedups = package / "_speedups"
    sources = {".".join(path.relative_to(speedups).with_suffix("").parts)
               for path in speedups.rglob("*.pyx")}
    assert set(TWINNED) == sources - {"msgpack_reader"}
    for name in TWINNED:
        assert (package / f"{name.replace('.', '/')}.py").exists(), name


# Types a twin's functions return, which the pure module names by a Protocol or not at all:
# the type row_builder makes, the Statements connect gives.
_TWIN_ONLY = {"protocol.changes": {"RowBuilder"}, "mirror.store": {"Statements"}}


def _stub_exports(module: str) -> dict[str, list[str] | None]:
    """What the ``.pyi`` of ``module``'s twin exports: each function's parameters (``name``,
    or ``name=`` with a default; a class or an alias of one: its ``__init__``'s), None for a
    constant."""
    stub = Path(cdc_platform.__file__).parent / "_speedups" / f"{module.replace('.', '/')}.pyi"
    tree = ast.parse(stub.read_text())

    def parameters(function: ast.FunctionDef) -> list[str]:
        arguments = [a.arg for a in function.args.args if a.arg != "self"]
        with_default = len(arguments) - len(function.args.defaults)
        return [name + ("=" if index >= with_default else "")
                for index, name in enumerate(arguments)] + (
            [f"**{function.args.kwarg.arg}"] if function.args.kwarg else [])

    classes = {node.name: next((parameters(item) for item in node.body
                                if isinstance(item, ast.FunctionDef)
                                and item.name == "__init__"), [])
               for node in tree.body if isinstance(node, ast.ClassDef)}
    exports: dict[str, list[str] | None] = dict(classes)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            exports[node.name] = parameters(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            exports[node.target.id] = None
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            (target,) = node.targets
            exports[target.id] = classes[node.value.id]  # an alias of a class
    return exports


_PURE_EXPORTS = """
import importlib, inspect, json, sys
wanted, found = json.loads(sys.argv[1]), {}
for module, names in wanted.items():
    pure = importlib.import_module(f"cdc_platform.{module}")
    for name in names:
        value = getattr(pure, name, inspect.Parameter.empty)
        if value is inspect.Parameter.empty:
            found[f"{module}.{name}"] = "missing"
        elif value is None or not callable(value):
            found[f"{module}.{name}"] = repr(value)
        else:
            found[f"{module}.{name}"] = [
                ("**" if p.kind is p.VAR_KEYWORD else "") + p.name
                + ("=" if p.default is not p.empty else "")
                for p in inspect.signature(value).parameters.values()]
print(json.dumps(found))
"""


def test_each_twin_exports_the_pure_names_and_signatures():
    """The rule that keeps the twins from drifting (cdc_platform/speedups.py): every name a
    twin's stub exports is a name of its pure module, a function with the same parameters
    (mypy checks their types where the pure module binds the twin), a constant with the same
    value. The pure side is read with the twins off."""
    exports = {module: _stub_exports(module) for module in TWINNED}
    wanted = {module: sorted(set(names) - _TWIN_ONLY.get(module, set()))
              for module, names in exports.items()}
    pure = json.loads(subprocess.run(
        [sys.executable, "-c", _PURE_EXPORTS, json.dumps(wanted)], capture_output=True,
        text=True, check=True, env={**os.environ, "CDC_PLATFORM_PURE_PYTHON": "1"}).stdout)
    for module, names in wanted.items():
        twin = compiled_twin(f"cdc_platform.{module}")
        for name in names:
            found, parameters = pure[f"{module}.{name}"], exports[module][name]
            assert found != "missing", f"{module}'s twin exports {name}, the pure module not"
            if parameters is not None:
                assert found == parameters or found == "None", \
                    f"{module}.{name}: twin ({', '.join(parameters)}), pure {found}"
            elif twin is not None:
                assert found == repr(getattr(twin, name)), f"{module}.{name}: {found}"


@pytest.mark.parametrize("module", TWINNED)
def test_every_twin_is_built(module):
    """CI and the benchmarks measure the compiled path: a build that silently lost a twin
    (no C compiler) must be noticed. Set CDC_PLATFORM_PURE_PYTHON=1 to test the pure code."""
    if os.environ.get("CDC_PLATFORM_PURE_PYTHON"):
        pytest.skip("pure Python asked for")
    assert compiled_twin(f"cdc_platform.{module}") is not None, \
        f"the compiled twin of cdc_platform.{module} is not built: pip install -e ."


compiled = pytest.mark.skipif(None in (PGOUTPUT, CHANGES, VALUES, EVENTS, CHUNKS, FRAMING,
                                     PUBLISHER), reason="the compiled twins are not built")


@compiled
def test_the_stubs_say_what_the_twins_export(tmp_path):
    """Each twin's ``.pyi`` against the built module (mypy's stubtest: names, arguments)."""
    allowlist = tmp_path / "allowlist"
    allowlist.write_text("".join(  # what Cython adds to every module or class
        f"cdc_platform._speedups.*.{name}\n"
        for name in ("__test__", "__pyx_capi__", "__reduce_cython__", "__setstate_cython__")))
    modules = [compiled_twin(f"cdc_platform.{name}").__name__ for name in TWINNED]
    # the project's mypy settings (a stub imports pure modules, which import untyped msgpack)
    config = Path(__file__).resolve().parents[2] / "pyproject.toml"
    checked = subprocess.run([sys.executable, "-m", "mypy.stubtest", "--mypy-config-file",
                              str(config), "--allowlist", str(allowlist), *modules],
                             capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _outcome(function, *args):
    """(result, None) or (None, exception type): what a call did."""
    try:
        return function(*args), None
    except Exception as exc:  # noqa: BLE001 - comparing behaviour
        return None, type(exc)


def _captured_payloads() -> list[bytes]:
    payloads = []
    for path in sorted(DATA.glob("*/*.jsonl")):
        for line in path.read_text().splitlines()[1:]:
            payloads.append(bytes.fromhex(json.loads(line)["data"]))
    return payloads


# -- TupleData --------------------------------------------------------------------------------
def _tuple_positions(payload: bytes) -> list[int]:
    """Where the TupleData parts of an Insert/Update/Delete message start."""
    if payload[0] not in TUPLE_TAGS:
        return []
    positions, pos = [], 5
    while pos < len(payload):
        marker = payload[pos]
        if marker not in b"NKO":
            break
        positions.append(pos + 1)
        _, pos = pgoutput.read_tuple_python(payload, pos + 1)
    return positions


@compiled
def test_read_tuple_equals_python_on_captured_messages():
    checked = 0
    for payload in _captured_payloads():
        for pos in _tuple_positions(payload):
            assert PGOUTPUT.read_tuple(payload, pos, UNCHANGED_TOAST) == \
                pgoutput.read_tuple_python(payload, pos)
            checked += 1
    assert checked > 100


@compiled
def test_read_tuple_on_every_truncation_is_none_or_equal():
    for payload in _captured_payloads():
        for pos in _tuple_positions(payload)[:1]:
            for end in range(pos, min(len(payload), pos + 300)):
                cut = payload[:end]
                result = PGOUTPUT.read_tuple(cut, pos, UNCHANGED_TOAST)
                if result is not None:  # a shorter tuple may still be complete
                    assert result == pgoutput.read_tuple_python(cut, pos)
                    assert result[1] <= end


@compiled
def test_decode_message_errors_are_the_python_errors():
    """A malformed message raises the same ProtocolError text with and without the
    compiled twin: the compiled reader hands malformed tuples to the Python code."""
    data = struct.pack(">cIcHcI", b"I", 1, b"N", 2, b"t", 3) + b"abc" + b"x"
    with pytest.raises(pgoutput.ProtocolError, match="unknown TupleData column kind 'x'"):
        decode_message(data)


column_parts = st.one_of(
    st.just(b"n"), st.just(b"u"),
    st.text(max_size=40).map(lambda t: b"t" + struct.pack(">I", len(t.encode())) + t.encode()),
    st.binary(max_size=40).map(lambda b: b"b" + struct.pack(">I", len(b)) + b),
)


@compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(column_parts, max_size=30), st.binary(max_size=4))
def test_read_tuple_equals_python_on_generated_tuples(parts, tail):
    data = b"xx" + struct.pack(">H", len(parts)) + b"".join(parts) + tail
    assert PGOUTPUT.read_tuple(data, 2, UNCHANGED_TOAST) == pgoutput.read_tuple_python(data, 2)


@compiled
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_read_tuple_on_garbage_never_disagrees(data):
    result = _outcome(PGOUTPUT.read_tuple, data, 0, UNCHANGED_TOAST)
    if result[0] is None and result[1] is None:
        return  # None: the Python path decides (and raises)
    expected = _outcome(pgoutput.read_tuple_python, data, 0)
    if result[1] is not None:
        assert result[1] is UnicodeDecodeError and expected[1] is UnicodeDecodeError
    else:
        assert result == expected


# -- rows -----------------------------------------------------------------------------------
CONVERTERS = [str, values.identity, int, float, values.timestamptz_python, values._bool,
              json.loads, lambda text: text.upper()]
cells = st.one_of(st.none(), st.just(UNCHANGED_TOAST), st.binary(max_size=5),
                  st.sampled_from(["12", "-3", "1.5", "nan", "t", "f", "x", "",
                                   "2025-01-02 03:04:05+00", "[1, 2]", " 7 ", "1_000"]))


@compiled
@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(CONVERTERS), cells), min_size=0, max_size=8),
       st.data())
def test_row_builder_equals_the_python_builder(columns, data):
    names = tuple(f"c{i}" for i in range(len(columns)))
    converters = tuple(c for c, _ in columns)
    row = tuple(v for _, v in columns)
    indexes = tuple(sorted(data.draw(st.sets(st.integers(0, max(len(columns) - 1, 0)))
                                     if columns else st.just(set()))))
    python = changes.row_builder_python(names, converters, indexes, values.TEXT_CONVERTERS,
                                        changes._SlowPath)
    compiled = changes._row_builder(names, converters, indexes)
    assert type(compiled) is CHANGES.RowBuilder
    got, want = _outcome(compiled, row), _outcome(python, row)
    assert got[1] == want[1]
    if got[1] is None:
        assert msgpack.packb(got[0]) == msgpack.packb(want[0])  # (NaN != NaN)
        for key in got[0]:
            assert type(got[0][key]) is type(want[0][key])


# -- temporal converters --------------------------------------------------------------------
years = st.integers(1, 294276).map(lambda y: f"{y:04d}")
clock = st.builds(lambda h, m, s, frac: f"{h:02d}:{m:02d}:{s:02d}{frac}",
                  st.integers(0, 23), st.integers(0, 59), st.integers(0, 59),
                  st.sampled_from(["", ".5", ".123456", ".000001"]))
offsets = st.sampled_from(["+00", "+02", "-03", "+05:30", "-09:30", "+01:02:03", "+14"])
dates = st.builds(lambda y, m, d: f"{y}-{m:02d}-{d:02d}", years, st.integers(1, 12),
                  st.integers(1, 28))
era = st.sampled_from(["", " BC"])
pg_timestamptz = st.one_of(
    st.builds(lambda d, c, o, e: f"{d} {c}{o}{e}", dates, clock, offsets, era),
    st.sampled_from(["infinity", "-infinity"]))
# Text made of the characters the fast paths look at, so that near-misses of the real
# formats (a space before the date's end, a stray sign) turn up often.
near_temporal = st.text(alphabet="0123 -:+.TBCZy", min_size=10, max_size=30)


@compiled
@settings(max_examples=500, deadline=None)
@given(st.one_of(pg_timestamptz, near_temporal, st.text(max_size=30)))
@example("000000000  0+00")
def test_timestamptz(text):
    assert _outcome(VALUES.timestamptz, text) == _outcome(values.timestamptz_python, text)


@compiled
def test_timestamptz_examples():
    assert VALUES.timestamptz("2025-12-08 13:45:21.719719+00") == "2025-12-08T13:45:21.719719Z"
    assert VALUES.timestamptz("0044-03-15 10:00:00+00 BC") == "-0043-03-15T10:00:00Z"
    assert VALUES.timestamptz("2025-12-08 13:45:21+05:30") == "2025-12-08T13:45:21+05:30"


# -- msgpack --------------------------------------------------------------------------------
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=70), st.binary(max_size=300),
    st.sampled_from(["x" * 31, "x" * 32, "x" * 255, "x" * 256, b"y" * 255, b"y" * 256]),
)
packable = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=20), st.lists(inner, max_size=20).map(tuple),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner,
                        max_size=20)),
    max_leaves=60)


def _packb(value):
    """The compiled writer on ``{"v": value}``: ``pack_map`` with no prefix and one item."""
    return EVENTS.pack_map(b"", 0, ("v", value))


def _msgpack_packb(value):
    return msgpack.packb({"v": value})


def _same_bytes_or_error(got, want):
    if want[1] is None:
        assert got[1] is None
        assert got[0] == want[0]
    else:
        assert got[1] is want[1]


@compiled
@settings(max_examples=400, deadline=None)
@given(packable)
def test_packb_equals_msgpack(value):
    _same_bytes_or_error(_outcome(_packb, value), _outcome(_msgpack_packb, value))


@compiled
@pytest.mark.parametrize("value", [
    0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63),
    2**64, -(2**63) - 1, math.nan, -0.0, math.inf, bytearray(b"ab"), [1] * 16, [1] * 65536,
    {str(i): i for i in range(16)}, {str(i): i for i in range(70000)},
    datetime(2025, 1, 1), Decimal("1.5"), {1, 2}, True, "é" * 31, "é" * 40,
    "z" * 65535, "z" * 65536, b"y" * 65535, b"y" * 65536,
])
def test_packb_boundaries(value):
    _same_bytes_or_error(_outcome(_packb, value), _outcome(_msgpack_packb, value))


def _nested(depth):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


@compiled
@pytest.mark.parametrize("depth", [1022, 1023, 1024, 1500])
def test_nesting_is_refused_where_msgpack_refuses_it(depth):
    _same_bytes_or_error(_outcome(_packb, _nested(depth)),
                         _outcome(_msgpack_packb, _nested(depth)))


small_packable = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(),
              st.text(max_size=40), st.binary(max_size=40)),
    lambda inner: st.one_of(st.lists(inner, max_size=5),
                            st.dictionaries(st.text(max_size=5), inner, max_size=5)),
    max_leaves=10)


@compiled
@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=5), small_packable, max_size=20),
       st.dictionaries(st.text(max_size=5), small_packable, max_size=20))
def test_pack_map_equals_packing_the_dict(shared, own):
    own = {k: v for k, v in own.items() if k not in shared}
    try:
        prefix = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in shared.items())
    except OverflowError:
        assume(False)  # the shared part is packed by msgpack itself
    items = tuple(x for pair in own.items() for x in pair)
    _same_bytes_or_error(_outcome(EVENTS.pack_map, prefix, len(shared), items),
                         _outcome(msgpack.packb, {**shared, **own}))


# -- runs of row changes ----------------------------------------------------------------------------
def _xlogdata(lsn: int, payload: bytes) -> bytes:
    """The CopyData message a walsender sends for one pgoutput message."""
    return struct.pack(">cQQq", b"w", lsn, lsn + len(payload), 0) + payload


def _fixture_stream(path: Path) -> list[bytes]:
    framed = []
    for line in path.read_text().splitlines()[1:]:
        row = json.loads(line)
        high, low = row["lsn"].split("/")
        framed.append(_xlogdata(int(high, 16) << 32 | int(low, 16), bytes.fromhex(row["data"])))
    return framed


def _fed(raw: list) -> tuple[list, list]:
    """(events, errors) of ``feed(decode_message(...))`` per message: the general path."""
    assembler = TransactionAssembler(values.TypeRegistry())
    events, errors = [], []
    for message in raw:
        try:
            events.extend(assembler.feed(struct.unpack_from(">Q", message, 1)[0],
                                         decode_message(bytes(message), 25)))
        except Exception as exc:  # noqa: BLE001 - comparing behaviour
            errors.append(type(exc))
    return events, errors


def _taken(raw: list) -> tuple[list, list, int]:
    """The reader's loop: runs through take_changes, the rest through feed. Also returns
    how many messages take_changes took."""
    assembler = TransactionAssembler(values.TypeRegistry())
    events, errors, index, taken_total = [], [], 0, 0
    while index < len(raw):
        taken, wal_end = assembler.take_changes(raw, index, events)
        if taken > index:
            assert wal_end == max(struct.unpack_from(">Q", m, 9)[0] for m in raw[index:taken])
            taken_total += taken - index
            index = taken
            continue
        message = raw[index]
        index += 1
        try:
            events.extend(assembler.feed(struct.unpack_from(">Q", message, 1)[0],
                                         decode_message(bytes(message), 25)))
        except Exception as exc:  # noqa: BLE001
            errors.append(type(exc))
    return events, errors, taken_total


@compiled
@pytest.mark.parametrize("as_view", [False, True], ids=["bytes", "memoryview"])
def test_take_changes_equals_feed_on_captured_streams(as_view):
    """psycopg hands CopyData over as memoryviews; both kinds give the general path's
    events exactly, and the Inserts are really taken by the compiled loop."""
    taken_total = 0
    for path in sorted(DATA.glob("*/*.jsonl")):
        if "streamed" in path.name:
            continue
        raw = _fixture_stream(path)
        if as_view:
            raw = [memoryview(message) for message in raw]
        want_events, want_errors = _fed(raw)
        got_events, got_errors, taken = _taken(raw)
        # repr: NaN values are equal only as text
        assert (repr(got_events), got_errors) == (repr(want_events), want_errors), path.name
        taken_total += taken
    assert taken_total >= 100  # copy_multi_insert alone has 100 Inserts
    taken_kinds = {bytes(m[25:26]) for path in sorted(DATA.glob("*/*.jsonl"))
                   for m in _fixture_stream(path)} & {b"I", b"U", b"D"}
    assert taken_kinds == {b"I", b"U", b"D"}  # the fixtures hold all three


def _tuple_data(columns: list) -> bytes:
    """TupleData: columns are str ('t'), None ('n'), b'u' (unchanged) or raw bytes to put
    after a 't' kind byte (to forge invalid UTF-8)."""
    body = b""
    for value in columns:
        if value is None:
            body += b"n"
        elif value == b"u":
            body += b"u"
        else:
            data = value.encode() if isinstance(value, str) else value
            body += b"t" + struct.pack(">I", len(data)) + data
    return struct.pack(">H", len(columns)) + body


def _insert(relation_id: int, columns: list) -> bytes:
    return b"I" + struct.pack(">I", relation_id) + b"N" + _tuple_data(columns)


def _update(relation_id: int, columns: list, old_kind: bytes = b"", old: list = ()) -> bytes:
    head = old_kind + _tuple_data(list(old)) if old_kind else b""
    return b"U" + struct.pack(">I", relation_id) + head + b"N" + _tuple_data(columns)


def _delete(relation_id: int, old_kind: bytes, old: list) -> bytes:
    return b"D" + struct.pack(">I", relation_id) + old_kind + _tuple_data(old)


@compiled
@pytest.mark.parametrize("bad", [
    ["x", "ok"],               # int8 that is not a number: kept as text, named raw
    [b"\xff\xfe", "ok"],        # invalid UTF-8 in the id column
    ["1", b"u"],               # unchanged TOAST in an Insert (PostgreSQL sends none)
    ["1"],                     # fewer columns than the Relation message
], ids=["conversion", "utf8", "unchanged", "width"])
def test_take_changes_leaves_what_it_cannot_take_to_the_general_path(bad):
    """A run stops before an Insert it cannot assemble; the general path then gives the
    same events and the same error as without the compiled loop."""
    stream = _fixture_stream(DATA / "pg15" / "insert_types.jsonl")
    begin_at = next(i for i, m in enumerate(stream) if m[25:26] == b"I")
    relation_id = struct.unpack_from(">I", stream[begin_at], 26)[0]
    good = _xlogdata(0x1000, _insert(relation_id, ["7", "fine", None, None, None, None, None,
                                                   None, None]))
    forged = bad + [None] * 7 if len(bad) == 2 else bad
    raw = stream[:begin_at] + [good, _xlogdata(0x1100, _insert(relation_id, forged)), good]
    want_events, want_errors = _fed(raw)
    got_events, got_errors, _ = _taken(raw)
    assert (repr(got_events), got_errors) == (repr(want_events), want_errors)
    if bad == ["x", "ok"]:  # no single value stops the stream: the text, named
        forged_record = [e for e in got_events if isinstance(e, changes.ChangeRecord)][1]
        assert forged_record.raw_columns == ("id",) and forged_record.new["id"] == "x"
    elif bad != ["1", b"u"]:
        assert got_errors, "the forged Insert must fail in the general path"


# -- whole events ---------------------------------------------------------------------------
@compiled
@pytest.mark.parametrize("mode", ["per-change", "batched"])
def test_event_payloads_are_the_same_bytes(mode):
    """Every captured transaction through the builder with and without the compiled
    writer: identical payloads, ids and subjects."""
    checked = 0
    for path in sorted(DATA.glob("*/*.jsonl")):
        if "streamed" in path.name:
            continue
        assembler = TransactionAssembler(values.TypeRegistry())
        compiled = MessageBuilder("msgpack", mode)
        python = MessageBuilder("msgpack", mode, compiled=False)
        for line in path.read_text().splitlines()[1:]:
            row = json.loads(line)
            events = assembler.feed(int(row["lsn"].split("/")[0], 16) << 32 | int(
                row["lsn"].split("/")[1], 16), decode_message(bytes.fromhex(row["data"])))
            got, want = compiled.build(events), python.build(events)
            assert got.messages == want.messages
            checked += len(got.messages)
    assert checked > 20


@compiled
@settings(max_examples=500, deadline=None)
@given(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**32 - 1, 2**32, 2**64 - 1])))
def test_lsn_text_equals_format_lsn(lsn):
    from cdc_platform.lsn import format_lsn

    assert EVENTS.lsn_text(lsn) == format_lsn(lsn)


# -- snapshot rows ----------------------------------------------------------------------------
SNAPSHOT_COLUMNS = [("id", 20), ("qty", 23), ("name", 25), ("score", 701), ("ok", 16),
                    ("at", 1184), ("price", 1700), ("doc", 3802), ("tags", 1009),
                    ("blob", 17), ("day", 1082)]
copy_fields = {
    20: st.one_of(st.integers(-(2**63), 2**63 - 1).map(str), st.sampled_from(["007", "-0"])),
    23: st.integers(-(2**31), 2**31 - 1).map(str),
    25: st.one_of(st.text(max_size=20).map(
        lambda t: t.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")),
        st.sampled_from(["\\\\N", "\\101\\x41", "", "é\\tü"])),
    701: st.one_of(st.floats().map(repr).map(
        lambda r: {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}.get(r, r)),
        st.sampled_from(["1e999", "-0", "1.5", "1e-400", "-1.5E+10", "1.", ".5", "1e", "+1",
                         "infinity", "nan", "-NaN", "0x1p3", "1.5e+"])),
    16: st.sampled_from(["t", "f"]),
    1184: st.one_of(pg_timestamptz, st.just("2025-01-02 03:04:05.123456+00")),
    1700: st.sampled_from(["12.50", "NaN", "-0.001", "Infinity"]),
    3802: st.sampled_from(['{"a": [1, 2]}', "[]", '"x"', "null", '{"k": "t\\\\tab"}']),
    1009: st.sampled_from(["{}", '{a,"b c",NULL}', '{"q\\\\"x"}']),
    17: st.sampled_from(["\\\\x", "\\\\x00ff", "\\\\xdeadbeef"]),
    1082: st.sampled_from(["2025-01-02", "0044-03-15 BC", "infinity"]),
}


def _chunkers(columns, **overrides):
    from cdc_platform.snapshot.chunks import Chunker, ChunkLayout

    registry = values.TypeRegistry()
    converters = registry.for_columns([type("C", (), {"type_oid": oid}) for _, oid in columns])
    settings_ = {"table": "t", "snapshot_id": "s1", "lsn": "0/1", "schema_fingerprint": "f",
                     "columns": tuple(name for name, _ in columns), "key_columns": (0,),
                     "chunk_rows": 7}
    settings_.update(overrides)
    layout = ChunkLayout(**settings_)
    compiled, python = Chunker(layout, converters, 3), Chunker(layout, converters, 3)
    python._compiled_kinds = python._digest_kinds = None  # the pure-Python path
    return compiled, python


def _digested(chunker, text: bytes, key, raw, whole_block=False):
    """(the digest of the block's rows, or the exception type; what ``raw`` got), by
    ``Chunker.digest`` of the parsed fields or by ``Chunker.digest_block``."""
    from cdc_platform.wire.digest import RowDigester, TableDigest

    digest = TableDigest(3)
    digester = RowDigester([name for name, _ in SNAPSHOT_COLUMNS], key)
    if whole_block:
        outcome = _outcome(chunker.digest_block, digest, digester, text, raw)
    else:
        lines, fields, escapes = chunker.parse(text)
        outcome = _outcome(chunker.digest, digest, digester, fields, len(lines), escapes, raw)
    return (outcome[1] or (outcome[0], digest.totals, digest.counts)), raw


@compiled
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(*(st.one_of(copy_fields[oid], st.just("\\N"),
                                      st.sampled_from(["12a", "-0", "007", "1_0", " 1"]))
                            for _, oid in SNAPSHOT_COLUMNS)), min_size=1, max_size=25),
       st.sampled_from([[], ["id"], ["name", "qty"]]))
def test_snapshot_fields_digest_as_their_converted_columns(rows, key):
    """``Chunker.digest`` hashing COPY fields in C gives the digest of the converted columns
    (or the converter's error, having added nothing); with ``raw``, what the converters
    refuse is hashed as text, as the pure path does."""
    text = "".join("\t".join(row) + "\n" for row in rows).encode()
    compiled, python = _chunkers(SNAPSHOT_COLUMNS)
    assert compiled._digest_kinds is not None
    expected = _digested(python, text, key, None)
    lenient = _digested(python, text, key, {})
    for whole_block in (False, True):
        found = _digested(compiled, text, key, None, whole_block)
        assert found == expected or (isinstance(found[0], type)
                                     and isinstance(expected[0], type))
        assert _digested(compiled, text, key, {}, whole_block) == lenient
    assert _digested(python, text, key, {}, whole_block=True) == lenient


@compiled
def test_a_malformed_block_digests_with_the_pure_errors():
    """What the compiled block digest does not take (a line of another width, no final
    newline) it hands back: the pure parse's error, nothing added."""
    from cdc_platform.errors import ConversionError
    from cdc_platform.wire.digest import RowDigester, TableDigest

    names = [name for name, _ in SNAPSHOT_COLUMNS]
    good = "\t".join(["1"] * len(names)) + "\n"
    for text, error in ((good + "1\t2\n", "COPY row has 2 fields, expected 11"),
                        (good[:-1], "does not end at a row boundary"),
                        (good + "\t".join(["1"] * 12) + "\n", "COPY row has 12 fields")):
        for chunker in _chunkers(SNAPSHOT_COLUMNS):
            digest = TableDigest(0)
            with pytest.raises(ConversionError, match=error):
                chunker.digest_block(digest, RowDigester(names), text.encode())
            assert digest.counts == [0]
    compiled_chunker, _ = _chunkers(SNAPSHOT_COLUMNS)
    assert compiled_chunker.digest_block(TableDigest(0), RowDigester(names), b"") == 0


@compiled
def test_a_block_is_hashed_with_the_gil_released():
    """The range tasks of one process hash at once: the compiled block digest releases the GIL
    while it hashes rows whose fields C writes alone. A thread waiting for the GIL runs during
    the call, where the switch interval (100 s here) would otherwise keep it waiting. (Up to
    five tries: on a loaded machine the OS may not give it a core within one call; with the
    GIL held it could run in none.)"""
    from cdc_platform.wire.digest import RowDigester, TableDigest

    names = [name for name, _ in SNAPSHOT_COLUMNS]
    row = ("12\t7\tsome name\t1.5\tt\t2025-01-02 03:04:05.5+00\t12.50\t{}\t\\N\t\\N"
           "\t2025-01-02\n")
    text = (row * 20_000).encode()
    chunker, _ = _chunkers(SNAPSHOT_COLUMNS)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100)
    try:
        for _ in range(5):
            if _another_thread_ran_during(lambda: chunker.digest_block(
                    TableDigest(4), RowDigester(names, ["id"]), text) == 20_000):
                break
        else:
            raise AssertionError("the other thread did not run while the block was hashed")
    finally:
        sys.setswitchinterval(interval)


def _another_thread_ran_during(call) -> bool:
    """Whether a thread that waits for the GIL when ``call`` starts ran before it returned
    (``call`` must return True; the switch interval set long by the caller)."""
    waiting, ran = threading.Lock(), []
    waiting.acquire()

    def other() -> None:
        with waiting:
            ran.append(True)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        time.sleep(0.05)  # (it blocks on the lock)
        waiting.release()
        until = time.monotonic() + 0.1
        while time.monotonic() < until:  # the GIL held: it wakes and waits for the GIL
            pass
        assert call()
        return bool(ran)  # (read before this thread lets go of the GIL again)
    finally:
        thread.join()


def _chunk_everything(chunker, text: bytes):
    return [(c.number, c.headers, c.payload, c.rows) for c in chunker.add(text)] + \
        [(c.number, c.headers, c.payload, c.rows) for c in chunker.finish()]


@compiled
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(*(st.one_of(copy_fields[oid], st.just("\\N"))
                            for _, oid in SNAPSHOT_COLUMNS)), min_size=1, max_size=25))
def test_snapshot_chunks_are_the_same_bytes(rows):
    text = "".join("\t".join(row) + "\n" for row in rows).encode()
    compiled, python = _chunkers(SNAPSHOT_COLUMNS)
    assert compiled._compiled_kinds is not None
    assert _chunk_everything(compiled, text) == _chunk_everything(python, text)


@compiled
@pytest.mark.parametrize("overrides", [{"zstd_level": 3}, {"max_payload": 600},
                                       {"key_columns": ()}])
def test_snapshot_chunks_same_bytes_with_zstd_splits_and_ctid(overrides):
    columns = SNAPSHOT_COLUMNS[:6]
    with_ctid = not overrides.get("key_columns", (0,))
    rows = ["\t".join([str(i), str(i % 7), f"name {i} " + "x" * (i % 40), f"{i / 3!r}",
                       "tf"[i % 2], "2025-01-02 03:04:05+00"]
                      + ([f"({i},1)"] if with_ctid else [])) for i in range(60)]
    text = "".join(row + "\n" for row in rows).encode()
    compiled, python = _chunkers(columns, **overrides)
    got, want = _chunk_everything(compiled, text), _chunk_everything(python, text)
    assert got == want and len(got) > 1


@compiled
def test_snapshot_row_too_large_is_the_same_oversized_chunk_in_both():
    columns = SNAPSHOT_COLUMNS[:3]
    text = b"1\t2\t" + b"y" * 2000 + b"\n"
    compiled, python = _chunkers(columns, max_payload=700)
    got, want = _chunk_everything(compiled, text), _chunk_everything(python, text)
    assert got == want and len(got) == 1
    assert compiled.stats.chunks == python.stats.chunks == 1


@compiled
def test_snapshot_values_no_converter_accepts_stay_text_in_both():
    """No single value stops a snapshot: the text, and the chunk's raw_cells name it."""
    columns = SNAPSHOT_COLUMNS[:3]
    text = b"1\t2\tx\n2\tnot-a-number\ty\n3\t4\\\\5\tz\n"
    compiled, python = _chunkers(columns)
    got, want = _chunk_everything(compiled, text), _chunk_everything(python, text)
    assert got == want
    (chunk,) = [msgpack.unpackb(payload) for _, _, payload, _ in got]
    assert [row["qty"] for row in chunk["data"]] == [2, "not-a-number", "4\\5"]
    assert chunk["raw_cells"] == [[1, "qty"], [2, "qty"]]


# -- NATS framing -----------------------------------------------------------------------------
def _publisher(max_payload: int = 1 << 20):
    from cdc_platform.publishing.publisher import JetStreamPublisher

    class _Connection:  # what the framing reads of a nats-py client
        def __init__(self) -> None:
            self.max_payload = max_payload

        def jetstream(self, **_options):
            return None

    publisher = JetStreamPublisher(_Connection(), stream="CDC")
    publisher._stream_subjects = ["cdc.>"]  # as start() reads them
    return publisher


def _framed_in_python(publisher, messages):
    """``_frame_all`` with the compiled loop switched off."""
    from cdc_platform.publishing import publisher as publisher_module

    saved, publisher_module.frame_messages = publisher_module.frame_messages, lambda *_: None
    try:
        return publisher._frame_all(messages)
    finally:
        publisher_module.frame_messages = saved


msg_ids = st.one_of(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126),
                            min_size=1, max_size=40),
                    st.sampled_from(["", "a\tb", "é", "x\r\ny", "0/1A2B:7"]))
outgoing = st.builds(
    lambda table, msg_id, payload, fingerprint: __import__(
        "cdc_platform.publishing.messages", fromlist=["OutgoingMessage"]).OutgoingMessage(
            f"cdc.{table}.insert", msg_id, payload,
            (("Cdc-Schema-Fingerprint", fingerprint),) if fingerprint else ()),
    st.sampled_from(["users", "orders"]), msg_ids, st.binary(max_size=300),
    st.sampled_from(["", "903cccd54ae54af6", "786f82a5fcf0a92f"]))


@compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(outgoing, max_size=20), st.integers(200, 400))
def test_frame_messages_equals_the_python_loop(messages, max_payload):
    """Same held frames, or None exactly when the Python loop has something to admit or
    to refuse (and then the Python loop runs, so the outcome is the same)."""
    publisher = _publisher(max_payload)
    try:
        want = _framed_in_python(publisher, messages)  # admits subjects and header sets
    except Exception as exc:  # noqa: BLE001 - compared below
        want = exc
    got = PUBLISHER.frame_messages(messages, publisher._subjects,
                                publisher._extra_headers, max_payload)
    if isinstance(want, Exception):
        assert got is None
        assert str(_framed_or_error(publisher, messages)) == str(want)
    else:
        assert got == want
    fresh = _publisher(max_payload)  # nothing admitted yet: the compiled loop defers
    assert messages == [] or PUBLISHER.frame_messages(
        messages, fresh._subjects, fresh._extra_headers, max_payload) is None


def _framed_or_error(publisher, messages):
    try:
        return publisher._frame_all(messages)
    except Exception as exc:  # noqa: BLE001
        return exc


@compiled
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"cdc.users.insert", b"cdc.a.b"]),
                          st.one_of(st.none(), st.binary(max_size=60)),
                          st.binary(max_size=200)), max_size=12),
       st.binary(min_size=1, max_size=40), st.integers(0, 2**63),
       st.sampled_from([b"", b".1.$FI"]))
def test_frame_sequence_equals_protocol_bytes(frames, prefix, first_seq, suffix):
    from cdc_platform.publishing.framing import frame_sequence, protocol_bytes

    held = [(subject, header, payload, None, 0) for subject, header, payload in frames]
    assert FRAMING.sequence_bytes(held, prefix, first_seq, suffix) == protocol_bytes(
        frame_sequence(held, prefix, first_seq, suffix))


def test_protocol_bytes_are_nats_protocol():
    from cdc_platform.publishing.framing import frame_sequence, protocol_bytes

    held = [(b"cdc.users.insert", b"NATS/1.0\r\nNats-Msg-Id: 0/10:0\r\n\r\n", b"abc", None, 0),
            (b"cdc.x.y", None, b"", None, 0)]
    assert protocol_bytes(frame_sequence(held, b"_INBOX.q.", 9, b".1.$FI")) == (
        b"HPUB cdc.users.insert _INBOX.q.9.1.$FI 33 36\r\n"
        b"NATS/1.0\r\nNats-Msg-Id: 0/10:0\r\n\r\nabc\r\n"
        b"PUB cdc.x.y _INBOX.q.10.1.$FI 0\r\n\r\n")


_ROW = ["7", "fine", None, None, None, None, None, None, None]  # the items table, 9 columns


@compiled
@pytest.mark.parametrize("message", [
    lambda rid: _update(rid, _ROW),                                        # no old tuple
    lambda rid: _update(rid, _ROW, b"K", ["7"] + [None] * 8),
    lambda rid: _update(rid, _ROW, b"O", _ROW),
    lambda rid: _update(rid, ["7", b"u"] + [None] * 7),                    # unchanged TOAST
    lambda rid: _update(rid, _ROW, b"K", ["x"] + [None] * 8),              # bad key value
    lambda rid: _update(rid, ["7"], b"O", _ROW),                           # width
    lambda rid: _update(rid, _ROW, b"X", _ROW),                            # bad marker
    lambda rid: _update(rid, _ROW)[:-3],                                   # truncated
    lambda rid: _delete(rid, b"K", ["7"] + [None] * 8),
    lambda rid: _delete(rid, b"O", _ROW),
    lambda rid: _delete(rid, b"O", ["7", b"\xff"] + [None] * 7),           # bad UTF-8
    lambda rid: _delete(rid, b"N", _ROW),                                  # bad marker
    lambda rid: _delete(rid + 1, b"K", _ROW),                              # unknown relation
], ids=["update", "update-K", "update-O", "update-toast", "update-bad-key", "update-width",
        "update-marker", "update-truncated", "delete-K", "delete-O", "delete-utf8",
        "delete-marker", "delete-unknown-relation"])
def test_take_changes_updates_and_deletes_equal_the_general_path(message):
    """Updates and Deletes, well formed or not, between good Inserts: the same events and
    errors as feed(decode_message(...)); the well-formed ones are taken by the compiled
    loop."""
    stream = _fixture_stream(DATA / "pg15" / "insert_types.jsonl")
    begin_at = next(i for i, m in enumerate(stream) if m[25:26] == b"I")
    relation_id = struct.unpack_from(">I", stream[begin_at], 26)[0]
    good = _xlogdata(0x1000, _insert(relation_id, _ROW))
    raw = stream[:begin_at] + [good, _xlogdata(0x1100, message(relation_id)), good]
    want_events, want_errors = _fed(raw)
    got_events, got_errors, taken = _taken(raw)
    assert (repr(got_events), got_errors) == (repr(want_events), want_errors)
    records = [e for e in want_events if isinstance(e, changes.ChangeRecord)]
    if not want_errors and not any(r.unchanged_toast or r.raw_columns for r in records):
        assert len(records) == 3 and taken == 3  # the good Inserts and the change itself


@compiled
def test_take_changes_stops_at_a_released_memoryview():
    """A released view is never read (its memory may be gone): the run stops before it and
    the general path reports it."""
    stream = _fixture_stream(DATA / "pg15" / "copy_multi_insert.jsonl")
    views = [memoryview(message) for message in stream]
    first = next(i for i, m in enumerate(stream) if m[25:26] == b"I")
    assembler = TransactionAssembler(values.TypeRegistry())
    events: list = []
    for message in stream[:first]:
        events.extend(assembler.feed(struct.unpack_from(">Q", message, 1)[0],
                                     decode_message(message, 25)))
    views[first + 3].release()
    taken, _ = assembler.take_changes(views, first, events)
    assert taken == first + 3
    with pytest.raises(ValueError, match="released"):
        bytes(views[taken])


@compiled
def test_twins_refuse_what_would_read_out_of_bounds():
    """Inputs no caller should pass still get an answer or an exception, never a read
    outside the object (these crashed the process before)."""
    assert PGOUTPUT.read_tuple(b"abc", sys.maxsize, None) is None  # pos + 2 overflowed
    with pytest.raises(IndexError):
        CHANGES.take_changes([b"x"], -1, {}, tuple, 0, 0, "", 0, [], None)
    with pytest.raises(TypeError):
        CHANGES.take_changes(None, 0, {}, tuple, 0, 0, "", 0, [], None)
    with pytest.raises(TypeError):
        FRAMING.sequence_bytes([], None, 1, b"")
    for call in (lambda: PGOUTPUT.read_tuple(None, 0, None),
                 lambda: EVENTS.pack_map(b"", 0, None), lambda: EVENTS.pack_map(None, 0, ()),
                 lambda: PUBLISHER.frame_messages([], None, {}, 10),
                 lambda: PUBLISHER.frame_messages([], {}, None, 10),
                 lambda: VALUES.timestamptz(None),
                 lambda: CHUNKS.pack_rows(None, 0, 0, (), (), (), str),
                 lambda: CHANGES.RowBuilder((), (), (), (), Exception)(None),
                 lambda: compiled_twin("cdc_platform.wire.encoding").decode_msgpack(None),
                 lambda: compiled_twin("cdc_platform.mirror.snapshots").chunk_tuples(
                     b"", None),
                 lambda: compiled_twin("cdc_platform.jetstream.frames").deliver(None, 0, {})):
        with pytest.raises(TypeError):  # (a typed argument given None was read as memory)
            call()


@compiled
def test_frame_messages_leaves_iterators_to_the_python_loop():
    """A generator can be gone over once: the compiled loop must not start on it, or the
    Python loop that takes over would find it empty."""
    messages = [("s", "id", b"p", ())]
    assert PUBLISHER.frame_messages(messages, {"s": b"s"}, {(): b""}, 1024) is not None
    assert PUBLISHER.frame_messages(iter(messages), {"s": b"s"}, {(): b""}, 1024) is None
