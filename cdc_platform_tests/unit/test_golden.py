"""The wire contract pinned to bytes: both writers (pure Python and the compiled twins)
produce exactly the golden payloads in ``data/golden/``, and every payload has the fields its
type in ``cdc_platform.wire.payloads`` lists, in that order. A failure here is a wire change:
make it only on purpose (docs/wire-contract.md, CHANGELOG), then rewrite the files with
``python -m cdc_platform_tests.golden``."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import pytest

from cdc_platform.wire import payloads
from cdc_platform_tests import golden

CASES = [(case, fmt, implementation) for case in golden.CASES for fmt in golden.FORMATS
         for implementation in golden.implementations(case)]


@pytest.mark.parametrize(("case", "fmt", "implementation"), CASES)
def test_the_writers_produce_the_golden_bytes(case, fmt, implementation):
    built = golden.to_file(golden.CASES[case](fmt, implementation), fmt)
    assert built == golden.path(case, fmt).read_text()


def test_both_writers_are_checked_where_both_exist():
    if "compiled" in golden.implementations("per_change"):
        assert {(c, i) for c, _, i in CASES if i == "compiled"} == {
            (c, "compiled") for c in golden.TWO_WRITERS}


def _golden_payloads(fmt: str):
    for case in golden.CASES:
        for line in golden.path(case, fmt).read_text().splitlines():
            message = json.loads(line)
            data = message["payload"]
            decoded = (msgpack.unpackb(bytes.fromhex(data)) if fmt == "msgpack"
                       else json.loads(data))
            yield message["subject"], decoded


def _payload_type(subject: str) -> type:
    if subject.startswith("cdc.cdc-platform.watermark."):
        return payloads.WatermarkMarker
    if subject.startswith("cdc.cdc-platform.verify."):
        return payloads.VerificationDigestPayload
    if subject.startswith("cdc.") and subject.endswith(".schema"):
        return payloads.SchemaEvent
    if subject.startswith("cdc."):
        return payloads.ChangeEvent
    if subject.startswith("init.snap."):
        return payloads.SnapshotChunk
    if subject.startswith("init.meta."):
        return payloads.SnapshotMetaPayload
    if subject.startswith("init.repair."):
        return payloads.RepairMetaPayload
    return payloads.TableSchemaValue


def _assert_fields(payload: dict, payload_type: type) -> None:
    required = payloads.fields(payload_type)
    names = list(payload)
    assert names[:len(required)] == list(required), payload_type.__name__
    assert set(names[len(required):]) <= payloads.optional_fields(payload_type), \
        payload_type.__name__
    if "table_schema" in payload:
        _assert_fields(payload["table_schema"], payloads.TableSchemaValue)
    if payload_type is payloads.TableSchemaValue:
        for column in payload["columns"]:
            assert list(column) == list(payloads.COLUMN_FIELDS), "Column"


@pytest.mark.parametrize("fmt", golden.FORMATS)
def test_every_golden_payload_has_the_fields_of_its_type(fmt):
    seen: dict[str, set] = {}
    for subject, decoded in _golden_payloads(fmt):
        payload_type = _payload_type(subject)
        for payload in decoded if isinstance(decoded, list) else [decoded]:
            _assert_fields(payload, payload_type)
            seen.setdefault(payload_type.__name__, set()).add(payload.get("operation"))
            if "tx_tables" in payload:
                seen["ChangeEvent"].add("tx_tables")
    # the files cover every operation, the transaction mark, and every payload type
    assert seen["ChangeEvent"] >= {"INSERT", "UPDATE", "DELETE", "TRUNCATE", "tx_tables"}
    assert set(seen) == {"ChangeEvent", "SchemaEvent", "WatermarkMarker", "SnapshotChunk",
                         "SnapshotMetaPayload", "RepairMetaPayload", "TableSchemaValue",
                         "VerificationDigestPayload"}


def test_a_payload_with_a_missing_or_unknown_field_is_refused():
    with pytest.raises(ValueError, match=r"missing \['lsn'\], unknown \['extra'\]"):
        payloads.in_field_order(payloads.SnapshotReply, {
            "snapshot_id": "s", "cdc_stream": "CDC", "cdc_start_seq": 1,
            "meta_subject": "init.meta.t", "meta_seq": 2, "reused": False, "extra": 1})


def test_a_column_reads_back_from_the_wire_as_it_was_written():
    for column in golden.table_schema().to_wire()["columns"]:
        assert payloads.Column.from_wire(column).to_wire() == column
    # what a consumer stores a column by is all a column needs; the rest reads as unknown
    assert payloads.Column.from_wire({"name": "id", "type_oid": 23, "data_type": "integer"}) \
        == payloads.Column("id", 0, "integer", True, None, 23, False, False, None, 0)


def test_a_columns_base_type_is_written_and_read_and_a_column_without_one_is_its_type():
    # written on every column, after attnum: the golden columns (no domain) say their own type
    columns = golden.table_schema().to_wire()["columns"]
    assert [list(column)[-3:-1] for column in columns] == [["attnum", "base_type_oid"]] * 6
    assert all(column["base_type_oid"] == column["type_oid"] for column in columns)
    # a domain's column: its base type read back as written
    domain = {**columns[2], "type_oid": 16500, "data_type": "score", "base_type_oid": 701}
    assert payloads.Column.from_wire(domain).base_type_oid == 701
    assert payloads.Column.from_wire(domain).to_wire() == domain
    # a schema an older bridge wrote has none: the type is its own base type
    older = {name: value for name, value in domain.items() if name != "base_type_oid"}
    assert payloads.Column.from_wire(older).base_type_oid == 16500
    assert payloads.Column.from_wire({**domain, "base_type_oid": None}).base_type_oid == 16500


def test_whether_a_columns_values_are_arrays_is_written_and_read_and_absent_is_not():
    # written on every column, after base_type_oid: the golden int4[] column's are arrays
    columns = golden.table_schema().to_wire()["columns"]
    assert [list(column)[-1] for column in columns] == ["is_array"] * 6
    assert [column["name"] for column in columns if column["is_array"]] == ["tags"]
    # a domain over an enum's array: its base type (the enum's array type) is no builtin
    domain = {**columns[4], "type_oid": 16510, "data_type": "moods", "base_type_oid": 16501}
    assert payloads.Column.from_wire(domain).is_array is True
    assert payloads.Column.from_wire(domain).to_wire() == domain
    # a schema an older bridge wrote has none: not known to be an array
    older = {name: value for name, value in domain.items() if name != "is_array"}
    assert payloads.Column.from_wire(older).is_array is False


def test_the_fingerprint_does_not_cover_the_base_type_nor_is_array():
    schema = golden.table_schema()
    for change in ({"base_type_oid": 16500}, {"is_array": True}):
        retyped = dataclasses.replace(schema, columns=tuple(
            dataclasses.replace(column, **change) for column in schema.columns))
        assert retyped.to_wire()["columns"] != schema.to_wire()["columns"]
        assert retyped.fingerprint == schema.fingerprint


@pytest.mark.parametrize(("column", "error"), [
    ({"type_oid": 23, "data_type": "integer"}, KeyError),
    ({"name": "id", "data_type": "integer"}, KeyError),
    ({"name": "id", "type_oid": 23}, KeyError),
    ({"name": "", "type_oid": 23, "data_type": "integer"}, ValueError),
    ({"name": 7, "type_oid": 23, "data_type": "integer"}, ValueError),
    ({"name": "id", "type_oid": "int4", "data_type": "integer"}, ValueError),
    ({"name": "id", "type_oid": None, "data_type": "integer"}, TypeError),
    ({"name": "id", "type_oid": 23, "data_type": "integer", "attnum": [1]}, TypeError),
    ({"name": "id", "type_oid": 23, "data_type": "integer", "base_type_oid": "x"}, ValueError),
    (["id", 23, "integer"], TypeError),
])
def test_a_column_that_is_not_one_is_refused(column, error):
    with pytest.raises(error):
        payloads.Column.from_wire(column)
