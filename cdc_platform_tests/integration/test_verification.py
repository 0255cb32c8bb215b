"""Source verifications end to end (docs/verification.md Part 2, item 2): real PostgreSQL,
nats-server, the bridge and (for the Spark path) local Spark. The digest is checked against
one rebuilt without the verification's code: an INIT snapshot taken earlier plus the CDC
events up to the digest's lsn, hashed with ``RowDigester``."""

from __future__ import annotations

import asyncio
import contextlib
import re

import psycopg
import pytest
from nats.js.errors import NotFoundError

from cdc_platform.errors import BridgeBehindError, SnapshotRequestRefused, VerificationError
from cdc_platform.lsn import parse_lsn
from cdc_platform.settings import VerifySettings
from cdc_platform.snapshot import SnapshotOptions, snapshot_table
from cdc_platform.verify import verify_table
from cdc_platform.wire import HEADER_SCHEMA_FINGERPRINT, decode_payload, watermark_subject
from cdc_platform.wire.digest import RowDigester, bucket_bits, table_digest
from cdc_platform_tests.fixtures.bridge import running_bridge, slot_confirmed, wait_for
from cdc_platform_tests.fixtures.services import (
    CLI,
    bridge_env,
    platform_settings,
    random_name,
)
from cdc_platform_tests.fixtures.snapshots import (
    LIVE_TABLE_COLUMNS,
    Writer,
    settings_for,
    snapshot_data,
)
from cdc_platform_tests.fixtures.verification import (
    buckets_of,
    digest_at,
    digest_message,
    stored_seq,
    table_events,
)

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major

COLUMNS = ["id", "v", "txt", "at", "tags"]
ROWS = 3_000


def _live_table(pg_admin, cdc_database, rows=ROWS) -> str:
    table = random_name("verified")
    pg_admin.execute(f"CREATE TABLE {table} ({LIVE_TABLE_COLUMNS})")
    pg_admin.execute(f"INSERT INTO {table} SELECT i, i % 100, 'r' || i, now(), ARRAY['a'] "
                     f"FROM generate_series(1, {rows}) i")
    cdc_database.add_tables(pg_admin, table)
    return table


async def _caught_up(pg_admin, cdc_database) -> None:
    """Until the bridge has stored everything committed so far."""
    end = parse_lsn(pg_admin.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
    await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) >= end,
                   what="the bridge to catch up")


async def test_the_digest_is_the_tables_rows_at_its_lsn_under_concurrent_writes(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    table = _live_table(pg_admin, cdc_database)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    writer = Writer(cdc_database.server.superuser_conninfo(), table, ROWS + 1)
    async with running_bridge(settings):
        try:
            await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0,
                           what="the bridge's slot")
            writer.start()
            snapshot = await snapshot_table(None, settings, table)  # writes before ...
            await asyncio.sleep(0.3)  # ... between the snapshot and the verification ...
            result = await verify_table(None, settings, table)  # ... during ...
            await asyncio.sleep(0.3)  # ... and after it
        finally:
            writer.stop.set()
            await asyncio.to_thread(writer.join, 10)
        assert writer.error is None, writer.error
        await _caught_up(pg_admin, cdc_database)
    events = await table_events(nats_client, table)
    message, payload, digest = await digest_message(nats_client, result)
    marker_seq = await stored_seq(nats_client, result.marker_subject)

    assert result.bits == payload["bits"] == bucket_bits(result.row_count)
    assert payload["row_count"] == result.row_count == result.rows_read
    assert payload["lsn"] == result.lsn and payload["buckets"] is None
    assert message.headers[HEADER_SCHEMA_FINGERPRINT] == payload["schema_fingerprint"]
    expected, applied = digest_at(await snapshot_data(nats_client, snapshot), snapshot.lsn,
                                  events, result.lsn, COLUMNS, ["id"], result.bits)
    assert digest == buckets_of(expected)
    lsn = parse_lsn(result.lsn)
    below = [seq for seq, event in events if parse_lsn(event["commit_lsn"]) < lsn]
    above = [seq for seq, event in events if parse_lsn(event["commit_lsn"]) >= lsn]
    assert applied > 0 and above, "writes between the snapshot and the digest, and after it"
    assert marker_seq is not None and marker_seq < min(above)
    marker = decode_payload((await nats_client.jetstream().get_msg("CDC", marker_seq)).data,
                            "msgpack")
    assert (marker["type"], marker["snapshot_id"], marker["table"]) == (
        "watermark", result.verification_id, table)
    assert payload["marker_subject"] == result.marker_subject == marker["subject"]
    assert message.seq > max(below)
    print(f"verification: {writer.transactions} writer transactions; {applied} events "
          f"between the snapshot and the digest's lsn, {len(above)} after it")


