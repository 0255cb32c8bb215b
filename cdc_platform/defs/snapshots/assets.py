"""`init_snapshot`, partitioned by table: a Spark snapshot into the INIT stream."""

import asyncio
import json

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from cdc_platform.defs.resources import (
    CdcResource,
    NatsRepliesResource,
    NatsResource,
    PostgresResource,
)
from cdc_platform.defs.snapshots.partitions import published_tables_partitions
from cdc_platform.settings import OrchestrationSettings, load_settings
from cdc_platform.snapshot.requests import Reply, done_fields, send_replies
from cdc_platform.snapshot.spark_session import prepare_spark_environment

SNAPSHOT_KIND_TAG = "cdc_platform/kind"
# JSON list of [request_id, reply_to] of the requests a run serves (snapshot_request_sensor)
REPLIES_TAG = "cdc_platform/replies"


@dg.asset(
    group_name="snapshots",
    partitions_def=published_tables_partitions,
    kinds={"spark", "nats", "postgres"},
    op_tags={SNAPSHOT_KIND_TAG: "snapshot"},
    deps=["schemas"],
)
def init_snapshot(context: dg.AssetExecutionContext, postgres: PostgresResource,
                  nats: NatsResource, nats_replies: NatsRepliesResource, cdc: CdcResource,
                  pyspark: LazyPySparkResource) -> dg.MaterializeResult:
    """A consistent snapshot of one published table, chunked into `init.snap.{table}.*`,
    then `init.meta.{table}`. The metadata holds the cutover point: apply CDC events with
    `commit_lsn >= lsn`, reading the CDC stream from `cdc_start_seq`."""
    from cdc_platform.snapshot.job import SnapshotOptions, run_snapshot

    table = context.partition_key
    settings = cdc.platform_settings(postgres, nats)
    options = SnapshotOptions(
        small_table_bytes=load_settings(OrchestrationSettings).snapshot_local_max_bytes)
    requesters = json.loads(context.run.tags.get(REPLIES_TAG, "[]"))

    def spark_session():  # started only for a table too large to read here
        prepare_spark_environment()
        return pyspark.spark_session

    try:
        result = run_snapshot(spark_session, settings, table, options=options)
    except Exception as exc:
        answer_requesters(nats_replies, requesters, Reply("failed", table, fields={
            "reason": str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
            "run_id": context.run.run_id}))
        raise
    answer_requesters(nats_replies, requesters, Reply("done", table, fields=done_fields(result)))
    context.log.info(f"snapshot {result.snapshot_id} of {table}: {result.row_count} rows in "
                     f"{result.batch_count} chunks, cutover at LSN {result.lsn}")
    return dg.MaterializeResult(metadata={
        "snapshot_id": result.snapshot_id,
        "lsn": result.lsn,
        "watermark_lsn": result.watermark_lsn,
        "cdc_stream": result.cdc_stream,
        "cdc_start_seq": dg.MetadataValue.int(result.cdc_start_seq)
        if result.cdc_start_seq is not None else dg.MetadataValue.null(),
        "watermark_subject": result.watermark_subject,
        "cutover_rule": result.cutover_rule,
        "row_count": dg.MetadataValue.int(result.row_count),
        "batch_count": dg.MetadataValue.int(result.batch_count),
        "bytes_raw": dg.MetadataValue.int(result.bytes_raw),
        "bytes_compressed": dg.MetadataValue.int(result.bytes_compressed),
        "compression": result.compression or "none",
        "duration_seconds": dg.MetadataValue.float(result.duration_seconds),
    })


def answer_requesters(replies: NatsRepliesResource, requesters: list, reply: Reply) -> None:
    """The same reply to every request this run serves (each with its own request_id)."""
    if not requesters:
        return

    async def send() -> None:
        async with replies.connect(name="cdc-platform-snapshot-replies") as client:
            await send_replies(client, [
                (reply_to, Reply(reply.status, reply.table, request_id, reply.fields))
                for request_id, reply_to in requesters])

    asyncio.run(send())
