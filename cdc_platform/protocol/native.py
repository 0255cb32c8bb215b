"""The optional compiled accelerator, ``_native`` (Cython, built by ``setup.py``).

The decoder, the row builder, the temporal converters and the msgpack event writer each
have a pure-Python original and a compiled twin with the same results; the hot paths use
the twin when it is built. ``NATIVE`` is the compiled module, or None when it is not built
(no C compiler at install time) or when ``CDC_PLATFORM_PURE_PYTHON=1`` asks for the pure
code (debugging, or to compare the two). Nothing else changes: the wire bytes are the same.
"""

from __future__ import annotations

import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("CDC_PLATFORM_PURE_PYTHON", "").strip().lower() in ("1", "true", "yes"):
        return None
    try:
        from cdc_platform.protocol import _native
    except ImportError:
        return None
    return _native


NATIVE: ModuleType | None = _load()
