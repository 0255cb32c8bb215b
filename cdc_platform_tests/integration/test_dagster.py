"""The Dagster layer against real servers and a real (temporary) Dagster instance."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import msgpack
import pytest
import yaml

from cdc_platform.lsn import parse_lsn
from cdc_platform.replication.slots import read_slot
from cdc_platform_tests.fixtures.dagster import (
    FleetSensor,
    dagster_resources,
    fleet_sensor_for,
    record_verification,
    request_sensor_tick,
    verified,
)
from cdc_platform_tests.fixtures.services import TEST_SECRETS, random_name, read_subjects

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def dagster_env(cdc_database, provisioned_nats, monkeypatch, tmp_path):
    """The environment a deployment gives Dagster: CDC_* variables, DAGSTER_HOME."""
    env = {
        "CDC_PG_HOST": cdc_database.server.host, "CDC_PG_PORT": str(cdc_database.server.port),
        "CDC_PG_DB": "postgres", "CDC_PG_USER": cdc_database.role,
        "CDC_PG_PASSWORD": cdc_database.password, "CDC_PG_SSLMODE": "disable",
        "CDC_PUBLICATION": cdc_database.publication, "CDC_SLOT": cdc_database.slot,
        "CDC_NATS_URL": provisioned_nats.url, "CDC_NATS_PASSWORD": "",
        "CDC_HTTP_PORT": "0", "CDC_OBSERVE_INTERVAL": "1", "CDC_LAG_CHECK_INTERVAL": "1",
        "CDC_HEARTBEAT_INTERVAL": "1", "CDC_STATUS_INTERVAL": "0.5", "CDC_SLOT_WAIT": "10",
        "DAGSTER_HOME": str(tmp_path / "dagster_home"),
    }
    (tmp_path / "dagster_home").mkdir()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def test_definitions_load_with_everything(dagster_env):
    from cdc_platform.definitions import build_definitions

    defs = build_definitions()
    keys = {key.to_user_string() for key in defs.resolve_all_asset_keys()}
    assert keys == {"jetstream_topology", "schemas", "init_snapshot", "cdc_stream",
                    "table_verification", "table_repair", "mirror_fleet"}
    snapshot = defs.resolve_assets_def("init_snapshot")
    assert snapshot.partitions_def.name == "published_tables"
    verification = defs.resolve_assets_def("table_verification")
    assert verification.partitions_def.name == "published_tables"
    assert verification.asset_deps[verification.key] == {dg.AssetKey("init_snapshot")}
    assert defs.resolve_job_def("verification_job").partitions_def.name == "published_tables"
    repair = defs.resolve_assets_def("table_repair")
    assert repair.asset_deps[repair.key] == {dg.AssetKey("init_snapshot")}
    assert defs.resolve_job_def("repair_job").partitions_def.name == "published_tables"
    cdc_job = defs.resolve_job_def("cdc_job")
    assert cdc_job.tags["cdc_platform/slot"] == dagster_env["CDC_SLOT"]
    assert defs.resolve_job_def("snapshot_job").partitions_def.name == "published_tables"
    assert {s.name for s in defs.sensors} == {
        "cdc_sensor", "snapshot_request_sensor", "publication_sync_sensor", "resync_sensor",
        "mirror_fleet_sensor"}
    assert defs.resolve_schedule_def("snapshot_refresh_schedule").cron_schedule == "0 3 * * *"
    off = defs.resolve_schedule_def("verification_schedule")  # CDC_VERIFY_CRON unset
    assert off.default_status == dg.DefaultScheduleStatus.STOPPED


def test_the_verification_schedule_runs_when_its_cron_is_set(dagster_env, monkeypatch):
    from cdc_platform.definitions import build_definitions

    monkeypatch.setenv("CDC_VERIFY_CRON", "15 2 * * *")
    schedule = build_definitions().resolve_schedule_def("verification_schedule")
    assert schedule.cron_schedule == "15 2 * * *"
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    assert schedule.job_name == "verification_job"


def test_what_the_ui_shows_of_the_resources_holds_no_secret(dagster_env):
    """The UI shows each resource's configuration: no secret is there (the credentials are
    read from the environment at run time), though the password is in the environment."""
    from cdc_platform.definitions import build_definitions

    assert dagster_env["CDC_PG_PASSWORD"] in TEST_SECRETS
    shown = {name: resource.model_dump() if hasattr(resource, "model_dump") else repr(resource)
             for name, resource in build_definitions().resources.items()}
    assert "password" not in shown["postgres"]
    assert not any(secret in repr(shown) for secret in TEST_SECRETS), shown


@pytest.mark.parametrize(("resource", "field", "value"), [
    ("postgres", "host", "attacker.example"), ("postgres", "port", 5433),
    ("postgres", "sslmode", "disable"), ("postgres", "user", "postgres"),
    ("postgres", "password", "x"), ("nats", "url", "nats://attacker.example:4222"),
    ("nats", "tls_ca_file", "/tmp/attacker-ca.pem"), ("nats", "user", "x"),
    ("nats_replies", "url", "nats://attacker.example:4222"), ("nats_replies", "user", "x"),
])
def test_run_config_cannot_send_the_credentials_elsewhere(dagster_env, resource, field, value):
    """Run config (the launchpad, `dagster job launch --config`) overriding where a resource
    connects sent the environment's password to that host: where PostgreSQL and NATS are,
    and who connects, now come from the deployment's environment only."""
    from cdc_platform.definitions import build_definitions

    defs = build_definitions()
    for job_name in ("cdc_job", "snapshot_job"):
        job = defs.resolve_job_def(job_name)
        with pytest.raises(dg.DagsterInvalidConfigError):
            dg.validate_run_config(job, {"resources": {resource: {"config": {field: value}}}})


def test_instance_config_limits_one_cdc_run_per_slot():
    config = yaml.safe_load((REPO / "dagster.yaml").read_text())
    limits = config["run_coordinator"]["config"]["tag_concurrency_limits"]
    assert {"key": "cdc_platform/slot", "value": {"applyLimitPerUniqueValue": True},
            "limit": 1} in limits
    # snapshots of different tables run concurrently, never two of one table
    assert {"key": "cdc_platform/kind", "value": "snapshot", "limit": 2} in limits
    assert {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True},
            "limit": 1} in limits


def test_instance_config_loads_as_dagster_reads_it(tmp_path):
    import shutil

    shutil.copy(REPO / "dagster.yaml", tmp_path / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        coordinator = instance.run_coordinator
        assert type(coordinator).__name__ == "QueuedRunCoordinator"
        assert coordinator.get_run_queue_config().max_concurrent_runs == 4
        assert instance.run_monitoring_enabled


def test_publication_sync_sensor_tracks_the_publication(dagster_env, cdc_database, pg_admin):
    from cdc_platform.defs.snapshots.sensors import publication_sync_sensor

    first, second = random_name("sync_a"), random_name("sync_b")
    for table in (first, second):
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, first, second)
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(instance=instance, resources=dagster_resources())
        result = publication_sync_sensor(context)
        (added,) = result.dynamic_partitions_requests
        assert sorted(added.partition_keys) == sorted([first, second])
        instance.add_dynamic_partitions("published_tables", list(added.partition_keys))
        pg_admin.execute(f"ALTER PUBLICATION {cdc_database.publication} DROP TABLE {second}")
        result = publication_sync_sensor(dg.build_sensor_context(
            instance=instance, resources=dagster_resources()))
        (removed,) = result.dynamic_partitions_requests
        assert list(removed.partition_keys) == [second]
        assert isinstance(removed, dg.DeleteDynamicPartitionsRequest)


