"""The library runs without its extras: with Dagster and Spark made unimportable, every module
outside the Dagster layer imports, the command line works, and what needs an extra says which
one. (pyproject.toml: ``[dagster]``, ``[spark]``, ``[dev]``.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import cdc_platform

PACKAGE = Path(cdc_platform.__file__).parent
# The Dagster layer, and what the `dev` stack (the dev extra) runs.
NEEDS_EXTRAS = ("cdc_platform.defs", "cdc_platform.definitions", "cdc_platform.dev")

PROGRAM = textwrap.dedent("""
    import importlib, importlib.abc, pkgutil, sys

    class NoExtras(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("dagster", "dagster_pyspark", "dagster_webserver",
                                      "pyspark", "py4j"):
                raise ImportError(f"No module named {name!r} (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoExtras())
    import cdc_platform
    needs_extras = tuple(sys.argv[1].split(","))
    imported = 0
    for module in pkgutil.walk_packages(cdc_platform.__path__, "cdc_platform."):
        if not module.name.startswith(needs_extras):
            importlib.import_module(module.name)
            imported += 1
    assert not any(name.split(".")[0] in ("dagster", "pyspark") for name in sys.modules)
    from cdc_platform import cli
    cli.build_parser().parse_args(["mirror", "--tables", "t", "--sqlite", "m.db"])
    print("imported", imported)
    sys.exit(cli.main(["dev", "--smoke"] if len(sys.argv) > 2 else ["check-config"]))
""")


def _run(*extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROGRAM, ",".join(NEEDS_EXTRAS), *extra],
                          capture_output=True, text=True, check=False, timeout=120,
                          cwd=PACKAGE.parent)


def test_the_library_imports_and_runs_without_dagster_or_spark():
    result = _run()
    assert "imported" in result.stdout, result.stderr
    assert int(result.stdout.split("imported")[1].split()[0]) > 40  # (the walk found them)
    assert result.returncode == 0, result.stdout + result.stderr  # check-config: defaults


def test_the_dev_stack_says_which_extra_it_needs():
    result = _run("dev")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs the dev extra (pip install 'cdc_platform[dev]')" in result.stderr
