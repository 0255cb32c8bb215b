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
flood of requests starts at most one run per table (docs/wire-contract.md "Snapshots"). Unknown or
unpublished tables are skipped with a reason. A table's runs started by requests begin at
least ``CDC_SNAPSHOT_MIN_INTERVAL`` apart: a request that needs a new run sooner joins a run
the sensor holds back in its cursor until then (``max_age_seconds: 0`` cannot make it
snapshot a table back to back). Requests with ``purpose: verify`` become `table_verification`
runs (``verification_job``), one per table, bits and buckets, joining such a run while it is
queued; their runs answer the requesters as snapshot runs do. Requests with ``purpose:
repair`` become one `table_repair` run (``repair_job``) per table and tick, of the union of
their buckets, at least ``CDC_SNAPSHOT_MIN_INTERVAL`` apart (sooner: refused with
``retry_after``).
"""

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from cdc_platform.defs.resources import NatsRepliesResource, NatsResource, PostgresResource
from cdc_platform.defs.snapshots.assets import REPLIES_TAG
from cdc_platform.defs.snapshots.partitions import PUBLISHED_TABLES, published_tables_partitions
from cdc_platform.defs.verification.assets import BITS_TAG, BUCKETS_TAG
from cdc_platform.defs.verification.repairs import REPAIR_BUCKETS_TAG
from cdc_platform.jetstream.provision import REQUESTS_DURABLE
from cdc_platform.naming import wire_name
from cdc_platform.postgres.catalog import published_relation_ids, published_tables
from cdc_platform.settings import NatsTopology, OrchestrationSettings, load_settings
from cdc_platform.snapshot.buckets import BucketSelection
from cdc_platform.snapshot.requests import (
    MAX_REPLIES_PER_RUN,
    HandledRequests,
    HeldRun,
    Pacing,
    RunInFlight,
    VerificationKey,
    answer_requests,
    fetch_requests,
    repair_run_key,
    request_run_key,
    verification_run_key,
)
from cdc_platform.wire import SignatureVerifier

PARTITION_TAG = "dagster/partition"
RUN_KEY_TAG = "dagster/run_key"
REQUEST_SEQ_TAG = "cdc_platform/request_seq"  # on snapshot runs started by requests
VERIFY_REQUEST_SEQ_TAG = "cdc_platform/verify_request_seq"  # ... on verification runs

FETCH_LIMIT = 500


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
    return _in_flight_by(instance, job_name, lambda tags, table: table)


def _verifications_in_flight(instance: dg.DagsterInstance,
                             job_name: str) -> dict[VerificationKey, RunInFlight]:
    """(table, bits, buckets) -> its verification run already queued or running."""
    return _in_flight_by(instance, job_name, lambda tags, table: (
        table, int(tags[BITS_TAG]) if BITS_TAG in tags else None,
        tuple(json.loads(tags[BUCKETS_TAG])) if BUCKETS_TAG in tags else None))


def _in_flight_by(instance: dg.DagsterInstance, job_name: str,
                  key: Callable[[Mapping[str, str], str], Any]) -> dict:
    """``key(run tags, table)`` -> the run of ``job_name`` queued or running for it (a
    queued one when there are both: it answers every request)."""
    in_flight: dict = {}
    for run in instance.get_runs(filters=dg.RunsFilter(job_name=job_name, statuses=_IN_FLIGHT)):
        table = run.tags.get(PARTITION_TAG)
        if table is None:
            continue
        candidate = RunInFlight(table, run.tags.get(RUN_KEY_TAG) or run.run_id,
                                run.status in _STARTED)
        run_key = key(run.tags, table)
        if run_key not in in_flight or in_flight[run_key].started:
            in_flight[run_key] = candidate
    return in_flight


def _pacing(instance: dg.DagsterInstance, seq_tag: str, interval: float,
            held: dict[str, HeldRun]) -> Pacing:
    """The minimum interval between a table's runs started by requests (tagged ``seq_tag``)."""
    return Pacing(interval, _request_runs_since(instance, seq_tag, time.time() - interval)
                  if interval else {}, held)


