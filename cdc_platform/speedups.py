"""The one place the compiled twins are chosen (``cdc_platform/_speedups``, Cython, built by
``setup.py``; optional).

Some pure modules have a compiled twin at the same path under ``_speedups`` (the twin of
``protocol/pgoutput.py`` is ``_speedups/protocol/pgoutput.pyx``) that gives the same results
faster, or hands a case back to the pure code. The rule (psycopg's for ``psycopg_c``):

- a twin exports only names of its pure module, with the same parameters (``.pyi`` beside
  it); the pure module defines each: the pure code, a pure stand-in that hands every case
  back (``pgoutput.read_tuple``), or None where only compiled code has such a shortcut
  (``events.pack_map``). Callers call the name, never ask whether a twin is built;
- the pure module binds its twin in one block at its end (``values.py``: before the tables
  that hold the converter), always this shape::

      if TYPE_CHECKING:
          from cdc_platform._speedups.protocol import pgoutput as _twin
      else:
          _twin = compiled_twin(__name__)
      if _twin is not None:
          read_tuple = _twin.read_tuple

  so mypy reads the stub and checks each twin name against the pure one it replaces;
  ``test_speedups.py`` checks the stubs against the built twins (stubtest) and their names
  and parameters against the pure module's.

The twin is None when it is not built (no C compiler at install time) or when
``CDC_PLATFORM_PURE_PYTHON=1`` asks for the pure code everywhere (to debug, or to compare the
two). The wire bytes are the same either way: ``cdc_platform_tests/unit/test_golden.py`` pins
them for both.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

# Read once, at import: every twin is chosen by this switch.
PURE_PYTHON = os.environ.get("CDC_PLATFORM_PURE_PYTHON", "").strip().lower() in (
    "1", "true", "yes")

TWINNED = ("bridge.events", "jetstream.frames", "jetstream.pull", "mirror.snapshots",
           "mirror.store", "mirror.stored_values", "protocol.changes", "protocol.pgoutput",
           "protocol.values", "publishing.framing", "publishing.publisher", "snapshot.chunks",
           "snapshot.copy_out", "wire.digest", "wire.encoding")



def compiled_twin(module_name: str) -> ModuleType | None:
    """The compiled twin of pure module ``module_name`` (``cdc_platform.protocol.pgoutput``
    -> ``cdc_platform._speedups.protocol.pgoutput``), or None: not built, or pure Python asked
    for."""
    if PURE_PYTHON:
        return None
    return _import(module_name.replace("cdc_platform.", "cdc_platform._speedups.", 1))


def built_twins() -> dict[str, bool]:
    """Each twinned pure module -> whether its compiled twin is in use (for diagnostics)."""
    return {name: compiled_twin(f"cdc_platform.{name}") is not None for name in TWINNED}


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
