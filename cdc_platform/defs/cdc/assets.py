"""The CDC stream as an asset the CDC run reports on (observations: LSN, lag, rate)."""

import dagster as dg

CDC_STREAM_KEY = dg.AssetKey("cdc_stream")

cdc_stream = dg.AssetSpec(
    CDC_STREAM_KEY,
    group_name="cdc",
    kinds={"nats", "postgres"},
    description="The JetStream CDC stream fed by the replication slot. The running cdc_job "
    "observes it periodically: confirmed LSN, lag in bytes, events/s.",
)
