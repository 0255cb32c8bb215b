"""Dagster resources: thin, typed handles on the library's settings.

Where PostgreSQL and NATS are and who connects (hosts, ports, URLs, users, passwords, tokens,
credential and TLS files) are the deployment's environment only (`CDC_*` or the seed bridge's
names), read by the library's settings at run time: they are no resource fields, so no run
config (the launchpad, `dagster job launch --config`) can name another host and have the
environment's credentials sent there. What a run may choose is a field; a field left unset
is read from the environment too, so one environment configures the CLI and Dagster alike.
"""


from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
from dagster import ConfigurableResource
from nats.aio.client import Client as NatsClient

from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.settings import (
    BridgeSettings,
    EncodingSettings,
    FleetNatsSettings,
    NatsSettings,
    NatsTopology,
    PlatformSettings,
    PostgresSettings,
    ReplyNatsSettings,
    SensorNatsSettings,
    VerifySettings,
    load_settings,
)


def _overrides(resource: ConfigurableResource) -> dict[str, Any]:
    # "" counts as unset so that an EnvVar pointing at an empty variable means "default".
    return {k: v for k, v in resource.model_dump().items() if v not in (None, "")}


class PostgresResource(ConfigurableResource):
    """The source PostgreSQL, reached as the platform's least-privilege role (where and as
    whom: CDC_PG_* in the environment)."""

    publication: str | None = None
    slot: str | None = None

    def settings(self) -> PostgresSettings:
        return load_settings(PostgresSettings, **_overrides(self))

    @contextmanager
    def connect(self, **kwargs: Any) -> Iterator[psycopg.Connection]:
        with psycopg.connect(self.settings().conninfo(), **kwargs) as conn:
            yield conn


class NatsResource(ConfigurableResource):
    """The NATS server holding the CDC/INIT streams and the schemas bucket (where and with
    which credentials: CDC_NATS_* in the environment)."""

    def settings(self) -> NatsSettings:
        return load_settings(NatsSettings)

    @asynccontextmanager
    async def connect(self, name: str = "cdc-platform-dagster", *,
                      as_sensor: bool = False, as_fleet: bool = False):
        """``as_sensor``: with the snapshot request sensor's own user (CDC_SENSOR_NATS_*,
        when set: it may write nothing), not the bridge's the process may hold;
        ``as_fleet``: with mirror_fleet_sensor's (CDC_FLEET_NATS_*: it may only read KV
        mirrors)."""
        main = self.settings()
        own = (load_settings(SensorNatsSettings).resolved(main) if as_sensor
               else load_settings(FleetNatsSettings).resolved(main) if as_fleet else None)
        client = await connect_nats(own or main, name=name)
        try:
            yield client
        finally:
            await client.close()


class NatsRepliesResource(ConfigurableResource):
    """The connection replies to snapshot requests go through: a NATS user that may publish
    inbox subjects only (CDC_REPLY_NATS_* in the environment; none set: the main
    connection's)."""

    def settings(self) -> NatsSettings | None:
        """The reply connection's settings; None: replies go through the main connection."""
        return load_settings(ReplyNatsSettings).resolved(load_settings(NatsSettings))

    @asynccontextmanager
    async def connect(self, main: NatsClient | None = None,
                      name: str = "cdc-platform-replies") -> AsyncIterator[NatsClient]:
        """A client to send replies with: ``main`` itself when no reply connection is
        configured (a new connection with the main settings when ``main`` is None)."""
        settings = self.settings()
        if settings is None and main is not None:
            yield main
            return
        client = await connect_nats(settings or load_settings(NatsSettings), name=name)
        try:
            yield client
        finally:
            await client.close()


class CdcResource(ConfigurableResource):
    """How the CDC bridge and snapshots encode and run (unset fields: from the environment)."""

    format: str | None = None  # msgpack | json
    message_mode: str | None = None  # per-change | batched
    zstd: bool | None = None
    http_port: int | None = None

    def platform_settings(self, postgres: PostgresResource,
                          nats: NatsResource) -> PlatformSettings:
        encoding = load_settings(EncodingSettings, **{
            k: v for k, v in {"format": self.format, "zstd": self.zstd}.items()
            if v is not None})
        bridge = load_settings(BridgeSettings, **{
            k: v for k, v in {"message_mode": self.message_mode,
                              "http_port": self.http_port}.items() if v is not None})
        return PlatformSettings(postgres=postgres.settings(), nats=nats.settings(),
                                topology=load_settings(NatsTopology), encoding=encoding,
                                bridge=bridge, verify=load_settings(VerifySettings))
