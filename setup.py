"""Builds the optional compiled accelerator (``cdc_platform/protocol/_native.pyx``).

Everything else is in pyproject.toml. The extension is ``optional``: without a C compiler
the install still succeeds and the pure-Python code runs (slower; see ``native.py``).
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(ext_modules=cythonize(
    [Extension("cdc_platform.protocol._native", ["cdc_platform/protocol/_native.pyx"],
               optional=True)],
    compiler_directives={"language_level": "3"}))
