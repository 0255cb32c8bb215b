"""`schemas`: the KV bucket of table schemas; materializing it republishes them all."""

import asyncio

import dagster as dg

from cdc_platform.defs.resources import CdcResource, NatsResource, PostgresResource
from cdc_platform.postgres.catalog import published_tables, table_schema
from cdc_platform.wire import encoder


@dg.asset(group_name="platform", kinds={"nats", "postgres"})
def schemas(context: dg.AssetExecutionContext, postgres: PostgresResource, nats: NatsResource,
            cdc: CdcResource) -> dg.MaterializeResult:
    """Every published table's schema in KV `schemas` (key = wire table name)."""
    settings = cdc.platform_settings(postgres, nats)
    publication = settings.postgres.publication
    with postgres.connect() as conn:
        described = [table_schema(conn, publication, schema, table)
                     for schema, table in published_tables(conn, publication)]
    found = [s for s in described if s is not None]
    encode = encoder(settings.encoding.format)

    async def put_all() -> None:
        async with nats.connect("cdc-platform-schemas") as client:
            kv = await client.jetstream().key_value(settings.topology.schemas.bucket)
            for table_schema_ in found:
                await kv.put(table_schema_.wire_name, encode(table_schema_.to_wire()))

    asyncio.run(put_all())
    context.log.info(f"published {len(found)} schemas from publication {publication}")
    return dg.MaterializeResult(metadata={
        "tables": dg.MetadataValue.json({s.wire_name: s.fingerprint for s in found}),
        "table_count": len(found),
        "publication": publication,
    })
