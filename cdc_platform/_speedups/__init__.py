"""Compiled twins of pure modules (Cython, built by ``setup.py``; optional).

One module here per pure module it speeds up, with the same name (``_speedups/pgoutput.pyx``
is the twin of ``protocol/pgoutput.py``) and a ``.pyi`` of what it exports; what they share
is in ``writer.pxd`` and ``msgpack_reader.pxd``. Each twin gives the same results as the
pure code it stands for, or hands the case back to it (so errors are worded in one place).
The pure modules choose their twin through :func:`cdc_platform.speedups.compiled_twin`:
nothing else imports this package.
"""