async def test_snapshot_requests_become_runs_once(dagster_env, cdc_database, pg_admin,
                                                  nats_client):
    from cdc_platform.definitions import build_definitions

    table = random_name("requested")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    defs = build_definitions()
    for subject in (table, table, "no_such_table"):
        await nats_client.publish(f"snapshot.request.{subject}", b"")
    await nats_client.flush()
    with dg.instance_for_test() as instance:
        evaluate = request_sensor_tick(defs, instance)

        result = await asyncio.to_thread(evaluate, None)
        assert [r.partition_key for r in result.run_requests] == [table]  # coalesced
        assert result.run_requests[0].run_key.startswith(f"snapshot-request-{table}-")
        # the next tick (cursor saved) finds nothing new: no second run
        again = await asyncio.to_thread(evaluate, result.cursor)
        assert isinstance(again, dg.SkipReason)


async def test_a_reply_to_the_platforms_own_subjects_is_never_sent(
        dagster_env, cdc_database, pg_admin, nats_client):
    """The sensor replies as the bridge user: a reply_to of a KV key, a meta subject or a CDC
    subject had it overwrite the table's schema, plant a meta and write into CDC."""
    import json as jsonlib

    from nats.js.errors import NotFoundError

    from cdc_platform.definitions import build_definitions

    table = random_name("deputy")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    targets = [f"$KV.schemas.{table}", f"init.meta.{table}", f"cdc.{table}.insert"]
    for target in targets:
        await nats_client.publish(f"snapshot.request.{table}",
                                  jsonlib.dumps({"reply_to": target}).encode())
    await nats_client.flush()
    defs = build_definitions()
    with dg.instance_for_test() as instance:
        result = await asyncio.to_thread(request_sensor_tick(defs, instance),
                                         None)
    assert not result.run_requests  # each was refused
    await asyncio.sleep(0.5)
    js = nats_client.jetstream()
    for stream, subject in (("KV_schemas", targets[0]), ("INIT", targets[1]),
                            ("CDC", targets[2])):
        with pytest.raises(NotFoundError):
            await js.get_last_msg(stream, subject)


async def test_a_request_flood_starts_one_run_per_table(dagster_env, cdc_database, pg_admin,
                                                        nats_client):
    """Issue 13: a flood of requests (genuine, garbage, for unknown tables) starts one run per
    table; while that run is queued, more requests join it (``accepted`` with ``coalesced``)
    instead of queueing more runs; once it runs (it may have taken its snapshot already), new
    requests queue one more run, which later ones join."""
    import json as jsonlib

    from cdc_platform.definitions import build_definitions

    table = random_name("flooded")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    inbox = f"_INBOX.replies.{random_name('r')}"
    replies: list[dict] = []

    async def collect(message):
        replies.append(jsonlib.loads(message.data))

    await nats_client.subscribe(inbox, cb=collect)

    async def flood(count: int, **body) -> None:
        for number in range(count):
            await nats_client.publish(f"snapshot.request.{table}", jsonlib.dumps(
                {"reply_to": inbox, "request_id": f"r{number}", **body}).encode())
        await nats_client.flush()

    await flood(150)
    for _ in range(40):
        await nats_client.publish(f"snapshot.request.{random_name('nope')}", b"")
        await nats_client.publish(f"snapshot.request.{table}", b"{not json")
    await nats_client.flush()
    defs = build_definitions()
    job = defs.resolve_job_def("snapshot_job")
    with dg.instance_for_test() as instance:
        evaluate = request_sensor_tick(defs, instance)

        first = await asyncio.to_thread(evaluate, None)
        assert [r.partition_key for r in first.run_requests] == [table]
        # the run Dagster launches from it, not started yet (queued behind the limits)
        run_key = first.run_requests[0].run_key
        tags = {"dagster/partition": table, "dagster/run_key": run_key}
        waiting = instance.create_run_for_job(
            job_def=job, status=dg.DagsterRunStatus.NOT_STARTED, tags=tags)
        await nats_client.flush()  # the first tick's replies are in before counting anew
        await asyncio.sleep(0.2)
        replies.clear()
        await flood(60)  # (within the stream's per-table cap of 100 kept requests)
        await flood(5, min_lsn="0/1")
        second = await asyncio.to_thread(evaluate, first.cursor)
        assert not second.run_requests  # everything joined the queued run
        deadline = time.monotonic() + 10
        while len(replies) < 65:
            assert time.monotonic() < deadline, len(replies)
            await asyncio.sleep(0.05)
        assert {(r["status"], r.get("coalesced"), r.get("run_key")) for r in replies} == {
            ("accepted", True, run_key)}
        # once it runs, its snapshot may be older than a new request: one more run, which
        # every request of the tick shares (none is told it joined the running one)
        instance.delete_run(waiting.run_id)
        instance.create_run_for_job(job_def=job, status=dg.DagsterRunStatus.STARTED, tags=tags)
        await nats_client.flush()
        await asyncio.sleep(0.2)
        replies.clear()
        await flood(3)
        await flood(2, min_lsn="0/1")
        third = await asyncio.to_thread(evaluate, second.cursor)
        assert [r.partition_key for r in third.run_requests] == [table]
        deadline = time.monotonic() + 10
        while len(replies) < 5:
            assert time.monotonic() < deadline, len(replies)
            await asyncio.sleep(0.05)
        assert {(r["status"], r.get("coalesced"), r.get("run_key")) for r in replies} == {
            ("accepted", None, third.run_requests[0].run_key)}


async def test_a_flood_across_tables_leaves_a_pending_request_in_place(
        dagster_env, cdc_database, pg_admin, monkeypatch, tmp_path):
    """Issue 24: a flood across many subjects (``snapshot.request.bogus_1..N``) pushed a real
    table's pending request out of SNAPSHOT_REQUESTS before the sensor saw it. On a
    nats-server of its own with small limits (settings), the flood fills the stream and the
    rest of it is refused; the table's request is still there, and the sensor runs it."""
    from cdc_platform.definitions import build_definitions
    from cdc_platform.dev.servers import LocalNatsServer
    from cdc_platform.jetstream.connection import close_nats, connect_nats
    from cdc_platform.jetstream.provision import provision
    from cdc_platform.settings import NatsSettings, NatsTopology, load_settings

    server = LocalNatsServer(tmp_path / "nats")
    server.start()
    client = None
    try:
        for name, value in {"CDC_NATS_URL": server.url, "CDC_REQUESTS_MAX_MSGS": "20",
                            "CDC_REQUESTS_MAX_PER_TABLE": "3"}.items():
            monkeypatch.setenv(name, value)
        client = await connect_nats(NatsSettings(url=server.url))
        await provision(client.jetstream(), load_settings(NatsTopology))
        table = random_name("pending")
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        cdc_database.add_tables(pg_admin, table)
        await client.publish(f"snapshot.request.{table}", b"")
        for number in range(60):  # core NATS, as an attacker would: no error to see
            await client.publish(f"snapshot.request.bogus_{number}", b"")
        await client.flush()
        await asyncio.sleep(0.5)  # (core publishes: stored a moment after the flush)
        stored = (await client.jetstream().stream_info("SNAPSHOT_REQUESTS")).state.messages
        assert stored == 20
        with dg.instance_for_test() as instance:
            evaluate = request_sensor_tick(build_definitions(), instance)
            result = await asyncio.to_thread(evaluate, None)
        assert [r.partition_key for r in result.run_requests] == [table]
    finally:
        if client is not None:
            await close_nats(client, 5)
        server.stop()


