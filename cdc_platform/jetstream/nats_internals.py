"""Every use of nats-py internals (names outside its public API), in one place.

Three things need them, each for speed or for a guarantee the public API does not give:
framing ``HPUB`` bytes ourselves (the publisher), reading a pull consumer's messages before
nats-py parses them (the mirror), and closing a client whose connection never comes back
(every process that ends). Each function below names the internal it relies on.

:func:`check_nats_py` verifies that each of them is there with the shape used here and
raises :class:`NatsPyUnsupported`, naming the installed nats-py and :data:`SUPPORTED_NATS_PY`
(the range pyproject.toml allows, the one tested), when one is not: a nats-py release that
changed them stops the process at its first connection (:func:`~cdc_platform.jetstream.
connection.connect_nats`) with one line to act on, rather than putting garbage on the wire or
stalling a mirror. ``cdc_platform_tests/unit/test_nats_internals.py`` runs it against the
installed nats-py and checks that no other module touches a nats-py private name.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, cast

from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from cdc_platform.errors import CdcError

#: The nats-py releases this platform is tested against (pyproject.toml says the same; a unit
#: test keeps the two equal). 2.12 is the first with ``StreamConfig.allow_batched``.
SUPPORTED_NATS_PY = ">=2.12,<2.17"

# Where nats-py keeps the parser state read by :func:`parser_is_idle`.
_PARSER_MODULE = "nats.protocol.parser"
# A client's tasks, as ``Client.close`` cancels them (``_wait_for_msgs_task``: a subscription's).
_CLIENT_TASKS = ("_reconnection_task", "_reading_task", "_ping_interval_task", "_flusher_task")

RawWrite = Callable[[bytes], Awaitable[None]]
#: What nats-py's parser hands over for each ``MSG``/``HMSG``: (sid,) subject, reply,
#: payload, header block.
MessageHandler = Callable[[int, bytes, bytes, bytes, "bytes | None"], Awaitable[None]]
Sink = Callable[[bytes, bytes, bytes, "bytes | None"], None]


def _awaiting_control_line() -> Any:
    """nats-py's parser state between frames; None if nats-py no longer has it (imported
    like this so that :func:`check_nats_py` can say so, not an ImportError)."""
    try:
        return getattr(importlib.import_module(_PARSER_MODULE), "AWAITING_CONTROL_LINE", None)
    except ImportError:
        return None


_AWAITING_CONTROL_LINE = _awaiting_control_line()


class NatsPyUnsupported(CdcError):
    """The installed nats-py lacks an internal this platform relies on."""


def nats_py_version() -> str:
    try:
        return importlib.metadata.version("nats-py")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_nats_py(client: Any = None, subscription: Any = None) -> None:
    """Raise :class:`NatsPyUnsupported` unless ``client`` (default: a new, unconnected
    nats-py client) and ``subscription`` (default: a nats-py subscription of it) have every
    internal this module uses, in the shape it uses them."""
    client = NatsClient() if client is None else client
    subscription = Subscription(client, 1, "check") if subscription is None else subscription
    problems = _client_problems(client) + _subscription_problems(subscription)
    if problems:
        raise NatsPyUnsupported(
            f"nats-py {nats_py_version()} is not supported (cdc-platform needs nats-py"
            f"{SUPPORTED_NATS_PY}): {'; '.join(problems)}")


@functools.cache
def check_installed_nats_py() -> None:
    """:func:`check_nats_py` once per process (a failure raises again on every call)."""
    check_nats_py()


def _client_problems(client: Any) -> list[str]:
    problems = [f"Client.{name} is not a coroutine function taking {parameters}"
                for name, parameters in (
                    ("_process_msg", ("sid", "subject", "reply", "data", "headers")),
                    ("_send_command", ("cmd",)),
                    ("_flush_pending", ()))
                if not _is_coroutine_taking(getattr(client, name, None), parameters)]
    problems += [f"Client.{name} is missing" for name in _CLIENT_TASKS
                 if not hasattr(client, name)]
    if not isinstance(getattr(client, "_subs", None), dict):
        problems.append("Client._subs is not a dict")
    parser = getattr(client, "_ps", None)
    if parser is None:
        problems.append("Client._ps (the protocol parser) is missing")
    else:
        problems += _parser_problems(parser)
    return problems


def _parser_problems(parser: Any) -> list[str]:
    problems = []
    if not _is_coroutine_taking(getattr(parser, "parse", None), ("data",)):
        problems.append("Client._ps.parse is not a coroutine function taking data")
    if not callable(getattr(parser, "reset", None)):
        problems.append("Client._ps.reset is missing")
    if not isinstance(getattr(parser, "buf", None), bytearray | bytes):
        problems.append("Client._ps.buf is not a byte buffer")
    if _AWAITING_CONTROL_LINE is None:
        problems.append(f"{_PARSER_MODULE}.AWAITING_CONTROL_LINE is missing")
    elif getattr(parser, "state", None) != _AWAITING_CONTROL_LINE:
        problems.append("a new Client._ps.state is not AWAITING_CONTROL_LINE")
    return problems


def _subscription_problems(subscription: Any) -> list[str]:
    problems = []
    if not isinstance(getattr(subscription, "_id", None), int):
        problems.append("Subscription._id (its sid) is not an int")
    if not hasattr(subscription, "_wait_for_msgs_task"):
        problems.append("Subscription._wait_for_msgs_task is missing")
    return problems


def _is_coroutine_taking(function: Any, parameters: tuple[str, ...]) -> bool:
    if not inspect.iscoroutinefunction(function):
        return False
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return False
    return names[:len(parameters)] == parameters


# -- publishing: our own protocol bytes ------------------------------------------------------------
def raw_writer(client: NatsClient) -> RawWrite:
    """A function that queues protocol bytes on ``client``'s outbound buffer and kicks its
    flusher, as ``publish`` does after framing (``Client._send_command`` and
    ``Client._flush_pending``). The public ``publish`` frames one message per call, encoding
    its header dict each time, which costs more than the publish itself."""
    send_command, flush_pending = client._send_command, client._flush_pending

    async def write(data: bytes) -> None:
        await send_command(data)
        await flush_pending()  # returns at once: it does not wait for the socket

    return write


# -- reading: messages before nats-py parses them --------------------------------------------------
def subscription_sid(subscription: Subscription) -> int:
    """The sid the server puts in ``subscription``'s ``MSG`` frames (``Subscription._id``;
    nats-py has no public accessor)."""
    return subscription._id


def route_messages(client: NatsClient, sinks: dict[int, Sink]) -> MessageHandler:
    """Hand each ``MSG``/``HMSG`` whose sid has a sink in ``sinks`` (read at each message) to
    that sink, raw, and the others to nats-py as before; returns nats-py's handler.

    Replaces ``Client._process_msg``, which nats-py's parser calls for every message: the
    public path (a subscription's callback) builds a header dict, a ``Msg`` and a queue hop
    for each message first."""
    # (nats-py annotates headers as bytes; its parser passes None for a plain MSG)
    original = cast(MessageHandler, client._process_msg)

    async def process_msg(sid: int, subject: bytes, reply: bytes, data: bytes,
                          headers: bytes | None) -> None:
        sink = sinks.get(sid)
        if sink is None:
            await original(sid, subject, reply, data, headers)
        else:
            sink(subject, reply, data, headers)

    client._process_msg = process_msg  # type: ignore[method-assign]
    return original


def swap_parser(client: NatsClient, make_reader: Callable[[Any], Any]) -> None:
    """Install ``make_reader(nats-py's parser)`` as ``client``'s protocol reader
    (``Client._ps``, fed every chunk ``Client._read_loop`` reads from the socket, reset on
    each reconnect). The public API has no hook below a subscription."""
    client._ps = make_reader(client._ps)


def parser_is_idle(parser: Any) -> bool:
    """Whether nats-py's ``parser`` holds no part of a frame (its ``buf`` is empty and its
    ``state`` is ``AWAITING_CONTROL_LINE``), so that another reader may take the next byte."""
    return not parser.buf and parser.state == _AWAITING_CONTROL_LINE


# -- closing: a client whose connection never comes back -------------------------------------------
def cancel_client_tasks(client: NatsClient) -> None:
    """Cancel the tasks a client runs (reconnecting, reading, pinging, flushing, and each
    subscription's delivery), as ``Client.close`` would, for a close that could not finish:
    its flush waits for a connection that may never come back."""
    tasks: list[asyncio.Task | None] = [getattr(client, name) for name in _CLIENT_TASKS]
    tasks += [subscription._wait_for_msgs_task for subscription in list(client._subs.values())]
    for task in tasks:
        if task is not None and not task.done():
            task.cancel()
