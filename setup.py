"""Builds the optional compiled twins in ``cdc_platform/_speedups/`` (Cython): one extension per
``.pyx``, each the twin of the pure module of the same name (see ``cdc_platform/speedups.py``).

Everything else is in pyproject.toml. The extensions are ``optional``: without a C compiler
the install still succeeds and the pure-Python code runs (slower).
"""

from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

SPEEDUPS = Path("cdc_platform/_speedups")

setup(ext_modules=cythonize(
    [Extension(f"cdc_platform._speedups.{source.stem}", [str(source)], optional=True)
     for source in sorted(SPEEDUPS.glob("*.pyx"))],
    compiler_directives={"language_level": "3"}))
