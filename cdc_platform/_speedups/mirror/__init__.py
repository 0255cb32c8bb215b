"""Compiled twins of ``cdc_platform/mirror``'s modules (see ``cdc_platform/speedups.py``)."""
