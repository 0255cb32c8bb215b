"""Sensors of the snapshot side.

* `publication_sync_sensor`: dynamic partitions = the publication's tables, so tables
  added to or dropped from the publication appear/disappear without a redeploy.
* `snapshot_request_sensor`: turns `snapshot.request.{table}` messages (kept by the
  SNAPSHOT_REQUESTS stream) into `init_snapshot` runs. It reads with a durable JetStream
  consumer and acks a message only on the tick AFTER the one that returned its RunRequest:
  Dagster records the run requests of a tick after the sensor returns, and the cursor (the
  highest stream sequence handled) says what was recorded. Repeated requests for one table
  in one tick become one run; unknown or unpublished tables are skipped with a reason.
"""

import asyncio

import dagster as dg
from nats.js.api import AckPolicy, ConsumerConfig

from cdc_platform.defs.resources import NatsResource, PostgresResource
from cdc_platform.defs.snapshots.partitions import published_tables_partitions
from cdc_platform.jetstream.connection import fetch_available
from cdc_platform.naming import wire_name
from cdc_platform.postgres.catalog import published_tables
from cdc_platform.settings import NatsTopology, load_settings
from cdc_platform.wire import SNAPSHOT_REQUEST_PREFIX

DURABLE = "cdc_platform_snapshot_requests"
FETCH_LIMIT = 500


def _published_wire_names(postgres: PostgresResource) -> list[str]:
    with postgres.connect() as conn:
        return [wire_name(schema, table)
                for schema, table in published_tables(conn, postgres.settings().publication)]


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Keeps init_snapshot's partitions equal to the publication's tables.")
def publication_sync_sensor(context: dg.SensorEvaluationContext,
                            postgres: PostgresResource) -> dg.SensorResult | dg.SkipReason:
    wanted = set(_published_wire_names(postgres))
    existing = set(context.instance.get_dynamic_partitions(published_tables_partitions.name))
    added, removed = sorted(wanted - existing), sorted(existing - wanted)
    if not added and not removed:
        return dg.SkipReason(f"partitions match the publication ({len(wanted)} tables)")
    requests = []
    if added:
        requests.append(published_tables_partitions.build_add_request(added))
    if removed:
        requests.append(published_tables_partitions.build_delete_request(removed))
    context.log.info(f"partitions: added {added}, removed {removed}")
    return dg.SensorResult(dynamic_partitions_requests=requests)


def build_snapshot_request_sensor(snapshot_job) -> dg.SensorDefinition:
    @dg.sensor(job=snapshot_job, minimum_interval_seconds=5,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="snapshot.request.{table} messages -> init_snapshot runs.")
    def snapshot_request_sensor(context: dg.SensorEvaluationContext, nats: NatsResource,
                                postgres: PostgresResource):
        recorded_through = int(context.cursor) if context.cursor else 0
        requests = asyncio.run(_fetch_requests(nats, recorded_through))
        if not requests:
            return dg.SkipReason("no new snapshot requests")
        published = set(_published_wire_names(postgres))
        known = set(context.instance.get_dynamic_partitions(published_tables_partitions.name))
        highest = max(seq for seq, _ in requests)
        by_table: dict[str, int] = {}
        refused: list[str] = []
        for seq, table in requests:
            if table not in published:
                refused.append(f"{table!r} (stream seq {seq})")
                context.log.warning(
                    f"skipping snapshot request for {table!r} (stream seq {seq}): not a table "
                    f"of publication {postgres.settings().publication}")
                continue
            by_table[table] = seq  # repeated requests for one table coalesce into one run
        if not by_table:  # say why in the tick itself, not only in its logs
            return dg.SensorResult(
                cursor=str(highest),
                skip_reason=f"refused snapshot request(s) for {', '.join(refused)}: not tables "
                            f"of publication {postgres.settings().publication}")
        run_requests = [dg.RunRequest(run_key=f"snapshot-request-{table}-{seq}",
                                      partition_key=table,
                                      tags={"cdc_platform/request_seq": str(seq)})
                        for table, seq in by_table.items()]
        new_partitions = sorted(set(by_table) - known)
        context.log.info(f"{len(requests)} request(s) up to stream seq {highest}: runs for "
                         f"{sorted(by_table)}")
        return dg.SensorResult(
            run_requests=run_requests, cursor=str(highest),
            dynamic_partitions_requests=[
                published_tables_partitions.build_add_request(new_partitions)]
            if new_partitions else [])

    return snapshot_request_sensor


async def _fetch_requests(nats: NatsResource, recorded_through: int) -> list[tuple[int, str]]:
    """New requests as (stream seq, table); acks those a previous tick already recorded."""
    topology = load_settings(NatsTopology)
    async with nats.connect("cdc-platform-snapshot-sensor") as client:
        js = client.jetstream()
        subscription = await js.pull_subscribe(
            f"{SNAPSHOT_REQUEST_PREFIX}.>", durable=DURABLE, stream=topology.requests.name,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=60,
                                  max_ack_pending=FETCH_LIMIT * 4))
        messages = await fetch_available(subscription, FETCH_LIMIT, 1.0)
        fresh = []
        for message in messages:
            seq = message.metadata.sequence.stream
            if seq <= recorded_through:
                await message.ack()  # its RunRequest was recorded: done with it
                continue
            table = message.subject[len(SNAPSHOT_REQUEST_PREFIX) + 1:]
            fresh.append((seq, table))
            # not acked now: redelivered after ack_wait, and acked on the tick that sees
            # the cursor past it. A crash before the cursor is saved loses nothing.
            await message.in_progress()
        return fresh

