"""Which code a process runs: the distribution's version plus a fingerprint of the sources.

The story behind tokenfleet is an old copy of a script, without its budget flag, burning GPU hours:
the version number alone would not have told it apart. The fingerprint hashes the sources that decide
what a generation does (``budget``, ``producer``, ``workers``), so ``status`` can flag a worker that runs
other code than the submitter.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import metadata, util
from pathlib import Path
from typing import Final

FINGERPRINTED_PACKAGES: Final = ("budget", "producer", "workers")


def distribution_version() -> str:
    try:
        return metadata.version("tokenfleet")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


@cache
def code_fingerprint() -> str:
    digest = hashlib.sha1()
    for package in FINGERPRINTED_PACKAGES:
        spec = util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted([*root.rglob("*.py"), *root.rglob("*.lua")]):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


@cache
def full_version() -> str:
    """``0.1.0+code.1a2b3c4d5e``: equal only for the same release and the same sources."""
    return f"{distribution_version()}+code.{code_fingerprint()}"