async def test_max_age_0_cannot_force_back_to_back_snapshots(
        dagster_env, cdc_database, pg_admin, nats_client, monkeypatch):
    """Issue 24: every request with ``max_age_seconds: 0`` started a full snapshot. Within
    CDC_SNAPSHOT_MIN_INTERVAL of the table's last request-started run, such a request gets
    the newest snapshot (``reused``); one that a snapshot that young cannot answer (its
    ``min_lsn`` is past it) joins a run the sensor holds back until the interval has
    passed."""
    import json as jsonlib

    from dagster_pyspark import LazyPySparkResource

    from cdc_platform.bridge.runner import CdcBridge
    from cdc_platform.definitions import build_definitions
    from cdc_platform.defs.snapshots.assets import REPLIES_TAG, init_snapshot
    from cdc_platform.lsn import format_lsn
    from cdc_platform.settings import load_settings
    from cdc_platform_tests.fixtures.bridge import wait_for

    monkeypatch.setenv("CDC_SNAPSHOT_MIN_INTERVAL", "3600")  # (set again once the run exists)
    table = random_name("paced")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    pg_admin.execute(f"INSERT INTO {table} SELECT generate_series(1, 100)")
    cdc_database.add_tables(pg_admin, table)
    inbox = f"_INBOX.replies.{random_name('r')}"
    replies: dict[str, dict] = {}

    async def collect(message):
        reply = jsonlib.loads(message.data)
        replies[reply["request_id"]] = reply

    await nats_client.subscribe(inbox, cb=collect)

    async def ask(request_id, **body):
        await nats_client.publish(f"snapshot.request.{table}", jsonlib.dumps(
            {"reply_to": inbox, "request_id": request_id, **body}).encode())
        await nats_client.flush()

    async def reply(request_id, status):
        deadline = time.monotonic() + 30
        while replies.get(request_id, {}).get("status") != status:
            assert time.monotonic() < deadline, replies
            await asyncio.sleep(0.05)
        return replies[request_id]

    defs = build_definitions()
    bridge = CdcBridge(load_settings())  # the watermark marker: a cutover point to reuse
    bridge_task = asyncio.create_task(bridge.run())
    try:
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("published_tables", [table])
            evaluate = request_sensor_tick(defs, instance)

            await ask("r1", max_age_seconds=0)
            first = await asyncio.to_thread(evaluate, None)
            (run_request,) = first.run_requests
            outcome = await asyncio.to_thread(
                dg.materialize, [init_snapshot], partition_key=table, instance=instance,
                tags=run_request.tags, raise_on_error=False,
                resources={**dagster_resources(),
                           "pyspark": LazyPySparkResource(spark_config={})})
            assert outcome.success
            taken = await reply("r1", "done")
            # The interval from here: the run's age, however long Spark took, plus time for
            # the three ticks below (each tick reads it), then the release, not 30 s of waiting.
            created = instance.get_run_record_by_id(outcome.run_id).create_timestamp
            interval = time.time() - created.timestamp() + 12.0
            monkeypatch.setenv("CDC_SNAPSHOT_MIN_INTERVAL", str(interval))

            await ask("r2", max_age_seconds=0)
            second = await asyncio.to_thread(evaluate, first.cursor)
            assert not second.run_requests
            reused = await reply("r2", "done")
            assert reused["reused"] is True and reused["snapshot_id"] == taken["snapshot_id"]

            past = format_lsn(parse_lsn(taken["lsn"]) + 1)
            await ask("r3", max_age_seconds=0, min_lsn=past)
            third = await asyncio.to_thread(evaluate, second.cursor)
            assert not third.run_requests
            held = await reply("r3", "accepted")
            await ask("r4", max_age_seconds=0, min_lsn=past)
            fourth = await asyncio.to_thread(evaluate, third.cursor)
            assert not fourth.run_requests
            assert (await reply("r4", "accepted"))["run_key"] == held["run_key"]
            assert time.time() < created.timestamp() + interval  # (held: not due yet)
            await asyncio.sleep(created.timestamp() + interval + 0.5 - time.time())
            due = await asyncio.to_thread(evaluate, fourth.cursor)
            (released,) = due.run_requests
            assert released.run_key == held["run_key"]
            assert jsonlib.loads(released.tags[REPLIES_TAG]) == [["r3", inbox], ["r4", inbox]]
    finally:
        bridge.request_stop()
        await asyncio.wait_for(bridge_task, 60)


async def test_a_resync_marker_starts_a_verification_of_every_table_once(
        dagster_env, cdc_database, nats_client):
    from cdc_platform.definitions import build_definitions
    from cdc_platform.wire import encoder, resync_msg_id, resync_subject

    defs = build_definitions()
    sensor = defs.resolve_sensor_def("resync_sensor")
    with dg.instance_for_test() as instance:
        def tick(cursor):
            return sensor(dg.build_sensor_context(instance=instance, cursor=cursor,
                                                  resources=dagster_resources(),
                                                  definitions=defs))

        assert isinstance(await asyncio.to_thread(tick, None), dg.SkipReason)  # no marker
        # the marker as the bridge stores it after replacing this platform's lost slot
        # (test_slot_resync.py has a real bridge do that)
        msg_id = resync_msg_id(cdc_database.slot, 0x16_0000_0000)
        ack = await nats_client.jetstream().publish(
            resync_subject(cdc_database.slot), encoder("msgpack")({
                "type": "resync", "slot": cdc_database.slot, "lost_after": "16/0",
                "reason": "slot lost", "timestamp": 0, "msg_id": msg_id}),
            headers={"Nats-Msg-Id": msg_id})
        # no tables known yet: the marker waits for them
        waiting = await asyncio.to_thread(tick, None)
        assert isinstance(waiting, dg.SkipReason) and "no published tables" in str(waiting)
        instance.add_dynamic_partitions("published_tables", ["sales__orders", "users"])
        result = await asyncio.to_thread(tick, None)
        assert sorted((r.partition_key, r.run_key) for r in result.run_requests) == [
            ("sales__orders", f"resync-{ack.seq}-sales__orders"),
            ("users", f"resync-{ack.seq}-users")]
        # at the finest bits: a mirror repairs up to a quarter of them (docs/verification.md
        # "Item 6"); table_verification reads the tag
        assert {r.tags.get("cdc_platform/verify_bits") for r in result.run_requests} == {"14"}
        assert isinstance(await asyncio.to_thread(tick, result.cursor), dg.SkipReason)


