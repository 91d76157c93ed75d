"""Each module that declares its public names in ``__all__`` has every one of them, and ``from X import *``
gives exactly those. The modules are found by reading the packages' sources, so a new ``__all__`` is
checked without being listed here."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("budget", "chat", "producer", "workers", "tokenfleet")


def declares_all(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return True
    return False


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(
    module_name(path) for package in PACKAGES for path in (ROOT / package).rglob("*.py") if declares_all(path)
)


def test_the_packages_that_declare_their_public_names_are_found() -> None:
    assert "budget" in MODULES and "tokenfleet.sim" in MODULES
    assert {name.split(".")[0] for name in MODULES} == set(PACKAGES)


@pytest.mark.parametrize("name", MODULES)
def test_every_name_in_all_exists_and_a_star_import_gives_exactly_those(name: str) -> None:
    module = importlib.import_module(name)
    declared = list(module.__all__)
    assert len(declared) == len(set(declared)), f"{name}.__all__ lists a name twice"
    missing = [n for n in declared if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(declared)
