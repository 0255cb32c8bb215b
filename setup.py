"""Builds the optional compiled twins in ``cdc_platform/_speedups/`` (Cython): one extension per
``.pyx``, laid out like the package (``_speedups/protocol/pgoutput.pyx`` is the twin of
``protocol/pgoutput.py``, see ``cdc_platform/speedups.py``).

Everything else is in pyproject.toml. The extensions are ``optional``: without a C compiler
the install still succeeds and the pure-Python code runs (slower).
"""

from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

SPEEDUPS = Path("cdc_platform/_speedups")

setup(ext_modules=cythonize(
    [Extension(".".join(source.with_suffix("").parts), [str(source)], optional=True)
     for source in sorted(SPEEDUPS.rglob("*.pyx"))],
    compiler_directives={"language_level": "3"}))