def test_cdc_sensor_keeps_exactly_one_run(dagster_env):
    from cdc_platform.definitions import build_definitions

    defs = build_definitions()
    sensor = defs.resolve_sensor_def("cdc_sensor")
    job = defs.resolve_job_def("cdc_job")
    with dg.instance_for_test() as instance:
        first = sensor(dg.build_sensor_context(instance=instance))
        assert isinstance(first, dg.RunRequest)
        run = instance.create_run_for_job(job_def=job, run_id=None)
        alive = sensor(dg.build_sensor_context(instance=instance))
        assert isinstance(alive, dg.SkipReason) and run.run_id in alive.skip_message
        instance.report_run_failed(run)
        context = dg.build_sensor_context(instance=instance, cursor=None)
        relaunch = sensor(context)
        assert isinstance(relaunch, dg.RunRequest)
        backoff = sensor(dg.build_sensor_context(instance=instance, cursor=context.cursor))
        assert isinstance(backoff, dg.SkipReason) and "relaunching in" in backoff.skip_message


async def test_cdc_job_streams_observes_and_stops_with_final_ack(dagster_env, cdc_database,
                                                                 pg_admin, nats_client):
    table = random_name("dag_cdc")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    cdc_database.add_tables(pg_admin, table)
    command = [str(Path(sys.executable).parent / "dagster"), "job", "execute",
               "-m", "cdc_platform.definitions", "-a", "defs", "-j", "cdc_job"]
    log = open(Path(dagster_env["DAGSTER_HOME"]) / "run.log", "wb")  # noqa: SIM115 - the run's output
    process = subprocess.Popen(command, env={**os.environ, **dagster_env}, cwd=REPO,
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while read_slot(pg_admin, cdc_database.slot) is None or \
                not read_slot(pg_admin, cdc_database.slot).active:
            assert time.monotonic() < deadline and process.poll() is None, \
                (Path(dagster_env["DAGSTER_HOME"]) / "run.log").read_text()[-3000:]
            await asyncio.sleep(0.2)
        pg_admin.execute(f"INSERT INTO {table} SELECT i, 'v' || i FROM generate_series(1, 500) i")
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=500)
        assert len(messages) == 500
        last_commit = parse_lsn(msgpack.unpackb(messages[-1].data)["commit_lsn"])
        await asyncio.sleep(2.5)  # at least one observation interval
    finally:
        process.send_signal(signal.SIGINT)  # what cancelling a run does to the run worker
        process.wait(60)
    state = read_slot(pg_admin, cdc_database.slot)
    assert not state.active
    assert state.confirmed_flush_lsn > last_commit  # the final ack covered the last change
    with dg.DagsterInstance.get() as instance:
        records = instance.fetch_observations(dg.AssetKey("cdc_stream"), limit=10).records
        assert records, "no cdc_stream observation recorded"
        metadata = records[0].asset_observation.metadata
        assert "confirmed_lsn" in metadata and "lag_bytes" in metadata
        assert parse_lsn(metadata["confirmed_lsn"].value) > 0



async def test_the_schemas_asset_puts_each_published_tables_schema(
        dagster_env, cdc_database, pg_admin, nats_client):
    from cdc_platform.defs.schemas.assets import schemas
    from cdc_platform.wire import decode_any

    table = random_name("dag_schema")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    cdc_database.add_tables(pg_admin, table)
    with dg.instance_for_test() as instance:
        result = await asyncio.to_thread(dg.materialize, [schemas], instance=instance,
                                         resources=dagster_resources())
    assert result.success
    event = result.get_asset_materialization_events()[0]
    fingerprints = event.step_materialization_data.materialization.metadata["tables"].value
    kv = await nats_client.jetstream().key_value("schemas")
    stored = decode_any((await kv.get(table)).value)
    assert stored["relation_id"] == pg_admin.execute(
        "SELECT %s::regclass::oid::int", (table,)).fetchone()[0]
    assert [column["name"] for column in stored["columns"]] == ["id", "v"]
    assert stored["fingerprint"] == fingerprints[table]

@pytest.mark.spark
async def test_init_snapshot_materialization_records_the_cutover(
        dagster_env, cdc_database, pg_admin, nats_client, spark_session, monkeypatch):
    from dagster_pyspark import LazyPySparkResource

    from cdc_platform.bridge.runner import CdcBridge
    from cdc_platform.defs.snapshots.assets import init_snapshot
    from cdc_platform.settings import load_settings
    from cdc_platform.snapshot.spark_session import default_spark_config

    monkeypatch.setenv("CDC_SNAPSHOT_LOCAL_MAX_BYTES", "0")  # through Spark, however small
    table = random_name("dag_snap")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT i, 'v' || i FROM generate_series(1, 2500) i")
    cdc_database.add_tables(pg_admin, table)
    bridge = CdcBridge(load_settings())  # the watermark marker needs a running bridge
    bridge_task = asyncio.create_task(bridge.run())
    try:
        deadline = time.monotonic() + 30
        while read_slot(pg_admin, cdc_database.slot) is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("published_tables", [table])
            spark_resource = LazyPySparkResource(
                spark_config=default_spark_config("local[2,2]"))
            result = await asyncio.to_thread(
                dg.materialize, [init_snapshot], partition_key=table, instance=instance,
                resources={**dagster_resources(), "pyspark": spark_resource})
            assert result.success
            event = result.get_asset_materialization_events()[0]
            metadata = {k: v.value for k, v in
                        event.step_materialization_data.materialization.metadata.items()}
    finally:
        bridge.request_stop()
        await asyncio.wait_for(bridge_task, 60)
    assert metadata["row_count"] == 2500
    assert metadata["batch_count"] >= 1
    assert not any(secret in repr(metadata) for secret in TEST_SECRETS)  # shown in the UI
    assert parse_lsn(metadata["lsn"]) > parse_lsn(metadata["watermark_lsn"])
    meta_messages = await read_subjects(nats_client, "INIT", f"init.meta.{table}", expect=1)
    meta = msgpack.unpackb(meta_messages[-1].data)
    assert meta["snapshot_id"] == metadata["snapshot_id"]
    assert meta["lsn"] == metadata["lsn"] and meta["row_count"] == 2500
    chunks = await read_subjects(nats_client, "INIT", f"init.snap.{table}.>",
                                 expect=metadata["batch_count"])
    assert sum(len(msgpack.unpackb(c.data)["data"]) for c in chunks) == 2500
    # the CDC start point is the watermark marker's stream sequence
    marker = await nats_client.jetstream().get_last_msg("CDC", metadata["watermark_subject"])
    assert metadata["cdc_start_seq"] == marker.seq


