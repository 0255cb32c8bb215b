"""The JetStream topology as an asset: materializing it creates or verifies it."""

import asyncio

import dagster as dg

from cdc_platform.defs.resources import NatsResource
from cdc_platform.jetstream.provision import provision
from cdc_platform.settings import NatsTopology, load_settings


@dg.asset(group_name="platform", kinds={"nats"})
def jetstream_topology(context: dg.AssetExecutionContext,
                       nats: NatsResource) -> dg.MaterializeResult:
    """CDC, INIT and SNAPSHOT_REQUESTS streams and the schemas KV bucket (idempotent)."""
    topology: NatsTopology = load_settings(NatsTopology)

    async def run():
        async with nats.connect("cdc-platform-provision") as client:
            return await provision(client.jetstream(), topology)

    report = asyncio.run(run())
    context.log.info("JetStream: %s", report.summary())
    return dg.MaterializeResult(metadata={
        "created": ", ".join(report.created) or "-",
        "updated": ", ".join(report.updated) or "-",
        "cdc_max_age_seconds": topology.cdc.max_age_seconds,
        "cdc_max_bytes": topology.cdc.max_bytes,
    })
