"""Edge values through the real bridge and a real Spark snapshot: no value stops the stream,
and CDC and snapshots agree on every temporal edge (year 0, the ends of each range,
infinity, 24:00:00)."""

from __future__ import annotations

import json
import math

import pytest

from cdc_platform.snapshot import snapshot_table
from cdc_platform_tests.fixtures.bridge import events_of, running_bridge, slot_confirmed, wait_for
from cdc_platform_tests.fixtures.services import platform_settings, random_name, read_subjects
from cdc_platform_tests.fixtures.snapshots import NO_BRIDGE, snapshot_data
from cdc_platform_tests.fixtures.values import EDGES

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major


@pytest.fixture
def edge_table(cdc_database, pg_admin):
    name = random_name("edges")
    columns = ", ".join(f"c{i} {kind}" for i, (kind, _, _) in enumerate(EDGES))
    pg_admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, {columns})")
    cdc_database.add_tables(pg_admin, name)
    return name


def _insert_edges(pg_admin, table):
    literals = ", ".join(f"{literal}::{kind}" for kind, literal, _ in EDGES)
    pg_admin.execute(f"INSERT INTO {table} VALUES (1, {literals})")


def _check_row(row, fmt="msgpack"):
    for index, (kind, literal, expected) in enumerate(EDGES):
        got = row[f"c{index}"]
        if kind == "float8":
            assert got == "NaN" if fmt == "json" else math.isnan(got), (kind, literal)
            continue
        assert got == expected, (kind, literal, got)


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_edge_values_flow_through_cdc_and_the_stream_goes_on(
        fmt, edge_table, cdc_database, pg_admin, provisioned_nats, nats_client):
    """The jsonb integer above 64 bits used to crash the bridge on every restart."""
    other = random_name("after")
    pg_admin.execute(f"CREATE TABLE {other} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, other)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    settings = settings.model_copy(update={"encoding": settings.encoding.model_copy(
        update={"format": fmt})})
    async with running_bridge(settings):
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0,
                       what="the slot to be confirmed once")
        _insert_edges(pg_admin, edge_table)
        pg_admin.execute(f"INSERT INTO {other} VALUES (1)")
        (edge,) = events_of(await read_subjects(nats_client, "CDC", f"cdc.{edge_table}.insert",
                                                expect=1), fmt)
        (after,) = events_of(await read_subjects(nats_client, "CDC", f"cdc.{other}.insert",
                                                 expect=1), fmt)
    _check_row(edge["data"], fmt)
    assert after["data"] == {"id": 1}
    assert json.loads(edge["data"]["c0"])["n"] == 123456789012345678901234567890


@pytest.mark.spark
async def test_edge_values_in_a_snapshot_equal_cdc(edge_table, cdc_database, pg_admin,
                                                   provisioned_nats, nats_client, spark_session):
    _insert_edges(pg_admin, edge_table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = platform_settings(cdc_database, provisioned_nats.url)
    result = await snapshot_table(spark_session, settings, edge_table, options=NO_BRIDGE)
    (row,) = await snapshot_data(nats_client, result)
    _check_row(row)
