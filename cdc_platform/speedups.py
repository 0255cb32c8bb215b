"""The one place the compiled twins are chosen (``cdc_platform/_speedups``, Cython, built by
``setup.py``; optional).

Some pure modules have a compiled twin at the same path under ``_speedups`` (the twin of
``protocol/pgoutput.py`` is ``_speedups/protocol/pgoutput.pyx``) that gives the same results
faster, or hands a case back to the pure code. A pure module asks for its twin once, at import,
with ``compiled_twin(__name__)``, in one binding block at its end that rebinds the pure names
the twin exports (the same names and signatures: mypy checks each against the twin's ``.pyi``,
which it reads through that block's ``TYPE_CHECKING`` import); nothing else chooses. The twin is None
when it is not built (no C compiler at install time) or when ``CDC_PLATFORM_PURE_PYTHON=1``
asks for the pure code everywhere (to debug, or to compare the two). The wire bytes are the
same either way: ``cdc_platform_tests/unit/test_golden.py`` pins them for both.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

# Read once, at import: every twin is chosen by this switch.
PURE_PYTHON = os.environ.get("CDC_PLATFORM_PURE_PYTHON", "").strip().lower() in (
    "1", "true", "yes")

TWINNED = ("bridge.events", "jetstream.frames", "jetstream.pull", "mirror.snapshots",
           "mirror.store", "protocol.changes", "protocol.pgoutput", "protocol.values",
           "publishing.framing", "publishing.publisher", "snapshot.chunks", "wire.encoding")


# Twins not yet moved to their module's path (mirror/store.py is being split): pure -> twin.
_AT_OLD_PATHS = {"cdc_platform.mirror.store": "cdc_platform._speedups.store"}


def compiled_twin(module_name: str) -> ModuleType | None:
    """The compiled twin of pure module ``module_name`` (``cdc_platform.protocol.pgoutput``
    -> ``cdc_platform._speedups.protocol.pgoutput``), or None: not built, or pure Python asked
    for."""
    if PURE_PYTHON:
        return None
    twin = _AT_OLD_PATHS.get(module_name) or module_name.replace(
        "cdc_platform.", "cdc_platform._speedups.", 1)
    return _import(twin)


def built_twins() -> dict[str, bool]:
    """Each twinned pure module -> whether its compiled twin is in use (for diagnostics)."""
    return {name: compiled_twin(f"cdc_platform.{name}") is not None for name in TWINNED}


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