@pytest.mark.spark
async def test_the_spark_path_digests_as_the_in_process_path(
        cdc_database, pg_admin, provisioned_nats, nats_client, spark_session):
    table = _live_table(pg_admin, cdc_database)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        here = await verify_table(spark_session, settings, table)
        spark = await verify_table(spark_session, settings, table,
                                   options=SnapshotOptions(small_table_bytes=0, parallelism=3))
    assert (here.spark, spark.spark) == (False, True) and spark.partitions > 1
    assert here.row_count == spark.row_count == ROWS
    assert (await digest_message(nats_client, here))[2] == (
        await digest_message(nats_client, spark))[2]


async def test_a_run_for_some_buckets_equals_those_buckets_of_the_whole_digest(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    table = _live_table(pg_admin, cdc_database)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        coarse = await verify_table(None, settings, table, bits=3)
        whole = await verify_table(None, settings, table, bits=5)
        some = await verify_table(None, settings, table, bits=5, buckets=[17, 2, 30])
    every = (await digest_message(nats_client, whole))[2]
    _, payload, chosen = await digest_message(nats_client, some)
    assert payload["buckets"] == [2, 17, 30] and some.buckets == (2, 17, 30)
    assert some.rows_read == ROWS and 0 < some.row_count < ROWS // 4
    assert chosen == {bucket: every[bucket] for bucket in (2, 17, 30)}
    # and buckets nest: bucket 1 at 3 bits holds buckets 4..7 at 5 bits
    assert (await digest_message(nats_client, coarse))[2][1] == (
        sum(every[b][0] for b in range(4, 8)) % 2**64, sum(every[b][1] for b in range(4, 8)))


async def test_a_table_without_a_primary_key_is_keyed_by_every_column_in_json_too(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """REPLICA IDENTITY FULL: equal rows are distinct rows of one bucket, NULL is no value;
    a JSON platform sends the totals in base64."""
    table = random_name("keyless")
    pg_admin.execute(f"CREATE TABLE {table} (n int, t text, f float8)")
    pg_admin.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
    pg_admin.execute(f"INSERT INTO {table} VALUES (1, 'a', 0.5), (1, 'a', 0.5), (2, NULL, "
                     "'NaN'), (3, '', '-0')")
    cdc_database.add_tables(pg_admin, table)
    settings = settings_for(cdc_database, provisioned_nats.url, format="json")
    async with running_bridge(settings):
        result = await verify_table(None, settings, table, bits=1)
    message, payload, digest = await digest_message(nats_client, result, "json")
    assert isinstance(payload["totals"], str)  # base64
    assert message.headers["Content-Type"] == "application/json"
    rows = [{"n": 1, "t": "a", "f": 0.5}, {"n": 1, "t": "a", "f": 0.5},
            {"n": 2, "t": None, "f": float("nan")}, {"n": 3, "t": "", "f": -0.0}]
    assert digest == buckets_of(table_digest(rows, RowDigester(["n", "t", "f"]), 1))


async def test_a_verification_gives_way_to_ddl_its_export_waits_for_and_is_made_again(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """As a snapshot does (test_snapshot.py): a transaction that wrote runs ALTER TABLE while
    the verification holds its guard and creates its slot; the verification gives way and is
    made again under ``{id}-r1``, digesting the altered table."""
    table = random_name("ddlverify")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' FROM generate_series(1, 10) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0,
                       what="the bridge's slot")
        with psycopg.connect(cdc_database.server.superuser_conninfo()) as migration:
            migration.execute(f"UPDATE {table} SET v = 'w' WHERE id = 1")  # (it has an xid)
            verification = asyncio.create_task(verify_table(None, settings, table, bits=1))

            def exporting_waits() -> bool:
                return pg_admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender' "
                    "AND application_name = 'cdc_platform_snapshot' "
                    "AND wait_event_type = 'Lock'").fetchone()[0] > 0
            await wait_for(lambda: exporting_waits() or verification.done(),
                           what="the exporting slot to wait")
            assert exporting_waits()

            def alter() -> None:
                migration.execute(f"ALTER TABLE {table} ADD COLUMN w int DEFAULT 7")
                migration.commit()
            altering = asyncio.create_task(asyncio.to_thread(alter))
            try:
                result = await asyncio.wait_for(asyncio.shield(verification), 60)
            finally:
                verification.cancel()
                with contextlib.suppress(BaseException):
                    await verification
                await altering
    assert result.verification_id.endswith("-r1")  # the second attempt, after the DDL
    rows = [{"id": 1, "v": "w", "w": 7}, *({"id": i, "v": "v", "w": 7} for i in range(2, 11))]
    digest = (await digest_message(nats_client, result))[2]
    assert digest == buckets_of(table_digest(rows, RowDigester(["id", "v", "w"], ["id"]), 1))


async def test_an_unknown_or_unpublished_table_is_refused_before_any_marker(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    unpublished = random_name("unpublished")
    pg_admin.execute(f"CREATE TABLE {unpublished} (id int PRIMARY KEY)")
    tables = (random_name("missing"), unpublished)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0,
                       what="the bridge's slot")
        for table in tables:
            verification_id = f"verify-{table}"
            with pytest.raises(SnapshotRequestRefused, match="not"):
                await verify_table(None, settings, table, verification_id=verification_id)
        await _caught_up(pg_admin, cdc_database)
    for table in tables:
        assert await stored_seq(nats_client, watermark_subject(f"verify-{table}")) is None


async def test_without_a_bridge_the_run_fails_as_behind_and_publishes_nothing(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    table = _live_table(pg_admin, cdc_database, rows=10)
    settings = platform_settings(cdc_database, provisioned_nats.url).model_copy(
        update={"verify": VerifySettings(wait_seconds=1)})
    verification_id = f"verify-{table}"
    with pytest.raises(BridgeBehindError, match="the bridge is behind: slot .* does not exist"):
        await verify_table(None, settings, table, verification_id=verification_id)
    with pytest.raises(NotFoundError):
        await nats_client.jetstream().get_last_msg(
            "CDC", f"cdc.cdc-platform.verify.{table}.{verification_id}")


async def test_a_digest_over_max_payload_fails_in_one_line_and_publishes_nothing(
        cdc_database, pg_admin, small_nats):
    # 14 bits (what resync_sensor asks for) is a ~150 KB digest: over a 64 KB max_payload.
    # Without the check the run failed "nats: maximum payload exceeded", naming nothing
    server, client = small_nats
    table = _live_table(pg_admin, cdc_database, rows=10)
    settings = platform_settings(cdc_database, server.url)
    async with running_bridge(settings):
        with pytest.raises(VerificationError, match=(
                rf"the digest of {table} at 14 bits is 1\d\d,\d{{3}} bytes, over the NATS "
                r"server's max_payload \(65,536\): verify at fewer bits")) as raised:
            await verify_table(None, settings, table, bits=14)
        assert "\n" not in str(raised.value)
        result = await verify_table(None, settings, table, bits=8)  # ~3 KB: fits
    stored = await client.jetstream().get_last_msg("CDC", f"cdc.cdc-platform.verify.{table}.>")
    assert stored.seq == result.digest_seq  # the only digest of the table


@pytest.mark.every_major
async def test_a_run_started_before_the_bridge_has_its_slot_waits_for_it_to_mark(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    # as while a bridge replaces a lost slot (resync_sensor verifies every table then): a
    # marker written before the slot exists is decoded by no slot, never reaches CDC, and
    # every mirror would meet the digest "not comparable"
    table = _live_table(pg_admin, cdc_database, rows=10)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    verifying = asyncio.create_task(verify_table(None, settings, table))
    await wait_for(lambda: pg_admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'cdc_platform_verify' "
        "AND query LIKE '%pg_replication_slots%'").fetchone()[0],
        what="the verification looking for the slot")
    async with running_bridge(settings):
        result = await asyncio.wait_for(verifying, 60)  # (the bridge stored what precedes lsn)
    assert await stored_seq(nats_client, result.marker_subject) is not None


async def test_the_cli_prints_the_verification_and_says_what_went_wrong_in_one_line(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    table = _live_table(pg_admin, cdc_database, rows=50)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    env = {**bridge_env(cdc_database, provisioned_nats.url), "CDC_SLOT": cdc_database.slot,
           "CDC_PUBLICATION": cdc_database.publication, "CDC_VERIFY_WAIT": "20"}

    async def cli(*args: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            CLI, "verify", *args, env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), 120)
        return process.returncode, out.decode(), err.decode()

    async with running_bridge(settings):
        code, out, err = await cli(table, "--bits", "2")
    assert code == 0, err
    first, digest_line, _ = out.splitlines()
    assert f"of {table}: 50 rows in 4 buckets (2 bits) at lsn " in first
    subject, seq = re.fullmatch(r"digest: (\S+) \(CDC seq (\d+)\); .*", digest_line).groups()
    assert subject.startswith(f"cdc.cdc-platform.verify.{table}.verify-")
    stored = await nats_client.jetstream().get_msg("CDC", int(seq))
    assert stored.subject == subject
    assert sum(decode_payload(stored.data, "msgpack")["counts"]) == 50

    for args, error in (([random_name("missing")], "not"), ([table, "--bits", "15"], "bits")):
        code, out, err = await cli(*args)
        lines = [line for line in err.splitlines() if " INFO " not in line]
        assert code == 2 and not out and len(lines) == 1, err
        assert lines[0].startswith("cdc-platform: error: ") and error in lines[0]
