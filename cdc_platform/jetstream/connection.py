"""Connecting to NATS with errors a person can act on (never echoing credentials)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import AuthorizationError, NoServersError
from nats.errors import Error as NatsError

from cdc_platform.errors import NatsAuthError, NatsUnreachable
from cdc_platform.jetstream.nats_internals import cancel_client_tasks, check_installed_nats_py
from cdc_platform.settings import NatsSettings

log = logging.getLogger(__name__)


async def connect_nats(settings: NatsSettings, *, name: str = "cdc_platform",
                       reconnect_forever: bool = False,
                       inbox_prefix: str = "_INBOX",
                       on_disconnect: Callable[[], Awaitable[None]] | None = None,
                       on_reconnect: Callable[[], Awaitable[None]] | None = None
                       ) -> NatsClient:
    """Connect, failing fast and clearly at start (:class:`NatsUnreachable`,
    :class:`NatsAuthError`, :class:`~cdc_platform.jetstream.nats_internals.NatsPyUnsupported`
    for a nats-py this platform does not support); once connected, nats-py reconnects by
    itself.

    ``reconnect_forever`` is for long-running publishers (the CDC bridge): NATS going away
    mid-stream must never end the process, only pause it. At start every server is tried
    twice: a caller that wants to wait for NATS retries (the bridge does, stoppably).
    ``inbox_prefix``: where replies to this client go (a mirror's ``--inbox-prefix``).
    ``on_disconnect`` and ``on_reconnect`` are called on each disconnection (our own close
    included) and reconnection.

    After a TLS handshake that failed on our side (the server's certificate not verified,
    also a ``nats://`` URL to a TLS-only server, which nats-py upgrades) nats-py 2.16 waits
    forever for the socket to close: such a failure ends the attempts at once, and the
    attempts are bounded in time anyway (:func:`_start_bound`).
    """
    check_installed_nats_py()
    options = settings.connect_options()
    options["name"] = name
    options["inbox_prefix"] = inbox_prefix
    # Applies to the first connection too: -1 would retry there forever, unstoppable and
    # silent (a refused password looks like any other failed attempt).
    options["max_reconnect_attempts"] = 1
    options["reconnect_time_wait"] = 1.0
    errors_seen: list[Exception] = []

    async def _on_error(exc: Exception) -> None:
        errors_seen.append(exc)
        if client_ref:  # after the first connection: an outage, nats-py reconnects
            log.warning("NATS: %s", exc or type(exc).__name__)
        elif isinstance(exc, ssl.SSLCertVerificationError):
            # (nats-py awaits this callback in its attempt's except clause: raising here ends
            # the attempts, before it waits for the socket to close)
            raise _ServerNotVerified from exc

    client_ref: list[NatsClient] = []

    async def _on_disconnect() -> None:
        if on_disconnect is not None:
            await on_disconnect()
        if client_ref and (client_ref[0].is_closed or client_ref[0].is_draining):
            return  # our own close(), not an outage
        log.warning("NATS disconnected from %s", settings.describe())

    async def _on_reconnect() -> None:
        if on_reconnect is not None:
            await on_reconnect()
        log.info("NATS reconnected to %s", settings.describe())

    try:
        async with asyncio.timeout(_start_bound(options)):
            client = await nats.connect(
                allow_reconnect=True, error_cb=_on_error, disconnected_cb=_on_disconnect,
                reconnected_cb=_on_reconnect, **options,
            )
        client_ref.append(client)
        client.options["max_reconnect_attempts"] = -1 if reconnect_forever else 60
        return client
    except (NoServersError, NatsError, OSError, TimeoutError, _ServerNotVerified) as exc:
        if any(_is_auth_error(e) for e in [*errors_seen, exc]):
            raise NatsAuthError(
                f"NATS at {settings.describe()} refused our credentials (check "
                f"{_credential_variables(settings)})") from None
        cause = next((e for e in reversed(errors_seen) if str(e)), exc)
        why = (f"its TLS certificate was not verified ({cause.verify_message}); check "
               f"{settings.variable('tls_ca_file')} (without it, the system's CAs; a nats:// "
               "URL is upgraded to TLS when the server requires it)"
               if isinstance(cause, ssl.SSLCertVerificationError)
               else cause or type(cause).__name__)
        raise NatsUnreachable(f"cannot reach NATS at {settings.describe()}: {why}") from None


class _ServerNotVerified(Exception):
    """Ends nats-py's first connection attempts at a TLS certificate it could not verify."""


def _start_bound(options: dict[str, Any]) -> float:
    """Seconds the first connection may take: each server tried twice, each try its
    ``connect_timeout`` and the wait before the next, and one more ``connect_timeout``."""
    attempts = len(options["servers"]) * (options["max_reconnect_attempts"] + 1)
    return (attempts * (options["connect_timeout"] + options["reconnect_time_wait"])
            + options["connect_timeout"])


def _credential_variables(settings: NatsSettings) -> str:
    user, password, token, creds = (settings.variable(name) for name in (
        "user", "password", "token", "creds_file"))
    return f"{user} and {password}, {token} or {creds}"


def _is_auth_error(exc: BaseException) -> bool:
    if isinstance(exc, AuthorizationError):
        return True
    text = str(exc).lower()
    return "authorization" in text or "authentication" in text


async def fetch_available(subscription: Any, limit: int, timeout: float) -> list[Msg]:
    """Up to ``limit`` messages of a pull subscription, or [] when none came in ``timeout``.

    nats-py raises its own ``TimeoutError`` when nothing is pending, but asyncio's when the
    deadline passes inside its wait (a slow server, a loaded machine); both are the builtin
    ``TimeoutError``, which is what is caught here.
    """
    try:
        return await subscription.fetch(limit, timeout=timeout)
    except TimeoutError:
        return []


async def close_nats(client: Any, timeout: float) -> None:
    """Close ``client`` within ``timeout``. nats-py's ``close()`` first flushes what is
    pending, which waits for a connection that may never come back; cut short, it would leave
    the client reconnecting forever (its reconnect and subscription tasks alive in a process
    that goes on, such as a Dagster worker). So past the timeout, those tasks are cancelled."""
    try:
        async with asyncio.timeout(timeout):
            await client.close()
        return
    except Exception as exc:  # noqa: BLE001 - a timeout, or the connection already broken
        log.debug("NATS close did not finish (%r): cancelling the client's tasks", exc)
    cancel_client_tasks(client)
