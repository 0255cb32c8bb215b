"""Compiled twins of ``cdc_platform/protocol``'s modules (see ``cdc_platform/speedups.py``)."""
