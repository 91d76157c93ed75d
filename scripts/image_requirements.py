"""The requirements the Docker image installs: pyproject.toml's runtime dependencies, plus those of the
optional extras named (``EXTRAS``, e.g. ``eagle``), one per line.

    python scripts/image_requirements.py pyproject.toml "eagle" > requirements.txt

Standard library only: the Dockerfile runs it before anything is installed. An unknown extra is an error,
so a misspelt ``TOKENFLEET_EXTRAS`` fails the build instead of silently building without it.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def image_requirements(pyproject: Path, extras: str) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    for extra in extras.replace(",", " ").split():
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}: pyproject.toml has {', '.join(sorted(optional))}")
        requirements += [r for r in optional[extra] if r not in requirements]
    return requirements


if __name__ == "__main__":
    print("\n".join(image_requirements(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")))
