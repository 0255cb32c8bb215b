"""`cdc_job`: one long-running op that runs the CDC bridge until the run is cancelled."""

import asyncio
import queue
import threading
import time

import dagster as dg

from cdc_platform.bridge.runner import CdcBridge
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
    observe_every = orchestration.cdc_observe_interval_seconds
    observations: queue.Queue = queue.Queue()
    bridge_box: dict = {}
    failure: list[BaseException] = []
    ready = threading.Event()

    def serve() -> None:
        # The bridge gets its own thread and event loop, so that Dagster's interrupt
        # (run cancelled -> DagsterExecutionInterruptedError in this op's thread) can be
        # turned into a graceful stop: drain, final ack, disconnect.
        async def main() -> None:
            bridge = CdcBridge(settings, observer=observations.put,
                               observe_interval=observe_every)
            bridge_box["bridge"], bridge_box["loop"] = bridge, asyncio.get_running_loop()
            ready.set()
            await bridge.run()

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - handed to the op's thread
            failure.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=serve, name="cdc-bridge", daemon=True)
    thread.start()
    context.log.info(f"CDC bridge started: slot {settings.postgres.slot}, publication "
                     f"{settings.postgres.publication}, {settings.postgres.describe()} -> "
                     f"{settings.nats.describe()}")
    next_liveness = 0.0
    try:
        while thread.is_alive():
            thread.join(1.0)
            _report(context, observations)
            if time.monotonic() >= next_liveness:  # cdc_sensor's proof that we are alive
                context.instance.add_run_tags(context.run_id,
                                              {LIVENESS_TAG: str(int(time.time()))})
                next_liveness = time.monotonic() + orchestration.cdc_liveness_interval_seconds
    except BaseException:
        context.log.info("run cancelled: stopping the CDC bridge gracefully (final ack)")
        ready.wait(10)
        if "bridge" in bridge_box:
            bridge_box["loop"].call_soon_threadsafe(bridge_box["bridge"].request_stop)
        thread.join(settings.bridge.shutdown_timeout_seconds + 10)
        _report(context, observations)
        raise
    _report(context, observations)
    if failure:
        raise failure[0]


def _report(context: dg.OpExecutionContext, observations: queue.Queue) -> None:
    while True:
        try:
            figures = observations.get_nowait()
        except queue.Empty:
            return
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
