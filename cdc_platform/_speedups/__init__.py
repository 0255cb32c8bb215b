"""Compiled twins of pure modules (Cython, built by ``setup.py``; optional).

Laid out like the package: ``_speedups/protocol/pgoutput.pyx`` is the twin of
``protocol/pgoutput.py``, with a ``.pyi`` of what it exports (the pure module's names, with the
same signatures); what the twins share is here, in ``writer.pxd`` and ``msgpack_reader.pxd``.
Each twin gives the same results as the pure code it stands for, or hands the case back to it
(so errors are worded in one place). The pure modules bind their twin through
:func:`cdc_platform.speedups.compiled_twin`: nothing else imports this package.
"""
