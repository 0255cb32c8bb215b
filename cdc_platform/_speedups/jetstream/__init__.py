"""Compiled twins of ``cdc_platform/jetstream``'s modules (see ``cdc_platform/speedups.py``)."""
