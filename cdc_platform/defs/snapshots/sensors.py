"""Sensors of the snapshot side.

* `publication_sync_sensor`: dynamic partitions = the publication's tables, so tables
  added to or dropped from the publication appear/disappear without a redeploy.
* `snapshot_request_sensor`: turns `snapshot.request.{table}` messages (kept by the
  SNAPSHOT_REQUESTS stream) into `init_snapshot` runs. It reads with a durable JetStream
  consumer and acks a message only on the tick AFTER the one that returned its RunRequest:
  Dagster records the run requests of a tick after the sensor returns, and the cursor (the
  highest stream sequence handled) says what was recorded. Repeated requests for one table
  in one tick become one run, and a request for a table whose snapshot run is already queued
or running joins that run (``accepted`` with ``coalesced``) instead of starting another, so a
flood of requests starts at most one run per table (README "Snapshots"). Unknown or
unpublished tables are skipped with a reason.
"""

import asyncio
import json

import dagster as dg

from cdc_platform.defs.resources import NatsResource, PostgresResource
from cdc_platform.defs.snapshots.assets import REPLIES_TAG
from cdc_platform.defs.snapshots.partitions import PUBLISHED_TABLES, published_tables_partitions
from cdc_platform.naming import wire_name
from cdc_platform.postgres.catalog import published_relation_ids, published_tables
from cdc_platform.settings import (
    BridgeSettings,
    NatsTopology,
    OrchestrationSettings,
    load_settings,
)
from cdc_platform.snapshot.requests import (
    HandledRequests,
    RunInFlight,
    answer_requests,
    fetch_requests,
    request_run_key,
)
from cdc_platform.wire import SignatureVerifier

PARTITION_TAG = "dagster/partition"
RUN_KEY_TAG = "dagster/run_key"

DURABLE = "cdc_platform_snapshot_requests"
FETCH_LIMIT = 500
# a run's tag holds at most this many reply subjects (a tag value is kept short); more
# requesters of one table get "accepted" and find the result in init.meta.{table}
MAX_REPLIES_PER_RUN = 20


def _published_relation_ids(postgres: PostgresResource) -> dict[str, int]:
    with postgres.connect() as conn:
        return published_relation_ids(conn, postgres.settings().publication)


def _published_wire_names(postgres: PostgresResource) -> list[str]:
    with postgres.connect() as conn:
        return [wire_name(schema, table)
                for schema, table in published_tables(conn, postgres.settings().publication)]


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Keeps init_snapshot's partitions equal to the publication's tables.")
def publication_sync_sensor(context: dg.SensorEvaluationContext,
                            postgres: PostgresResource) -> dg.SensorResult | dg.SkipReason:
    wanted = set(_published_wire_names(postgres))
    existing = set(context.instance.get_dynamic_partitions(PUBLISHED_TABLES))
    added, removed = sorted(wanted - existing), sorted(existing - wanted)
    if not added and not removed:
        return dg.SkipReason(f"partitions match the publication ({len(wanted)} tables)")
    requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest] = []
    if added:
        requests.append(published_tables_partitions.build_add_request(added))
    if removed:
        requests.append(published_tables_partitions.build_delete_request(removed))
    context.log.info(f"partitions: added {added}, removed {removed}")
    return dg.SensorResult(dynamic_partitions_requests=requests)


_IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
              dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]
_STARTED = {dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED}


def _runs_in_flight(instance: dg.DagsterInstance, job_name: str) -> dict[str, RunInFlight]:
    """Table -> its snapshot run already queued or running (a queued one when there are
    both: it answers every request)."""
    in_flight: dict[str, RunInFlight] = {}
    for run in instance.get_runs(filters=dg.RunsFilter(job_name=job_name, statuses=_IN_FLIGHT)):
        table = run.tags.get(PARTITION_TAG)
        if table is None:
            continue
        candidate = RunInFlight(table, run.tags.get(RUN_KEY_TAG) or run.run_id,
                                run.status in _STARTED)
        if table not in in_flight or in_flight[table].started:
            in_flight[table] = candidate
    return in_flight


def build_snapshot_request_sensor(snapshot_job) -> dg.SensorDefinition:
    @dg.sensor(job=snapshot_job, minimum_interval_seconds=2,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="`snapshot.request.{table}` messages -> `init_snapshot` runs, "
               "with replies (accepted, refused, done, failed) to requests that ask for them.")
    def snapshot_request_sensor(context: dg.SensorEvaluationContext, nats: NatsResource,
                                postgres: PostgresResource):
        recorded_through = int(context.cursor) if context.cursor else 0
        reuse_seconds = load_settings(OrchestrationSettings).snapshot_reuse_seconds
        outcome = asyncio.run(_handle_requests(
            nats, recorded_through, _published_relation_ids(postgres),
            postgres.settings().publication, reuse_seconds,
            _runs_in_flight(context.instance, snapshot_job.name)))
        if outcome is None:
            return dg.SkipReason("no new snapshot requests")
        highest, runs, notes = outcome.highest_seq, outcome.runs, outcome.notes
        for note in notes:
            context.log.info(note)
        if not runs:  # say why in the tick itself, not only in its logs
            return dg.SensorResult(cursor=str(highest), skip_reason="; ".join(notes)[:1000])
        known = set(context.instance.get_dynamic_partitions(PUBLISHED_TABLES))
        new_partitions = sorted(set(runs) - known)
        return dg.SensorResult(
            run_requests=[dg.RunRequest(
                run_key=request_run_key(table, seq), partition_key=table,
                tags={"cdc_platform/request_seq": str(seq),
                      REPLIES_TAG: json.dumps(requesters[:MAX_REPLIES_PER_RUN])})
                for table, (seq, requesters) in runs.items()],
            cursor=str(highest),
            dynamic_partitions_requests=[
                published_tables_partitions.build_add_request(new_partitions)]
            if new_partitions else [])

    return snapshot_request_sensor


async def _handle_requests(nats: NatsResource, recorded_through: int,
                           published: dict[str, int],
                           publication: str, reuse_seconds: float,
                           in_flight: dict[str, RunInFlight]) -> HandledRequests | None:
    """What the new requests decided (None: nothing new); see ``answer_requests``."""
    topology = load_settings(NatsTopology)
    signer = load_settings(BridgeSettings).signer()  # (its own snapshots' key)
    verifier = SignatureVerifier([signer.public_key]) if signer is not None else None
    async with nats.connect("cdc-platform-snapshot-sensor") as client:
        requests = await fetch_requests(client, topology.requests.name, DURABLE,
                                        recorded_through, FETCH_LIMIT)
        if not requests:
            return None
        return await answer_requests(client, requests, published=published,
                                     publication=publication, reuse_seconds=reuse_seconds,
                                     in_flight=in_flight, init_stream=topology.init.name,
                                     verifier=verifier)