async def test_refused_requests_say_why_in_the_tick(dagster_env, nats_client):
    from cdc_platform.definitions import build_definitions

    defs = build_definitions()
    await nats_client.publish("snapshot.request.no_such_table", b"")
    await nats_client.flush()
    with dg.instance_for_test() as instance:
        evaluate = request_sensor_tick(defs, instance)

        result = await asyncio.to_thread(evaluate, None)
        assert result.run_requests == [] or result.run_requests is None
        assert "no_such_table" in result.skip_reason.skip_message
        assert "is not a table of publication" in result.skip_reason.skip_message


async def test_snapshot_requests_get_replies(dagster_env, cdc_database, pg_admin, nats_client):
    """accepted then done; refused with a reason; failed with a reason; and a request
    within the reuse window answered at once with the snapshot just taken."""
    import json as jsonlib

    from dagster_pyspark import LazyPySparkResource

    from cdc_platform.bridge.runner import CdcBridge
    from cdc_platform.definitions import build_definitions
    from cdc_platform.defs.snapshots.assets import REPLIES_TAG, init_snapshot
    from cdc_platform.settings import load_settings

    table, doomed = random_name("asked"), random_name("doomed")
    for name in (table, doomed):
        pg_admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY)")
        pg_admin.execute(f"INSERT INTO {name} SELECT generate_series(1, 100)")
    cdc_database.add_tables(pg_admin, table, doomed)
    inbox = f"_INBOX.replies.{random_name('r')}"
    replies: list[dict] = []

    async def collect(message):
        replies.append(jsonlib.loads(message.data))

    await nats_client.subscribe(inbox, cb=collect)

    async def ask(subject_table, **body):
        await nats_client.publish(f"snapshot.request.{subject_table}",
                                  jsonlib.dumps({"reply_to": inbox, **body}).encode())
        await nats_client.flush()

    async def wait_replies(count):
        deadline = time.monotonic() + 30
        while len(replies) < count:
            assert time.monotonic() < deadline, replies
            await asyncio.sleep(0.1)

    defs = build_definitions()
    bridge = CdcBridge(load_settings())  # the watermark marker: a cutover point to reuse
    bridge_task = asyncio.create_task(bridge.run())
    try:
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("published_tables", [table, doomed])

            evaluate = request_sensor_tick(defs, instance)

            def run(run_request):
                return dg.materialize([init_snapshot], partition_key=run_request.partition_key,
                                      instance=instance, tags=run_request.tags,
                                      resources={**dagster_resources(),
                                                 "pyspark": LazyPySparkResource(spark_config={})},
                                      raise_on_error=False)  # small: Spark never starts

            await ask(table, request_id="r1", max_age_seconds=0)
            await ask("no_such_table", request_id="r2")
            await ask(doomed, request_id="r3", max_age_seconds=0)
            await nats_client.publish(f"snapshot.request.{table}", b"\xff garbage")
            result = await asyncio.to_thread(evaluate, None)
            await wait_replies(3)
            by_id = {r["request_id"]: r for r in replies}
            assert by_id["r1"]["status"] == "accepted" and by_id["r3"]["status"] == "accepted"
            assert by_id["r2"]["status"] == "refused"
            assert "is not a table of publication" in by_id["r2"]["reason"]
            runs = {r.partition_key: r for r in result.run_requests}
            assert set(runs) == {table, doomed}
            assert jsonlib.loads(runs[table].tags[REPLIES_TAG]) == [["r1", inbox]]

            assert (await asyncio.to_thread(run, runs[table])).success
            pg_admin.execute(f"ALTER PUBLICATION {cdc_database.publication} "
                             f"DROP TABLE {doomed}")
            assert not (await asyncio.to_thread(run, runs[doomed])).success
            await wait_replies(5)
            done = [r for r in replies if r["status"] == "done"]
            failed = [r for r in replies if r["status"] == "failed"]
            assert [r["request_id"] for r in done] == ["r1"] and done[0]["reused"] is False
            assert done[0]["meta_subject"] == f"init.meta.{table}"
            assert done[0]["cdc_start_seq"] is not None
            assert [r["request_id"] for r in failed] == ["r3"]
            assert "not in publication" in failed[0]["reason"]

            # a hundred mirrors asking within minutes share one snapshot: no new run
            await ask(table, request_id="r4")
            again = await asyncio.to_thread(evaluate, result.cursor)
            await wait_replies(6)
            assert again.run_requests == []
            reused = replies[-1]
            assert reused["request_id"] == "r4" and reused["status"] == "done"
            assert reused["reused"] is True and reused["snapshot_id"] == done[0]["snapshot_id"]
    finally:
        bridge.request_stop()
        await asyncio.wait_for(bridge_task, 60)


async def test_a_verify_request_is_answered_by_a_table_verification_run(
        dagster_env, cdc_database, pg_admin, nats_client):
    """purpose verify: accepted, a verification_job run (one for two requests asking the same
    bits; one asking other bits is held back: CDC_VERIFY_MIN_INTERVAL), which materializes
    table_verification through the real Definitions and answers done with the digest's
    subject and seq."""
    import json as jsonlib

    from cdc_platform.bridge.runner import CdcBridge
    from cdc_platform.definitions import build_definitions
    from cdc_platform.defs.snapshots.assets import REPLIES_TAG
    from cdc_platform.settings import load_settings

    table = random_name("verify_asked")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT i, 'v' || i FROM generate_series(1, 300) i")
    cdc_database.add_tables(pg_admin, table)
    inbox = f"_INBOX.replies.{random_name('r')}"
    replies: list[dict] = []

    async def collect(message):
        replies.append(jsonlib.loads(message.data))

    await nats_client.subscribe(inbox, cb=collect)
    for request_id, body in (("v1", {"purpose": "verify", "bits": 2}),
                             ("v2", {"purpose": "verify", "bits": 2}),
                             ("v3", {"purpose": "verify"})):
        await nats_client.publish(f"snapshot.request.{table}", jsonlib.dumps(
            {"reply_to": inbox, "request_id": request_id, **body}).encode())
    await nats_client.flush()

    async def wait_replies(count):
        deadline = time.monotonic() + 30
        while len(replies) < count:
            assert time.monotonic() < deadline, replies
            await asyncio.sleep(0.1)

    defs = build_definitions()
    bridge = CdcBridge(load_settings())  # the digest waits for the bridge to store lsn
    bridge_task = asyncio.create_task(bridge.run())
    try:
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("published_tables", [table])
            result = await asyncio.to_thread(request_sensor_tick(defs, instance), None)
            await wait_replies(3)
            by_id = {r["request_id"]: r for r in replies}
            assert by_id["v1"]["status"] == by_id["v2"]["status"] == "accepted"
            [run] = result.run_requests
            assert run.job_name == "verification_job" and run.partition_key == table
            assert by_id["v3"]["status"] == "accepted" and by_id["v3"]["run_key"] != run.run_key
            assert by_id["v1"]["run_key"] == by_id["v2"]["run_key"] == run.run_key
            assert jsonlib.loads(run.tags[REPLIES_TAG]) == [["v1", inbox], ["v2", inbox]]

            job = defs.resolve_job_def("verification_job")
            outcome = await asyncio.to_thread(
                job.execute_in_process, instance=instance, partition_key=table,
                tags=run.tags)
            assert outcome.success
            [event] = outcome.get_asset_materialization_events()
            metadata = {k: v.value for k, v in
                        event.step_materialization_data.materialization.metadata.items()}
    finally:
        bridge.request_stop()
        await asyncio.wait_for(bridge_task, 60)
    await wait_replies(5)
    done = [r for r in replies if r["status"] == "done"]
    assert sorted(r["request_id"] for r in done) == ["v1", "v2"]
    assert metadata["bits"] == done[0]["bits"] == 2 and metadata["row_count"] == 300
    assert metadata["verification_id"] == done[0]["verification_id"]
    assert metadata["digest_seq"] == done[0]["digest_seq"] and metadata["rows_per_second"] > 0
    stored = await nats_client.jetstream().get_msg("CDC", done[0]["digest_seq"])
    assert stored.subject == done[0]["digest_subject"] == (
        f"cdc.cdc-platform.verify.{table}.{done[0]['verification_id']}")
    digest = msgpack.unpackb(stored.data)
    assert digest["lsn"] == done[0]["lsn"] == metadata["lsn"] and sum(digest["counts"]) == 300


