"""The tests' helpers have one home: no file under ``tests/`` imports from a conftest or from a test module
(helpers live in ``tests/support/``, fixtures in the conftest files), and the support package holds no
fixtures. Read from the files' imports, so it cannot regress unnoticed."""

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
