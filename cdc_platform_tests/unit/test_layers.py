"""The layers, read from the imports: a consumer of the wire contract (``consumer/``, and the
mirror built on it) stands on ``wire/`` and ``jetstream/`` alone, never on the producer's
code (capture, publishing, snapshots, Dagster), so that what it relies on is what the
contract documents; ``wire/`` and ``jetstream/`` import no producer code either. And no test
module imports another: what tests share lives in ``cdc_platform_tests/fixtures/``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "cdc_platform"
TESTS = Path(__file__).resolve().parents[1]
# shared ground every layer may stand on
COMMON = {"errors", "lsn", "naming", "settings", "speedups", "_speedups"}
ALLOWED = {
    "wire": COMMON,
    "jetstream": COMMON | {"wire"},
    "consumer": COMMON | {"wire", "jetstream"},
    "mirror": COMMON | {"wire", "jetstream", "consumer"},
}


def _imported_packages(path: Path) -> set[str]:
    """The top-level cdc_platform packages ``path`` imports (module level or inside
    functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "cdc_platform" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_under_it(layer):
    wrong = {
        str(path.relative_to(PACKAGE.parent)): sorted(
            _imported_packages(path) - ALLOWED[layer] - {layer})
        for path in sorted((PACKAGE / layer).rglob("*.py"))}
    assert {path: packages for path, packages in wrong.items() if packages} == {}


def test_the_rule_reads_imports_inside_functions_too(tmp_path):
    module = tmp_path / "late.py"
    module.write_text("def f():\n    from cdc_platform.snapshot.meta import publish_meta\n")
    assert _imported_packages(module) == {"snapshot"}


def _imported_test_modules(path: Path) -> set[str]:
    """The test modules (``test_*``) ``path`` imports, absolute or relative, from wherever."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found.update(name for name in names if name.rsplit(".", 1)[-1].startswith("test_"))
    return found


def test_no_test_module_imports_another():
    wrong = {str(path.relative_to(TESTS.parent)): sorted(_imported_test_modules(path))
             for path in sorted(TESTS.rglob("*.py"))}
    assert {path: modules for path, modules in wrong.items() if modules} == {}


def test_the_test_rule_reads_every_form_of_import(tmp_path):
    module = tmp_path / "shared.py"
    module.write_text(
        "from cdc_platform_tests.integration.test_snapshot import NO_BRIDGE\n"
        "from .test_values import arrays\n"
        "from cdc_platform_tests.unit import test_values\n"
        "def f():\n    import cdc_platform_tests.integration.test_mirror\n"
        "from cdc_platform_tests.fixtures.snapshots import NO_BRIDGE as test_like\n")
    assert _imported_test_modules(module) == {
        "cdc_platform_tests.integration.test_snapshot", ".test_values",
        "cdc_platform_tests.unit.test_values", "cdc_platform_tests.integration.test_mirror"}
