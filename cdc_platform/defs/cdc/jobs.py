"""`cdc_job`: one long-running op that runs the CDC bridge until the run is cancelled."""

import time

import dagster as dg

from cdc_platform.bridge.thread import BridgeThread
from cdc_platform.defs.cdc.assets import CDC_STREAM_KEY
from cdc_platform.defs.resources import CdcResource, NatsResource, PostgresResource
from cdc_platform.settings import OrchestrationSettings, load_settings

SLOT_TAG = "cdc_platform/slot"
# Unix time of the run worker's last sign of life (written every few seconds by the op).
LIVENESS_TAG = "cdc_platform/alive_at"


@dg.op(description="Stream the replication slot into JetStream until the run is cancelled.")
def run_cdc_bridge(context: dg.OpExecutionContext, postgres: PostgresResource,
                   nats: NatsResource, cdc: CdcResource) -> None:
    settings = cdc.platform_settings(postgres, nats)
    orchestration = load_settings(OrchestrationSettings)
    bridge = BridgeThread(settings, observe_interval=orchestration.cdc_observe_interval_seconds)
    bridge.start()
    context.log.info(f"CDC bridge started: slot {settings.postgres.slot}, publication "
                     f"{settings.postgres.publication}, {settings.postgres.describe()} -> "
                     f"{settings.nats.describe()}")
    next_liveness = 0.0
    try:
        while bridge.is_alive():
            bridge.join(1.0)
            _report(context, bridge.observed())
            if time.monotonic() >= next_liveness:  # cdc_sensor's proof that we are alive
                context.instance.add_run_tags(context.run_id,
                                              {LIVENESS_TAG: str(int(time.time()))})
                next_liveness = time.monotonic() + orchestration.cdc_liveness_interval_seconds
    except BaseException:  # a cancelled run interrupts this thread
        context.log.info("run cancelled: stopping the CDC bridge gracefully (final ack)")
        bridge.stop(settings.bridge.shutdown_timeout_seconds + 10)
        _report(context, bridge.observed())
        raise
    _report(context, bridge.observed())
    bridge.raise_failure()


def _report(context: dg.OpExecutionContext, observations: list[dict]) -> None:
    for figures in observations:
        context.log_event(dg.AssetObservation(
            asset_key=CDC_STREAM_KEY,
            metadata={
                "confirmed_lsn": figures["confirmed_lsn"],
                "lag_bytes": dg.MetadataValue.int(figures["lag_bytes"]),
                "retained_wal_bytes": dg.MetadataValue.int(figures["retained_wal_bytes"]),
                "events_per_second": dg.MetadataValue.float(figures["events_per_second"]),
                "events_published": dg.MetadataValue.int(figures["events_published"]),
                "observed_at": dg.MetadataValue.timestamp(time.time()),
            },
        ))


def build_cdc_job(slot: str) -> dg.JobDefinition:
    @dg.job(
        name="cdc_job",
        description="The CDC bridge. At most one run per replication slot (run tag "
        f"{SLOT_TAG}, limited to 1 in dagster.yaml; the bridge also refuses an active slot).",
        tags={SLOT_TAG: slot, "dagster/max_retries": "0"},
    )
    def cdc_job() -> None:
        run_cdc_bridge()

    return cdc_job
