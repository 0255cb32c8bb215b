"""Connecting to NATS with errors a person can act on (never echoing credentials)."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client as NatsClient
from nats.errors import Error as NatsError
from nats.errors import NoServersError

from cdc_platform.errors import CdcError
from cdc_platform.settings import NatsSettings

log = logging.getLogger(__name__)


async def connect_nats(settings: NatsSettings, *, name: str = "cdc_platform",
                       reconnect_forever: bool = False) -> NatsClient:
    """Connect, failing fast and clearly at start; after that nats-py reconnects itself.

    ``reconnect_forever`` is for long-running publishers (the CDC bridge): NATS going away
    mid-stream must never end the process, only pause it.
    """
    options = settings.connect_options()
    options["name"] = name
    options["max_reconnect_attempts"] = -1 if reconnect_forever else 60
    options["reconnect_time_wait"] = 1.0

    async def _on_error(exc: Exception) -> None:
        log.warning("NATS: %s", exc)

    client_ref: list[NatsClient] = []

    async def _on_disconnect() -> None:
        if client_ref and (client_ref[0].is_closed or client_ref[0].is_draining):
            return  # our own close(), not an outage
        log.warning("NATS disconnected from %s", settings.describe())

    async def _on_reconnect() -> None:
        log.info("NATS reconnected to %s", settings.describe())

    try:
        client = await nats.connect(
            allow_reconnect=True, error_cb=_on_error, disconnected_cb=_on_disconnect,
            reconnected_cb=_on_reconnect, **options,
        )
        client_ref.append(client)
        return client
    except NoServersError as exc:
        raise CdcError(f"cannot reach NATS at {settings.describe()}: {exc}") from None
    except NatsError as exc:
        text = str(exc).lower()
        if "authorization" in text or "authentication" in text or "auth" in text:
            raise CdcError(
                f"NATS at {settings.describe()} refused our credentials (check "
                "CDC_NATS_USER/NATS_BRIDGE_USER and its password or token)"
            ) from None
        raise CdcError(f"NATS connection to {settings.describe()} failed: {exc}") from None
    except OSError as exc:
        raise CdcError(f"cannot reach NATS at {settings.describe()}: {exc}") from None
