"""What the Docker image installs (scripts/image_requirements.py), and that the build can reach it."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parents[2]
SCRIPT: Final = REPO / "scripts" / "image_requirements.py"
PYPROJECT: Final = REPO / "pyproject.toml"


def run(extras: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(PYPROJECT), extras], capture_output=True, text=True, check=False
    )


def project() -> dict[str, object]:
    data: dict[str, object] = tomllib.loads(PYPROJECT.read_text())["project"]
    return data


def test_without_extras_the_image_gets_exactly_the_runtime_dependencies() -> None:
    out = run("")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == project()["dependencies"]


@pytest.mark.parametrize("extras", ["eagle", " eagle ", "eagle,eagle"])
def test_the_eagle_extra_adds_its_dependencies_once(extras: str) -> None:
    out = run(extras)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")[:-1]
    optional = project()["optional-dependencies"]
    assert isinstance(optional, dict)
    assert lines == [*project()["dependencies"], *optional["eagle"]]  # type: ignore[misc]


def test_a_misspelt_extra_fails_the_build_naming_the_known_ones() -> None:
    out = run("eagel")
    assert out.returncode != 0
    assert "unknown extra 'eagel'" in out.stderr and "eagle" in out.stderr
    assert out.stdout == ""


def dockerignored(path: str) -> bool:
    """Docker's rule: the last pattern of .dockerignore that matches the path (or a parent) decides."""
    ignored = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            ignored = not negate
    return ignored


def test_the_build_context_holds_the_script_the_dockerfile_copies() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "scripts/image_requirements.py" in dockerfile
    assert 'ARG EXTRAS=""' in dockerfile
    assert 'python image_requirements.py pyproject.toml "${EXTRAS}"' in dockerfile
    assert not dockerignored("scripts/image_requirements.py")
    assert dockerignored("scripts/ensure_redis.py")  # the rest of scripts/ stays out
    assert dockerignored("tests/unit/test_image_requirements.py")
    assert not dockerignored("workers/sglang/wire.py")
