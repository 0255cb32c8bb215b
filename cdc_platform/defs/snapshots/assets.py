"""`init_snapshot`, partitioned by table: a Spark snapshot into the INIT stream."""

import dagster as dg
from dagster_pyspark import LazyPySparkResource

from cdc_platform.defs.resources import CdcResource, NatsResource, PostgresResource
from cdc_platform.defs.snapshots.partitions import published_tables_partitions
from cdc_platform.spark import prepare_spark_environment

SNAPSHOT_KIND_TAG = "cdc_platform/kind"


@dg.asset(
    group_name="snapshots",
    partitions_def=published_tables_partitions,
    kinds={"spark", "nats", "postgres"},
    op_tags={SNAPSHOT_KIND_TAG: "snapshot"},
    deps=["schemas"],
)
def init_snapshot(context: dg.AssetExecutionContext, postgres: PostgresResource,
                  nats: NatsResource, cdc: CdcResource,
                  pyspark: LazyPySparkResource) -> dg.MaterializeResult:
    """A consistent snapshot of one published table, chunked into `init.snap.{table}.*`,
    then `init.meta.{table}`. The metadata holds the cutover point: apply CDC events with
    `commit_lsn >= lsn`, reading the CDC stream from `cdc_start_seq`."""
    from cdc_platform.snapshot.job import run_snapshot  # Spark code: only when a run needs it

    table = context.partition_key
    settings = cdc.platform_settings(postgres, nats)
    prepare_spark_environment()
    result = run_snapshot(pyspark.spark_session, settings, table)
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
