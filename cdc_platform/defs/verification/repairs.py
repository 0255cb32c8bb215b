"""`table_repair`, partitioned by table: a repair snapshot of some buckets of one table, for
mirrors whose verification found them differing (docs/verification.md Part 2, item 4). Runs
are started by `snapshot_request_sensor` from `purpose: repair` requests only; the buckets
come in a run tag."""

import json

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from cdc_platform.defs.resources import (
    CdcResource,
    NatsRepliesResource,
    NatsResource,
    PostgresResource,
)
from cdc_platform.defs.snapshots.assets import REPLIES_TAG, SNAPSHOT_KIND_TAG, answer_requesters
from cdc_platform.defs.snapshots.partitions import published_tables_partitions
from cdc_platform.settings import OrchestrationSettings, load_settings
from cdc_platform.snapshot.buckets import BucketSelection
from cdc_platform.snapshot.requests import Reply, done_fields
from cdc_platform.snapshot.spark_session import prepare_spark_environment

# the buckets a repair run reads, as BucketSelection.to_text writes them (``10:3-5,9``)
REPAIR_BUCKETS_TAG = "cdc_platform/repair_buckets"


@dg.asset(
    group_name="verification",
    partitions_def=published_tables_partitions,
    kinds={"spark", "nats", "postgres"},
    op_tags={SNAPSHOT_KIND_TAG: "repair"},
    deps=["init_snapshot"],
)
def table_repair(context: dg.AssetExecutionContext, postgres: PostgresResource,
                 nats: NatsResource, nats_replies: NatsRepliesResource, cdc: CdcResource,
                 pyspark: LazyPySparkResource) -> dg.MaterializeResult:
    """The rows of some buckets of the table (the union of the repair requests of one sensor
    tick) as a snapshot: chunks on `init.snap.{table}.repair-...`, its meta on
    `init.repair.{table}` (never `init.meta.{table}`); same cutover rule as a full
    snapshot."""
    from cdc_platform.snapshot.job import SnapshotOptions, run_snapshot

    table = context.partition_key
    tags = context.run.tags
    requesters = json.loads(tags.get(REPLIES_TAG, "[]"))
    settings = cdc.platform_settings(postgres, nats)
    options = SnapshotOptions(
        small_table_bytes=load_settings(OrchestrationSettings).snapshot_local_max_bytes)

    def spark_session():  # started only for a table too large to read here
        prepare_spark_environment()
        return pyspark.spark_session

    try:
        if REPAIR_BUCKETS_TAG not in tags:
            raise dg.Failure(f"a repair run needs its buckets in the {REPAIR_BUCKETS_TAG} tag "
                             "(snapshot_request_sensor sets it from repair requests)")
        selection = BucketSelection.from_text(tags[REPAIR_BUCKETS_TAG])
        result = run_snapshot(spark_session, settings, table, options=options,
                              buckets=(selection.bits, selection.buckets))
    except Exception as exc:
        answer_requesters(nats_replies, requesters, Reply("failed", table, fields={
            "reason": str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
            "run_id": context.run.run_id}))
        raise
    answer_requesters(nats_replies, requesters, Reply("done", table, fields=done_fields(result)))
    context.log.info(f"repair snapshot {result.snapshot_id} of {table}: "
                     f"{len(selection.buckets)} of {1 << selection.bits} buckets, "
                     f"{result.row_count} rows in {result.batch_count} chunks, cutover at LSN "
                     f"{result.lsn}")
    return dg.MaterializeResult(metadata={
        "snapshot_id": result.snapshot_id,
        "lsn": result.lsn,
        "bits": dg.MetadataValue.int(selection.bits),
        "buckets": selection.to_text(),
        "meta_subject": result.meta_subject,
        "meta_seq": dg.MetadataValue.int(result.meta_seq),
        "cdc_start_seq": dg.MetadataValue.int(result.cdc_start_seq)
        if result.cdc_start_seq is not None else dg.MetadataValue.null(),
        "row_count": dg.MetadataValue.int(result.row_count),
        "batch_count": dg.MetadataValue.int(result.batch_count),
        "bytes_compressed": dg.MetadataValue.int(result.bytes_compressed),
        "duration_seconds": dg.MetadataValue.float(result.duration_seconds),
    })
