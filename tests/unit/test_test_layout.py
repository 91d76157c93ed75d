"""The tests' layout, read from their sources so it cannot regress unnoticed: helpers have one home (no file
under ``tests/`` imports from a conftest or from a test module; ``tests/support/`` holds no fixtures), and
folder names say what a test needs: ``unit`` nothing (no Redis fixture), ``redis`` a real Redis (marker
``redis``), ``integration`` worker processes, the simulator over HTTP, a fleet (marker ``integration``)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def forbidden_imports(source: str, filename: str = "<test>") -> list[str]:
    """The modules ``source`` imports that are a conftest or a ``test_*`` module, as written."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
            modules += [f"{node.module or ''}.{alias.name}".lstrip(".") for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            last = module.rsplit(".", 1)[-1]
            if last == "conftest" or last.startswith("test_"):
                found.append(module)
                break
    return found


def test_the_import_check_finds_an_import_from_a_conftest_or_a_test_module() -> None:
    source = (
        "from tests.conftest import IN_CI\n"
        "import tests.unit.test_chat\n"
        "from tests.integration import test_fleet_run\n"
        "def f():\n    from .conftest import x\n"
        "from tests.support.files import unique\n"
    )
    assert forbidden_imports(source) == [
        "tests.conftest",
        "tests.unit.test_chat",
        "tests.integration.test_fleet_run",
        "conftest",
    ]


def test_no_file_under_tests_imports_from_a_conftest_or_another_test_module() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50
    offenders = {
        str(path.relative_to(TESTS)): found
        for path in files
        if (found := forbidden_imports(path.read_text(), str(path)))
    }
    assert offenders == {}


def test_the_support_package_defines_no_fixtures() -> None:
    with_fixtures = [
        path.name for path in sorted((TESTS / "support").glob("*.py")) if "pytest.fixture" in path.read_text()
    ]
    assert with_fixtures == []


#: Fixtures (tests/conftest.py, tests/integration/conftest.py) that need a real Redis or a fleet.
REDIS_OR_FLEET_FIXTURES = {"redis_url", "redis_client", "ledger", "fleet_redis_url", "fleet_ledger"}
REDIS_OR_FLEET_FIXTURES |= {"workers", "sim_factory", "private_fleet"}


def module_marker(source: str) -> str | None:
    """The ``pytest.mark.NAME`` a module's ``pytestmark = ...`` sets."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            return ast.unparse(node.value).removeprefix("pytest.mark.")
    return None


def test_every_module_in_redis_and_integration_carries_its_folders_marker() -> None:
    wrong = {
        str(path.relative_to(TESTS)): marker
        for folder, wanted in (("redis", "redis"), ("integration", "integration"))
        for path in sorted((TESTS / folder).glob("test_*.py"))
        if (marker := module_marker(path.read_text())) != wanted
    }
    assert len(list((TESTS / "redis").glob("test_*.py"))) >= 9
    assert wrong == {}


def test_no_unit_test_asks_for_redis_or_a_fleet() -> None:
    asking = {}
    for path in sorted((TESTS / "unit").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                wanted = {a.arg for a in node.args.args} & REDIS_OR_FLEET_FIXTURES
                if wanted:
                    asking[f"{path.name}::{node.name}"] = sorted(wanted)
    assert asking == {}