async def test_repair_requests_are_answered_by_one_table_repair_run(
        dagster_env, cdc_database, pg_admin, nats_client):
    """purpose repair: two requests of one table (at 4 and 5 bits) share one repair_job run
    of the union of their buckets at 5 bits; one asking for more than a quarter of the
    buckets is refused, and so are two of another table that together do; the run
    materializes table_repair through the real Definitions and answers done naming its meta
    on init.repair.{table}, which holds exactly the rows of those buckets, loaded as a
    consumer loads them; init.meta.{table} gets nothing; a repair asked again within the
    minimum interval is refused with retry_after."""
    import json as jsonlib

    from nats.js.errors import NotFoundError

    from cdc_platform.bridge.runner import CdcBridge
    from cdc_platform.consumer.snapshots import repair_meta_at
    from cdc_platform.definitions import build_definitions
    from cdc_platform.defs.snapshots.assets import REPLIES_TAG
    from cdc_platform.defs.verification.repairs import REPAIR_BUCKETS_TAG
    from cdc_platform.mirror.snapshots import read_chunks
    from cdc_platform.settings import load_settings
    from cdc_platform.wire import encode_bucket_bitmap
    from cdc_platform.wire.digest import RowDigester, bucket_of

    table, other = random_name("repair_asked"), random_name("repair_many")
    for name in (table, other):
        pg_admin.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text)")
        pg_admin.execute(f"INSERT INTO {name} SELECT i, 'v' || i FROM generate_series(1, 600) i")
    cdc_database.add_tables(pg_admin, table, other)
    inbox = f"_INBOX.replies.{random_name('r')}"
    replies: list[dict] = []

    async def collect(message):
        replies.append(jsonlib.loads(message.data))

    await nats_client.subscribe(inbox, cb=collect)
    # u1 and u2: a quarter and an eighth of the other table; each may be asked, not both
    for name, request_id, body in ((table, "r1", {"bits": 4, "buckets": [2, 1]}),
                                   # (a bitmap: united with the lists alike)
                                   (table, "r2", {"bits": 5, "bucket_bitmap":
                                                  encode_bucket_bitmap(5, [7])}),
                                   (table, "all", {"bits": 2, "buckets": [0, 1]}),
                                   (other, "u1", {"bits": 2, "buckets": [0]}),
                                   (other, "u2", {"bits": 3, "buckets": [2]})):
        await nats_client.publish(f"snapshot.request.{name}", jsonlib.dumps(
            {"reply_to": inbox, "request_id": request_id, "purpose": "repair",
             **body}).encode())
    await nats_client.flush()

    async def wait_replies(count):
        deadline = time.monotonic() + 30
        while len(replies) < count:
            assert time.monotonic() < deadline, replies
            await asyncio.sleep(0.1)

    defs = build_definitions()
    bridge = CdcBridge(load_settings())  # the repair's watermark marker, as a snapshot's
    bridge_task = asyncio.create_task(bridge.run())
    try:
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("published_tables", [table, other])
            result = await asyncio.to_thread(request_sensor_tick(defs, instance), None)
            await wait_replies(5)
            by_id = {r["request_id"]: r for r in replies}
            assert by_id["all"]["status"] == "refused"
            assert by_id["all"]["reason"] == (
                "2 of 4 buckets is more than a quarter of the table: request a full snapshot")
            assert by_id["u1"]["status"] == by_id["u2"]["status"] == "refused"
            assert "add up to 3 of 8 buckets" in by_id["u2"]["reason"]
            assert by_id["r1"]["status"] == by_id["r2"]["status"] == "accepted"
            [run] = result.run_requests
            assert run.job_name == "repair_job" and run.partition_key == table
            assert by_id["r1"]["run_key"] == by_id["r2"]["run_key"] == run.run_key
            assert run.tags[REPAIR_BUCKETS_TAG] == "5:2-5,7"  # 1 and 2 at 4 bits, 7 at 5
            assert jsonlib.loads(run.tags[REPLIES_TAG]) == [["r1", inbox], ["r2", inbox]]

            job = defs.resolve_job_def("repair_job")
            outcome = await asyncio.to_thread(
                job.execute_in_process, instance=instance, partition_key=table,
                tags=run.tags)
            assert outcome.success
            [event] = outcome.get_asset_materialization_events()
            metadata = {k: v.value for k, v in
                        event.step_materialization_data.materialization.metadata.items()}
            await wait_replies(7)

            # the table was repaired just now: a repair run starts CDC_SNAPSHOT_MIN_INTERVAL
            # (60 s) after the last at the soonest
            await nats_client.publish(f"snapshot.request.{table}", jsonlib.dumps(
                {"reply_to": inbox, "request_id": "r3", "purpose": "repair", "bits": 4,
                 "buckets": [9]}).encode())
            await nats_client.flush()
            again = await asyncio.to_thread(request_sensor_tick(defs, instance),
                                            result.cursor)
            await wait_replies(8)
            assert again.run_requests == []
            assert (replies[7]["request_id"], replies[7]["status"]) == ("r3", "refused")
            assert "started less than 60s ago" in replies[7]["reason"]
            assert 0 < replies[7]["retry_after"] <= 60
    finally:
        bridge.request_stop()
        await asyncio.wait_for(bridge_task, 60)
    done = [r for r in replies if r["status"] == "done"]
    assert sorted(r["request_id"] for r in done) == ["r1", "r2"]
    assert done[0]["meta_subject"] == f"init.repair.{table}"
    assert done[0]["snapshot_id"].startswith("repair-")
    assert metadata["snapshot_id"] == done[0]["snapshot_id"]
    assert metadata["meta_seq"] == done[0]["meta_seq"] and metadata["buckets"] == "5:2-5,7"
    js = nats_client.jetstream()
    meta = await repair_meta_at(js, "INIT", done[0])
    assert (meta.bits, meta.buckets, meta.lsn) == (5, (2, 3, 4, 5, 7), parse_lsn(done[0]["lsn"]))
    digester = RowDigester(["id", "v"], ["id"])
    expected = sorted(i for i in range(1, 601)
                      if bucket_of(digester.key_hash({"id": i}), 5) in meta.buckets)
    loaded = [row["id"] async for chunk in read_chunks(js, meta) for row in chunk.rows]
    assert sorted(loaded) == expected and metadata["row_count"] == len(expected) > 0
    with pytest.raises(NotFoundError):
        await js.get_last_msg("INIT", f"init.meta.{table}")


