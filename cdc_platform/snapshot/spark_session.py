"""The Spark session the snapshot tasks run on: Java and the process environment it needs, its
configuration (Dagster's PySpark resource), a local session for local runs and tests
(``local[*]`` is the default). Where the tasks run on it: :mod:`.tasks`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from cdc_platform.errors import CdcError

MIN_JAVA = 17


def check_java() -> str:
    """Return the Java version, or fail with what to install (Spark 4 needs Java 17+)."""
    java_home = os.environ.get("JAVA_HOME")
    java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java")
    if not java or not os.path.exists(java):
        raise CdcError(
            f"Java {MIN_JAVA}+ is required for Spark snapshots but no `java` was found: "
            "install it (Debian: apt-get install openjdk-17-jre-headless) or set JAVA_HOME"
        )
    output = subprocess.run([java, "-version"], capture_output=True, text=True,
                            check=False).stderr
    match = re.search(r'version "(\d+)', output)
    if not match or int(match.group(1)) < MIN_JAVA:
        raise CdcError(f"Java {MIN_JAVA}+ is required for Spark snapshots, found: "
                       f"{output.splitlines()[0] if output else 'unknown'}")
    return match.group(1)


def prepare_spark_environment() -> None:
    """Call before the first SparkSession of a process: Java present, and Python workers
    run this interpreter (it has cdc_platform). Read by spark-submit when the JVM starts,
    so ``spark.pyspark.python`` alone comes too late for local mode."""
    check_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def default_spark_config(master: str = "local[*]", driver_memory: str = "1g") -> dict:
    """A snapshot's Spark configuration: no UI, Python workers reused and running this
    interpreter (it has cdc_platform and its dependencies)."""
    return {
        "spark.master": master,
        "spark.app.name": "cdc-platform-snapshot",
        "spark.ui.enabled": "false",
        "spark.driver.memory": driver_memory,
        "spark.python.worker.reuse": "true",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
    }


def local_spark_session(app_name: str, master: str = "local[*]"):
    """A SparkSession for local runs and tests: the default configuration, quiet, few
    shuffle partitions."""
    prepare_spark_environment()
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    config = {**default_spark_config(master), "spark.app.name": app_name,
              "spark.sql.shuffle.partitions": "4"}
    for key, value in config.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session
