"""A ``DatasetSnapshot`` or ``ServerStatus`` built by hand, for tests of what is computed from one (no
Redis)."""

from __future__ import annotations

import dataclasses
from typing import Any

from budget import DatasetSnapshot, DatasetState
from budget.server_board import ServerStatus


def snapshot_of(name: str = "ds", **changes: Any) -> DatasetSnapshot:
    """An active dataset with every counter at 0, then ``changes``."""
    base = DatasetSnapshot(
        name=name,
        state=DatasetState.ACTIVE,
        token_budget=None,
        max_samples=None,
        on_budget="truncate",
        tokens=0,
        samples=0,
        truncated=0,
        live_tokens=0,
        discarded_tokens=0,
        wasted_tokens=0,
        reclaimed=0,
        failed=0,
        queued=0,
        inflight=0,
        pending=0,
        rejected=0,
        source_total=0,
        source_done=False,
    )
    return dataclasses.replace(base, **changes)


def server_status_of(url: str = "http://s:30000", **changes: Any) -> ServerStatus:
    """A server up, with nothing in flight, that answered 5 s ago, then ``changes``."""
    base = ServerStatus(
        url=url,
        inflight=0,
        cap=None,
        up=True,
        requests_per_s=0.0,
        started=10,
        failures=0,
        fails_in_a_row=0,
        downs=0,
        down_since_ms=None,
        last_error="",
        last_ok_s_ago=5.0,
    )
    return dataclasses.replace(base, **changes)
