"""`schemas`: the KV bucket of table schemas; materializing it republishes them all."""

import asyncio

import dagster as dg

from cdc_platform.defs.resources import CdcResource, NatsResource, PostgresResource
from cdc_platform.postgres.catalog import describe_published
from cdc_platform.publishing.schemas import publish_schemas
from cdc_platform.wire import encoder


@dg.asset(group_name="platform", kinds={"nats", "postgres"})
def schemas(context: dg.AssetExecutionContext, postgres: PostgresResource, nats: NatsResource,
            cdc: CdcResource) -> dg.MaterializeResult:
    """Every published table's schema in KV `schemas` (key = wire table name)."""
    settings = cdc.platform_settings(postgres, nats)
    publication = settings.postgres.publication
    with postgres.connect() as conn:
        found = describe_published(conn, publication)

    async def put_all() -> None:
        async with nats.connect("cdc-platform-schemas") as client:
            await publish_schemas(client.jetstream(), settings.topology.schemas.bucket, found,
                                  encoder(settings.encoding.format), settings.bridge.signer())

    asyncio.run(put_all())
    context.log.info(f"published {len(found)} schemas from publication {publication}")
    return dg.MaterializeResult(metadata={
        "tables": dg.MetadataValue.json({s.wire_name: s.fingerprint for s in found}),
        "table_count": len(found),
        "publication": publication,
    })
