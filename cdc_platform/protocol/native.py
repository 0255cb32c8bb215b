"""The optional compiled accelerator, ``_native`` (Cython, built by ``setup.py``).

The decoder, the row builder, the temporal converters and the msgpack event writer each
have a pure-Python original and a compiled twin with the same results; the hot paths use
the twin when it is built. ``NATIVE`` is the compiled module, or None when it is not built
(no C compiler at install time) or when ``CDC_PLATFORM_PURE_PYTHON=1`` asks for the pure
code (debugging, or to compare the two). Nothing else changes: the wire bytes are the same.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

# Read once: every compiled twin is chosen here, by this switch.
PURE_PYTHON = os.environ.get("CDC_PLATFORM_PURE_PYTHON", "").strip().lower() in (
    "1", "true", "yes")


def load_compiled(name: str) -> ModuleType | None:
    """The compiled module ``name``, or None (not built, or pure Python asked for)."""
    if PURE_PYTHON:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


NATIVE: ModuleType | None = load_compiled("cdc_platform.protocol._native")
