"""Snapshot partitions: one per published table (wire name), kept in sync with the publication."""

import dagster as dg

published_tables_partitions = dg.DynamicPartitionsDefinition(name="published_tables")
