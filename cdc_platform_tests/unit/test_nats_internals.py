"""nats-py internals (``jetstream/nats_internals.py``): the installed nats-py has each one in
the shape used, one that lacks any fails with a line naming it, the version and the supported
range, the range is the one pyproject.toml allows, and no other module touches a nats-py
private name."""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import inspect
import re
import tomllib
from pathlib import Path
from typing import Any

import nats.js.kv
import nats.js.object_store
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.protocol.parser import Parser
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from cdc_platform.jetstream.nats_internals import (
    SUPPORTED_NATS_PY,
    NatsPyUnsupported,
    cancel_client_tasks,
    check_nats_py,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cdc_platform"
INTERNALS_MODULE = PACKAGE / "jetstream" / "nats_internals.py"
# nats-py's documented modules; anything else under ``nats`` is its own business
PUBLIC_MODULES = {"nats", "nats.errors", "nats.aio.client", "nats.aio.errors", "nats.aio.msg",
                  "nats.aio.subscription", "nats.js", "nats.js.api", "nats.js.errors",
                  "nats.js.kv", "nats.js.object_store", "nats.micro"}


def test_the_installed_nats_py_has_every_internal_used() -> None:
    check_nats_py()
    assert importlib.metadata.version("nats-py") in SpecifierSet(SUPPORTED_NATS_PY)


def test_pyproject_allows_the_range_tested() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [nats_py] = [Requirement(text) for text in project["dependencies"]
                 if Requirement(text).name == "nats-py"]
    assert nats_py.specifier == SpecifierSet(SUPPORTED_NATS_PY)


def _client_without(name: str) -> Client:
    client = Client()
    delattr(client, name)
    return client


def _client_with(name: str, value: Any) -> Client:
    client = Client()
    setattr(client, name, value)
    return client


async def _process_msg_without_headers(sid: int, subject: bytes, reply: bytes,
                                       data: bytes) -> None:
    """A handler of another shape (one parameter fewer)."""


def _busy_parser() -> Parser:
    parser = Parser()
    parser.state = 2  # AWAITING_MSG_PAYLOAD
    return parser


# What a nats-py release may change, each as a client or subscription of such a release would
# look, with what the error says.
CHANGED = [
    pytest.param(lambda: _client_without("_ps"), "Client._ps", id="no parser"),
    pytest.param(lambda: _client_with("_ps", object()), "Client._ps.parse", id="parser shape"),
    pytest.param(lambda: _client_with("_ps", _busy_parser()), "AWAITING_CONTROL_LINE",
                 id="parser states"),
    pytest.param(lambda: _client_with("_process_msg", _process_msg_without_headers),
                 "Client._process_msg", id="message handler shape"),
    pytest.param(lambda: _client_with("_send_command", lambda cmd: None),
                 "Client._send_command", id="send not a coroutine"),
    pytest.param(lambda: _client_without("_flusher_task"), "Client._flusher_task",
                 id="a task renamed"),
    pytest.param(lambda: _client_with("_subs", []), "Client._subs", id="subscriptions"),
]


@pytest.mark.parametrize(("make_client", "named"), CHANGED)
def test_a_nats_py_that_changed_an_internal_fails_loudly(make_client, named) -> None:
    with pytest.raises(NatsPyUnsupported) as raised:
        check_nats_py(client=make_client())
    message = str(raised.value)
    assert named in message
    assert importlib.metadata.version("nats-py") in message
    assert SUPPORTED_NATS_PY in message


def test_a_subscription_without_its_sid_fails_loudly() -> None:
    class Renamed:
        sid = 1
        _wait_for_msgs_task = None

    with pytest.raises(NatsPyUnsupported, match=r"Subscription\._id"):
        check_nats_py(subscription=Renamed())


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(NatsPyUnsupported) as raised:
        check_nats_py(client=object(), subscription=object())
    assert str(raised.value).count(";") >= 8


def test_a_client_that_could_not_close_has_its_tasks_cancelled() -> None:
    async def run() -> list[bool]:
        client = Client()
        never = asyncio.get_running_loop().create_future()
        client._reading_task = asyncio.ensure_future(never)
        subscription = Subscription(client, 1, "s")
        subscription._wait_for_msgs_task = asyncio.ensure_future(asyncio.sleep(60))
        client._subs[1] = subscription
        cancel_client_tasks(client)
        tasks = [client._reading_task, subscription._wait_for_msgs_task]
        await asyncio.gather(*tasks, return_exceptions=True)
        return [task.cancelled() for task in tasks]

    assert asyncio.run(run()) == [True, True]


# -- nothing else touches them -----------------------------------------------------------------
def _private_names_of_nats_py() -> frozenset[str]:
    """The single-underscore names nats-py's objects have (classes and fresh instances)."""
    client = Client()
    objects: list[Any] = [Client, client, Subscription, Subscription(client, 1, "s"), Msg,
                          Msg(client), Parser, Parser(), JetStreamContext,
                          nats.js.kv.KeyValue, nats.js.object_store.ObjectStore]
    names = {name for thing in objects for name in dir(thing)}
    return frozenset(name for name in names
                     if name.startswith("_") and not name.startswith("__"))


NATS_PY_PRIVATE = _private_names_of_nats_py()


def _violations(path: Path) -> list[str]:
    """Where ``path`` imports a nats-py module outside its public ones, reads or writes one
    of nats-py's private names on anything but ``self``/``cls``, or spells one in a string."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            found += [f"{node.lineno}: imports {node.module}.{alias.name}"
                      for alias in node.names
                      if node.module.split(".")[0] == "nats" and alias.name.startswith("_")]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        found += [f"{node.lineno}: imports {module}" for module in modules
                  if module.split(".")[0] == "nats" and module not in PUBLIC_MODULES]
        if (isinstance(node, ast.Attribute) and node.attr in NATS_PY_PRIVATE
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Constant) and node.value in NATS_PY_PRIVATE:  # getattr(x, "_..")
            found.append(f"{node.lineno}: {node.value!r}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_only_nats_internals_touches_nats_py_internals() -> None:
    found = {str(path.relative_to(ROOT)): _violations(path)
             for path in sorted(PACKAGE.rglob("*.py")) if path != INTERNALS_MODULE}
    assert {path: where for path, where in found.items() if where} == {}


def test_compiled_twins_do_not_import_nats() -> None:
    importing = re.compile(r"^\s*(from|c?import)\s+nats\b", re.MULTILINE)
    assert [path.name for path in sorted((PACKAGE / "_speedups").glob("*.p[yx]*"))
            if importing.search(path.read_text())] == []


def test_the_rule_finds_each_kind_of_use(tmp_path) -> None:
    module = tmp_path / "sneaky.py"
    module.write_text(inspect.cleandoc("""
        from nats.protocol.parser import Parser
        import nats.aio.transport
        from nats.aio.client import _Foo

        class Mine:
            def f(self, client, subscription):
                self._ps = None  # our own attribute: fine
                client._ps = Parser(client)
                sid = subscription._id
                tasks = [getattr(client, name) for name in ("_flusher_task",)]
                return getattr(client, "_send_command"), self._pending
        """))
    assert _violations(module) == [
        "1: imports nats.protocol.parser", "2: imports nats.aio.transport",
        "3: imports nats.aio.client._Foo", "8: client._ps", "9: subscription._id",
        "10: '_flusher_task'", "11: '_send_command'"]
