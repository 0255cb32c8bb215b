"""The one Dagster ``Definitions`` object of the platform (loaded by workspace.yaml)."""

from __future__ import annotations

import dagster as dg

from cdc_platform.defs.platform.assets import jetstream_topology
from cdc_platform.defs.resources import NatsResource, PostgresResource


def build_definitions() -> dg.Definitions:
    return dg.Definitions(
        assets=[jetstream_topology],
        resources={
            "postgres": PostgresResource(password=dg.EnvVar("CDC_PG_PASSWORD")),
            "nats": NatsResource(password=dg.EnvVar("CDC_NATS_PASSWORD")),
        },
    )


defs = build_definitions()
