"""Domain columns come back exactly from a mirror (docs/verification.md Part 1, "Where the
mirror lacks what it needs"): a mirror stores and reads a domain's values as its base type's,
in msgpack and JSON, so its rows and its digest equal the source's and a verification is met
``equal``. Real PostgreSQL (15 and 18), bridge, snapshots and mirror."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3

import psycopg
import pytest

from cdc_platform.consumer.schemas import schema_value
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.positions import load_shapes
from cdc_platform.mirror.stored_values import StoredRowDigester
from cdc_platform.mirror.verifications import VerificationResult
from cdc_platform.replication.connection import SESSION_OPTIONS
from cdc_platform.settings import EncodingSettings, MirrorSettings
from cdc_platform.snapshot.source import describe_table
from cdc_platform.verify.job import verify_table
from cdc_platform.wire import decode_any
from cdc_platform.wire.digest import RowDigester
from cdc_platform_tests.exactness import bridge_caught_up, mirror_caught_up
from cdc_platform_tests.fixtures.bridge import bridge_ready, running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import platform_settings, random_name
from cdc_platform_tests.fixtures.verification import digest_message, source_rows

pytestmark = pytest.mark.every_major  # domains, xid8 and float output are the server's

FAST = MirrorSettings(status_interval_seconds=1.0, snapshot_wait_seconds=120.0)

# (id, f, x, b, ia, fa, ba, mo, pa, fe): values a mirror reading by the domain's own type
# got wrong (mo, pa, fe: a domain directly over an array of an enum, of a composite type and
# of a domain over the enum, whose base type is no builtin array type)
_ROWS = [
    r"""(1, 'NaN', '18446744073709551615', '\x00ff', '{1,NULL,3}', '{NaN,Infinity,-0}',
         '{"\\x00ff",NULL}', '{sad,NULL,"so, so"}', '{"(1,x)",NULL}', '{ok}')""",
    r"""(2, 'Infinity', '9223372036854775808', '\x', '{{1,2},{3,4}}', '{-Infinity,1.5}',
         '{"\\x"}', '{{sad,ok},{ok,sad}}', '{"(2,\"y, z\")"}', '{sad,NULL}')""",
    "(3, '-Infinity', '0', 'plain', '{}', '{}', '{}', '{}', '{}', '{}')",
    "(4, '-0', '42', NULL, NULL, '{NULL,NaN}', NULL, '{ok}', NULL, NULL)",
    r"""(5, '1e-320', NULL, '\xdeadbeef', '{7}', NULL, '{"\\xab","\\x"}', NULL,
         '{"(,)"}', '{"so, so"}')""",
]


def _create(pg_admin, table: str) -> None:
    """``table`` with a column of a domain over float8, xid8, bytea and int4[], an array of
    the float8 domain and an array of the bytea domain (the float8 domain gets a column
    more later), and of domains over an enum's array, a composite's array and the array of
    a domain over the enum."""
    pg_admin.execute(f"CREATE DOMAIN {table}_f8 AS float8")
    pg_admin.execute(f"CREATE DOMAIN {table}_x8 AS xid8")
    pg_admin.execute(f"CREATE DOMAIN {table}_by AS bytea")
    pg_admin.execute(f"CREATE DOMAIN {table}_ia AS int4[]")
    pg_admin.execute(f"CREATE TYPE {table}_mood AS ENUM ('sad', 'ok', 'so, so')")
    pg_admin.execute(f"CREATE DOMAIN {table}_moods AS {table}_mood[]")
    pg_admin.execute(f"CREATE TYPE {table}_pair AS (a int, b text)")
    pg_admin.execute(f"CREATE DOMAIN {table}_pairs AS {table}_pair[]")
    pg_admin.execute(f"CREATE DOMAIN {table}_feeling AS {table}_mood")
    pg_admin.execute(f"CREATE DOMAIN {table}_feelings AS {table}_feeling[]")
    pg_admin.execute(
        f"CREATE TABLE {table} (id int PRIMARY KEY, f {table}_f8, x {table}_x8, b {table}_by, "
        f"ia {table}_ia, fa {table}_f8[], ba {table}_by[], mo {table}_moods, pa {table}_pairs, "
        f"fe {table}_feelings)")


def _array_types(conninfo: str, table: str) -> dict[str, int]:
    """The array types of ``table``'s enum and composite type, by their names' ends."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return {name: conn.execute("SELECT typarray::int FROM pg_type WHERE typname = %s",
                                   (f"{table}_{name}",)).fetchone()[0]
                for name in ("mood", "pair")}