async def test_a_flood_of_verify_requests_starts_one_verification_a_table_per_interval(
        dagster_env, nats_client, cdc_database, pg_admin, monkeypatch):
    """A table's verification runs started by requests begin CDC_VERIFY_MIN_INTERVAL apart:
    a request after the table's run needs one held back until then (joined by those asking
    the same; one asking other bits is refused until it started), whatever the requests
    ask."""
    import json as jsonlib

    from cdc_platform.definitions import build_definitions
    from cdc_platform.defs.snapshots.assets import REPLIES_TAG
    from cdc_platform.defs.verification.assets import BITS_TAG

    interval = 8.0
    monkeypatch.setenv("CDC_VERIFY_MIN_INTERVAL", str(interval))
    table = random_name("verify_flood")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    inbox = f"_INBOX.replies.{random_name('r')}"
    replies: dict[str, dict] = {}

    async def collect(message):
        reply = jsonlib.loads(message.data)
        replies[reply["request_id"]] = reply

    await nats_client.subscribe(inbox, cb=collect)

    async def ask(*requests):
        for request_id, body in requests:
            await nats_client.publish(f"snapshot.request.{table}", jsonlib.dumps(
                {"reply_to": inbox, "request_id": request_id, "purpose": "verify",
                 **body}).encode())
        await nats_client.flush()

    async def tick(cursor, *request_ids):
        result = await asyncio.to_thread(evaluate, cursor)
        deadline = time.monotonic() + 30
        while not all(request_id in replies for request_id in request_ids):
            assert time.monotonic() < deadline, replies
            await asyncio.sleep(0.05)
        return result

    defs = build_definitions()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("published_tables", [table])
        evaluate = request_sensor_tick(defs, instance)
        started = time.time()
        await ask(*[(f"a{n}", {"bits": 2}) for n in range(20)], ("b1", {}), ("c1", {"bits": 3}))
        first = await tick(None, "a19", "b1", "c1")
        (run,) = first.run_requests  # twenty of one kind: one run
        assert run.tags[BITS_TAG] == "2" and len(jsonlib.loads(run.tags[REPLIES_TAG])) == 20
        assert replies["b1"]["status"] == "accepted" and replies["b1"]["run_key"] != run.run_key
        assert replies["c1"]["status"] == "refused" and "held back" in replies["c1"]["reason"]

        await ask(("b2", {}))
        second = await tick(first.cursor, "b2")
        assert not second.run_requests
        assert replies["b2"]["run_key"] == replies["b1"]["run_key"]
        assert time.time() < started + interval  # (held: not due yet)
        await asyncio.sleep(started + interval + 0.5 - time.time())
        due = await tick(second.cursor)
        (released,) = due.run_requests
        assert released.run_key == replies["b1"]["run_key"] and BITS_TAG not in released.tags
        assert jsonlib.loads(released.tags[REPLIES_TAG]) == [["b1", inbox], ["b2", inbox]]


def _mirror_state(mirror_id: str, lag_seconds: float, verifications: dict, *,
                  status: str = "streaming", stopped_at: str | None = None) -> bytes:
    """A mirror's state value as `cdc-platform mirror` publishes it (wire MirrorStateValue),
    following the tables of ``verifications`` (table -> its last verification or None),
    each ``status``; ``stopped_at``: its last value, it stopped on purpose."""
    import json as jsonlib

    from cdc_platform.wire import MirrorStateValue, in_field_order

    stopped = {} if stopped_at is None else {"stopped_at": stopped_at}
    return jsonlib.dumps(in_field_order(MirrorStateValue, {
        "mirror_id": mirror_id, "host": "edge", "pid": 1, "version": "0",
        "started_at": "2026-11-26T05:00:00Z", "updated_at": "2026-11-26T05:00:30Z",
        "consistent_lsn": "0/2", "stream_last_lsn": "0/2", "lag_bytes": 0,
        "lag_seconds": lag_seconds, "tables": {
            table: {"status": status, "snapshot_id": "s", "cutover_lsn": "0/1",
                    "applied_lsn": "0/2", "last_verification": verification}
            for table, verification in verifications.items()}, **stopped})).encode()


@pytest.fixture
async def state_bucket(dagster_env, nats_client, monkeypatch):
    """A KV `mirrors` of the test's own (CDC_MIRROR_STATE_BUCKET), as provisioning makes it:
    ``put(mirror_id, value)``, ``delete(mirror_id)``."""
    from cdc_platform.jetstream.provision import (
        mirror_state_bucket_config,
        reader_written_bucket_stream,
    )
    from cdc_platform.settings import NatsTopology

    bucket = random_name("mirrors")
    monkeypatch.setenv("CDC_MIRROR_STATE_BUCKET", bucket)
    js = nats_client.jetstream()
    await js.add_stream(reader_written_bucket_stream(mirror_state_bucket_config(
        NatsTopology())))
    kv = await js.key_value(bucket)
    yield kv
    await js.delete_stream(f"KV_{bucket}")


async def test_mirror_fleet_sensor_shows_lagging_gone_and_unreadable_mirrors_red(
        dagster_env, state_bucket):
    """Through the real Definitions on a real instance: each tick records an observation of
    `mirror_fleet` (every mirror's lag and tables) and the evaluation of `mirrors_fresh`:
    green while every mirror is within CDC_MIRROR_LAG_CRITICAL, red (ERROR) when one falls
    behind, when one that reported is gone, when a value is not a state."""
    from cdc_platform.definitions import build_definitions

    defs = build_definitions()
    await state_bucket.put("team_a.edge1", _mirror_state(
        "team_a.edge1", 2.5, {"users": verified(verification_id="verify-1")}))
    await state_bucket.put("edge2", _mirror_state("edge2", 0.0, {"users": None}))
    with dg.instance_for_test() as instance:
        sensor = FleetSensor(defs, instance)

        async def tick():
            await sensor.tick()
            return sensor.freshness()

        def observations() -> int:
            return len(instance.fetch_observations(dg.AssetKey("mirror_fleet"),
                                                   limit=20).records)

        fresh = await tick()
        assert fresh.passed, fresh.description
        (record,) = instance.fetch_observations(dg.AssetKey("mirror_fleet"), limit=1).records
        observed = record.asset_observation.metadata
        assert observed["mirrors"].value == 2
        assert observed["max_lag_seconds"].value == 2.5
        fleet = observed["fleet"].value
        assert fleet["team_a.edge1"]["tables"]["users"]["last_verification"][
            "status"] == "equal"
        assert fleet["edge2"]["lag_seconds"] == 0.0

        await state_bucket.put("edge2", _mirror_state("edge2", 0.5, {"users": None}))
        assert (await tick()).passed and observations() == 1  # nothing new to show

        await state_bucket.put("edge2", _mirror_state("edge2", 301.0, {"users": None}))
        fresh = await tick()
        assert not fresh.passed and fresh.severity == dg.AssetCheckSeverity.ERROR
        assert fresh.metadata["lagging"].value == {"edge2": 301.0}

        await state_bucket.put("edge2", _mirror_state("edge2", 1.0, {"users": None}))
        assert (await tick()).passed
        await state_bucket.delete("team_a.edge1")  # (as its TTL does once it stops)
        fresh = await tick()
        assert not fresh.passed and fresh.metadata["gone"].value == ["team_a.edge1"]
        fresh = await tick()  # and stays so (until CDC_MIRROR_GONE_KEEP)
        assert not fresh.passed and fresh.metadata["gone"].value == ["team_a.edge1"]

        await state_bucket.put("team_a.edge1", b"not a state")
        fresh = await tick()
        assert not fresh.passed and fresh.metadata["gone"].value == []
        assert fresh.metadata["unreadable"].value == {"team_a.edge1": "not JSON"}
        assert observations() == 5  # (not the repeated "gone": it showed nothing new)


