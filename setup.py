"""Builds the optional compiled accelerators (``cdc_platform/protocol/_native.pyx``,
``cdc_platform/mirror/_rows.pyx``, ``cdc_platform/jetstream/_frames.pyx``,
``cdc_platform/wire/_encoding.pyx`` and the msgpack reader it shares with ``_rows``).

Everything else is in pyproject.toml. The extension is ``optional``: without a C compiler
the install still succeeds and the pure-Python code runs (slower; see ``native.py``).
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(ext_modules=cythonize(
    [Extension("cdc_platform.protocol._native", ["cdc_platform/protocol/_native.pyx"],
               optional=True),
     Extension("cdc_platform.mirror._rows", ["cdc_platform/mirror/_rows.pyx"],
               optional=True),
     Extension("cdc_platform.jetstream._frames", ["cdc_platform/jetstream/_frames.pyx"],
               optional=True),
     Extension("cdc_platform.wire._msgpack_reader",
               ["cdc_platform/wire/_msgpack_reader.pyx"], optional=True),
     Extension("cdc_platform.wire._encoding", ["cdc_platform/wire/_encoding.pyx"],
               optional=True)],
    compiler_directives={"language_level": "3"}))