def _request_runs_since(instance: dg.DagsterInstance, seq_tag: str,
                        since: float) -> dict[str, float]:
    """Table -> when its newest run started by requests (tagged ``seq_tag`` with the
    request's sequence) was created, of the runs created after ``since``."""
    created: dict[str, float] = {}
    for record in instance.get_run_records(dg.RunsFilter(
            created_after=datetime.fromtimestamp(since, UTC))):
        table = record.dagster_run.tags.get(PARTITION_TAG)
        if table is not None and seq_tag in record.dagster_run.tags:
            created[table] = max(created.get(table, 0.0), record.create_timestamp.timestamp())
    return created


def _runs_of_job_since(instance: dg.DagsterInstance, job_name: str,
                       since: float) -> dict[str, float]:
    """Table -> when its newest run of ``job_name`` was created, of those created after
    ``since``."""
    created: dict[str, float] = {}
    for record in instance.get_run_records(dg.RunsFilter(
            job_name=job_name, created_after=datetime.fromtimestamp(since, UTC))):
        table = record.dagster_run.tags.get(PARTITION_TAG)
        if table is not None:
            created[table] = max(created.get(table, 0.0), record.create_timestamp.timestamp())
    return created


@dataclass
class _Cursor:
    """The sensor's cursor: the highest stream sequence handled (its RunRequests recorded),
    and the snapshot and verification runs held back by their minimum intervals (JSON; a
    bare number before them)."""

    recorded_through: int = 0
    held: dict[str, HeldRun] = field(default_factory=dict)
    held_verifications: dict[str, HeldRun] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str | None) -> "_Cursor":
        if not text:
            return cls()
        if text.isdigit():
            return cls(int(text))
        value = json.loads(text)
        return cls(value["through"], *({table: HeldRun(*held) for table, held in
                                        value.get(name, {}).items()}
                                       for name in ("held", "held_verifications")))

    def dump(self) -> str:
        return json.dumps({"through": self.recorded_through, "held": {
            table: [held.seq, held.requesters, held.not_before]
            for table, held in self.held.items()}, "held_verifications": {
            table: [held.seq, held.requesters, held.not_before, held.bits, held.buckets]
            for table, held in self.held_verifications.items()}})


def build_snapshot_request_sensor(snapshot_job, verification_job,
                                  repair_job) -> dg.SensorDefinition:
    @dg.sensor(jobs=[snapshot_job, verification_job, repair_job], minimum_interval_seconds=2,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="`snapshot.request.{table}` messages -> `init_snapshot` runs "
               "(`table_verification` runs for purpose verify, `table_repair` runs for "
               "purpose repair), with replies (accepted, refused, done, failed) to requests "
               "that ask for them.")
    def snapshot_request_sensor(context: dg.SensorEvaluationContext, nats: NatsResource,
                                nats_replies: NatsRepliesResource,
                                postgres: PostgresResource):
        cursor = _Cursor.parse(context.cursor)
        settings = load_settings(OrchestrationSettings)
        pacing = _pacing(context.instance, REQUEST_SEQ_TAG,
                         settings.snapshot_min_interval_seconds, cursor.held)
        pacing.repairs_started = _runs_of_job_since(
            context.instance, repair_job.name, time.time() - pacing.min_interval
        ) if pacing.min_interval else {}
        verify_pacing = _pacing(context.instance, VERIFY_REQUEST_SEQ_TAG,
                                settings.verify_min_interval_seconds,
                                cursor.held_verifications)
        outcome = asyncio.run(_handle_requests(
            nats, nats_replies, cursor.recorded_through, _published_relation_ids(postgres),
            postgres.settings().publication, settings.snapshot_reuse_seconds,
            _runs_in_flight(context.instance, snapshot_job.name), pacing,
            settings.snapshot_verifier(),
            _verifications_in_flight(context.instance, verification_job.name), verify_pacing))
        runs = dict(outcome.runs) if outcome else {}
        verifications = dict(outcome.verifications) if outcome else {}
        repairs = outcome.repairs if outcome else {}
        notes = list(outcome.notes) if outcome else []
        now = time.time()
        for table in [table for table, held in pacing.held.items() if held.not_before <= now]:
            held = pacing.held.pop(table)
            runs[table] = (held.seq, held.requesters)
            notes.append(f"snapshot run for {table!r} (request seq {held.seq}, "
                         f"{len(held.requesters)} awaiting a reply), held back until now")
        for table in [table for table, held in verify_pacing.held.items()
                      if held.not_before <= now]:
            held = verify_pacing.held.pop(table)
            verifications[table, held.bits, held.buckets] = (held.seq, held.requesters)
            notes.append(f"verification run for {table!r} (request seq {held.seq}, "
                         f"{len(held.requesters)} awaiting a reply), held back until now")
        if outcome is None and not runs and not verifications:
            held_count = len(pacing.held) + len(verify_pacing.held)
            return dg.SkipReason("no new snapshot requests" + (
                f"; {held_count} run(s) held back" if held_count else ""))
        cursor = _Cursor(outcome.highest_seq if outcome else cursor.recorded_through,
                         pacing.held, verify_pacing.held)
        for note in notes:
            context.log.info(note)
        if not runs and not verifications and not repairs:  # say why in the tick itself
            return dg.SensorResult(cursor=cursor.dump(), skip_reason="; ".join(notes)[:1000])
        known = set(context.instance.get_dynamic_partitions(PUBLISHED_TABLES))
        new_partitions = sorted(
            (set(runs) | {key[0] for key in verifications} | set(repairs)) - known)
        return dg.SensorResult(
            run_requests=[dg.RunRequest(
                run_key=request_run_key(table, seq), partition_key=table,
                job_name=snapshot_job.name,
                tags={REQUEST_SEQ_TAG: str(seq),
                      REPLIES_TAG: json.dumps(requesters[:MAX_REPLIES_PER_RUN])})
                for table, (seq, requesters) in runs.items()] + [
                _verification_run(verification_job.name, key, seq, requesters)
                for key, (seq, requesters) in verifications.items()] + [
                _repair_run(repair_job.name, table, seq, requesters, selection)
                for table, (seq, requesters, selection) in repairs.items()],
            cursor=cursor.dump(),
            dynamic_partitions_requests=[
                published_tables_partitions.build_add_request(new_partitions)]
            if new_partitions else [])

    return snapshot_request_sensor