async def test_mirrors_equal_source_turns_red_when_a_mirror_differs_and_green_once_repaired(
        dagster_env, state_bucket):
    """The check of each `table_verification` partition, run by mirror_fleet_sensor (a run
    of mirrors_equal_source_job, the check alone selected) when the mirrors' verdict on the
    table's latest verification (its materialization's `verification_id`) changes: met
    `equal` or `repaired` by every mirror following it passes; `differ` fails (ERROR) with
    the buckets; a mirror that has not met it yet warns. Each new verdict is run once."""
    table = random_name("verified")
    with fleet_sensor_for(table) as sensor:
        instance = sensor.instance

        async def tick():
            return await sensor.tick(), sensor.equality(table)

        await state_bucket.put("edge1", _mirror_state("edge1", 1.0, {table: verified("equal")}))
        await state_bucket.put("edge2", _mirror_state("edge2", 1.0, {
            table: verified("differ", differing=3)}))
        runs, check = await tick()
        assert runs == 1
        assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
        assert check.metadata["buckets_differing"].value == 3
        assert check.metadata["mirrors"].value == {"edge1": "equal", "edge2": "differ"}
        assert (await tick())[0] == 0  # the same verdict: no second run

        await state_bucket.put("edge2", _mirror_state("edge2", 1.0, {
            table: verified("repaired", differing=3, repaired=25)}))
        runs, check = await tick()
        assert runs == 1 and check.passed and check.metadata["rows_repaired"].value == 25

        await state_bucket.put("edge3", _mirror_state("edge3", 1.0, {
            table: verified("equal", verification_id="verify-1")}))
        runs, check = await tick()
        assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
        assert check.metadata["pending"].value == ["edge3"]
        # a table no partition names (KV's table names come from readers) gets no run
        await state_bucket.put("edge4", _mirror_state("edge4", 1.0, {
            "not_a_partition": verified("differ")}))
        assert (await tick())[0] == 0
        # and no verification run materialized the table meanwhile
        assert len(instance.fetch_materializations(dg.AssetKey("table_verification"),
                                                   limit=10).records) == 1


async def test_mirrors_equal_source_passes_again_when_a_verdict_it_showed_before_returns(
        dagster_env, state_bucket):
    """pass -> warn -> pass under one verification: a mirror that was away reports its
    older verification (pending: WARN), then catches up through the stream and meets the
    table's latest one `equal`. The verdict is the first one again, and the check must show
    it again, not keep the WARN. (Ticks carry the sensor's cursor, as the daemon does.)"""
    table = random_name("returned")
    with fleet_sensor_for(table) as sensor:
        async def tick():
            return await sensor.tick(), sensor.equality(table)

        await state_bucket.put("edge1", _mirror_state("edge1", 1.0, {table: verified(
            "equal", "verify-2")}))
        runs, check = await tick()
        assert runs == 1 and check.passed, check.description
        await state_bucket.put("edge2", _mirror_state("edge2", 1.0, {table: verified(
            "equal", "verify-1")}))
        runs, check = await tick()
        assert runs == 1 and not check.passed
        assert check.severity == dg.AssetCheckSeverity.WARN
        assert (await tick())[0] == 0  # the same verdict: no second run
        await state_bucket.put("edge2", _mirror_state("edge2", 1.0, {table: verified(
            "equal", "verify-2")}))
        runs, check = await tick()
        assert runs == 1 and check.passed, check.description
        assert check.metadata["mirrors"].value == {"edge1": "equal", "edge2": "equal"}
        assert (await tick())[0] == 0


async def test_a_mirror_stopped_on_purpose_stays_listed_and_green_and_a_resyncing_one_warns(
        dagster_env, state_bucket):
    """`mirrors_fresh`: a mirror whose last state says it stopped (`--once`, SIGTERM) is
    listed as stopped, its lag not judged, and not gone once the TTL removed its state.
    `mirrors_equal_source`: a mirror resyncing after a lost slot warns, whatever it met
    before, until a verification finds it equal again."""
    from cdc_platform.definitions import build_definitions

    table = random_name("resynced")
    defs = build_definitions()
    equal = verified()
    await state_bucket.put("edge1", _mirror_state("edge1", 1.0, {table: equal}))
    await state_bucket.put("cron1", _mirror_state("cron1", 900.0, {table: equal},
                                                  stopped_at="2026-11-26T05:01:00Z"))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("published_tables", [table])
        record_verification(instance, table, "verify-2")
        sensor = FleetSensor(defs, instance)

        async def tick():
            await sensor.tick()
            return sensor.freshness(), sensor.equality(table)

        fresh, equality = await tick()
        assert fresh.passed, fresh.description
        assert fresh.metadata["stopped"].value == {"cron1": "2026-11-26T05:01:00Z"}
        assert fresh.metadata["lagging"].value == {} and equality.passed
        await state_bucket.delete("cron1")  # (as the TTL does)
        fresh, _ = await tick()
        assert fresh.passed and fresh.metadata["gone"].value == [], fresh.description
        (record,) = instance.fetch_observations(dg.AssetKey("mirror_fleet"), limit=1).records
        assert record.asset_observation.metadata["stopped"].value == {
            "cron1": "2026-11-26T05:01:00Z"}

        await state_bucket.put("edge1", _mirror_state("edge1", 1.0, {table: equal},
                                                      status="resyncing"))
        _, equality = await tick()
        assert not equality.passed and equality.severity == dg.AssetCheckSeverity.WARN
        assert equality.metadata["resyncing"].value == ["edge1"]
        # the next verification (the one the resync sensor starts) met equal ends it
        record_verification(instance, table, "verify-3")
        await state_bucket.put("edge1", _mirror_state("edge1", 1.0, {
            table: {**equal, "verification_id": "verify-3"}}))
        _, equality = await tick()
        assert equality.passed, equality.description
