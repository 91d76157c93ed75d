"""An admitted attempt as the runner's steps take it, for unit tests of those steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from budget.spec import DatasetSpec
from workers.leases import Lease
from workers.runner import Attempt


def attempt_of(spec: DatasetSpec, cap: int = 0, sample: dict[str, Any] | None = None) -> Attempt:
    """Attempt ``a1`` at sample ``s1`` of dataset ``ds`` under ``spec``, admitted with ``cap``."""
    return Attempt("ds", sample or {}, "s1", "a1", spec, Lease("ds", "s1", "a1"), Path(), cap)