def _verification_run(job_name: str, key: VerificationKey, seq: int,
                      requesters: list) -> dg.RunRequest:
    """A verification run for verify requests."""
    table, bits, buckets = key
    tags = {VERIFY_REQUEST_SEQ_TAG: str(seq),
            REPLIES_TAG: json.dumps(requesters[:MAX_REPLIES_PER_RUN])}
    if bits is not None:
        tags[BITS_TAG] = str(bits)
    if buckets is not None:
        tags[BUCKETS_TAG] = json.dumps(list(buckets))
    return dg.RunRequest(run_key=verification_run_key(table, seq), partition_key=table,
                         job_name=job_name, tags=tags)


def _repair_run(job_name: str, table: str, seq: int, requesters: list,
                selection: BucketSelection) -> dg.RunRequest:
    """A repair run for a table's repair requests of this tick (not tagged with
    REQUEST_SEQ_TAG: only snapshot runs count for the snapshot pacing)."""
    return dg.RunRequest(run_key=repair_run_key(table, seq), partition_key=table,
                         job_name=job_name, tags={
                             REPLIES_TAG: json.dumps(requesters[:MAX_REPLIES_PER_RUN]),
                             REPAIR_BUCKETS_TAG: selection.to_text()})


async def _handle_requests(nats: NatsResource, nats_replies: NatsRepliesResource,
                           recorded_through: int,
                           published: dict[str, int],
                           publication: str, reuse_seconds: float,
                           in_flight: dict[str, RunInFlight],
                           pacing: Pacing,
                           verifier: SignatureVerifier | None,
                           verifying: dict[VerificationKey, RunInFlight],
                           verify_pacing: Pacing) -> HandledRequests | None:
    """What the new requests decided (None: nothing new); see ``answer_requests``."""
    topology = load_settings(NatsTopology)
    async with nats.connect("cdc-platform-snapshot-sensor", as_sensor=True) as client:
        requests = await fetch_requests(client, topology.requests.name, REQUESTS_DURABLE,
                                        recorded_through, FETCH_LIMIT)
        if not requests:
            return None
        async with nats_replies.connect(client) as reply_client:
            return await answer_requests(client, requests, published=published,
                                         publication=publication, reuse_seconds=reuse_seconds,
                                         in_flight=in_flight, init_stream=topology.init.name,
                                         reply_client=reply_client, pacing=pacing,
                                         verifier=verifier, verifying=verifying,
                                         verify_pacing=verify_pacing)