def _row_hashes_of_source(conninfo: str, publication: str, table: str) -> dict[int, int]:
    with psycopg.connect(conninfo, autocommit=True, options=SESSION_OPTIONS) as reader:
        described = describe_table(reader, publication, table)
        rows = source_rows(reader, described)
    digester = RowDigester([c.name for c in described.schema.columns], ["id"])
    return {row["id"]: digester.row_hash(row) for row in rows}


def _row_hashes_of_mirror(db, table: str) -> dict[int, int]:
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as local:
        shape = load_shapes(local)[table]
        names = ", ".join(f'"{c.name}"' for c in shape.columns)
        stored = local.execute(f'SELECT id, {names} FROM "{table}"').fetchall()
    digester = StoredRowDigester(shape.columns, ["id"])
    return {row[0]: digester.hashes(row[1:])[1] for row in stored}


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_domain_columns_come_back_from_the_mirror_and_verify_equal(
        fmt, cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    table = random_name("domains")
    _create(pg_admin, table)
    pg_admin.execute(f"INSERT INTO {table} VALUES {', '.join(_ROWS[:3])}")  # the snapshot's
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    settings = settings.model_copy(update={"encoding": EncodingSettings(format=fmt)})
    conninfo = cdc_database.server.superuser_conninfo()
    db = tmp_path / "mirror.db"
    results: list[VerificationResult] = []
    lines: list[str] = []
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        mirror = Mirror(settings, [table], db, options=FAST, report=lines.append,
                        on_verification=lambda _, result: results.append(result))
        stop = asyncio.Event()
        running = asyncio.create_task(mirror.run(stop))
        await mirror_caught_up(mirror, running, nats_client)
        # the stream's: inserted, updated from one edge value to another, and a domain
        # column added (the schema event's shape, from the Relation message)
        pg_admin.execute(f"INSERT INTO {table} VALUES {', '.join(_ROWS[3:])}")
        pg_admin.execute(f"UPDATE {table} SET f = 'NaN', fa = '{{-0,NaN}}', "
                         f"mo = '{{\"so, so\",NULL}}' WHERE id = 2")
        pg_admin.execute(f"ALTER TABLE {table} ADD COLUMN g {table}_f8")
        pg_admin.execute(f"UPDATE {table} SET g = '-Infinity' WHERE id IN (1, 4)")
        await bridge_caught_up(pg_admin, cdc_database.slot)
        await mirror_caught_up(mirror, running, nats_client)
        schema: dict = {}

        async def in_kv() -> bool:
            schema.update(decode_any(await schema_value(
                nats_client.jetstream(), settings.topology.schemas.bucket, table) or b""))
            return any(column["name"] == "g" for column in schema["columns"])
        await wait_for(in_kv, what="the added column in KV")
        verified = await verify_table(None, settings, table)
        _, digest, _ = await digest_message(nats_client, verified, fmt)
        await wait_for(lambda: any(r.verification_id == digest["verification_id"]
                                   for r in results), timeout=60, what="the verification met")
        stop.set()
        await asyncio.wait_for(running, 30)
    # KV says each column's base type (its own where it is no domain) and whether its
    # values are arrays
    arrays = _array_types(conninfo, table)
    assert {c["name"]: c["base_type_oid"] for c in schema["columns"]} == {
        "id": 23, "f": 701, "x": 5069, "b": 17, "ia": 1007, "fa": 1022, "ba": 1001,
        "mo": arrays["mood"], "pa": arrays["pair"], "fe": arrays["mood"], "g": 701}
    assert [c["name"] for c in schema["columns"] if c["type_oid"] == c["base_type_oid"]] == [
        "id"]
    assert [c["name"] for c in schema["columns"] if c["is_array"]] == [
        "ia", "fa", "ba", "mo", "pa", "fe"]
    met = next(r for r in results if r.verification_id == digest["verification_id"])
    source = _row_hashes_of_source(conninfo, cdc_database.publication, table)
    assert len(source) == len(_ROWS)
    assert _row_hashes_of_mirror(db, table) == source
    assert (met.status, met.buckets_differing, met.changed_outside) == ("equal", {}, []), \
        "\n".join(lines[-20:])
