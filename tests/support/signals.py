"""What a Celery signal calls, for tests that a hook is connected."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from celery.utils.dispatch import Signal


def connected(signal: Signal) -> list[Callable[..., Any]]:
    """The receivers ``signal`` calls (Celery keeps most of them behind weak references)."""
    return [r() if isinstance(r, weakref.ReferenceType) else r for _, r in signal.receivers]
