"""How datasets are shown: the status table (rich) and the JSON of ``status --json``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from budget import DatasetSnapshot

#: The fields of ``status --json``, in order (the interface later checks drive).
STATUS_FIELDS = (
    "name",
    "state",
    "tokens",
    "token_budget",
    "samples",
    "max_samples",
    "failed",
    "dropped",
    "queued",
    "inflight",
)

_STATE_STYLE = {"active": "green", "paused": "yellow", "exhausted": "cyan", "revoked": "red"}


def unfed(s: DatasetSnapshot) -> int | None:
    """Source samples not yet sent at all, once the source has been counted."""
    if not s.source_done:
        return None
    return max(0, s.source_total - s.samples - s.failed - s.pending - s.queued - s.inflight)


def snapshot_json(s: DatasetSnapshot) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": s.name,
        "state": s.state,
        "tokens": s.tokens,
        "token_budget": s.token_budget,
        "samples": s.samples,
        "max_samples": s.max_samples,
        "failed": s.failed,
        "dropped": s.pending,
        "queued": s.queued,
        "inflight": s.inflight,
    }
    out |= {
        "on_budget": s.on_budget,
        "live_tokens": s.live_tokens,
        "truncated": s.truncated,
        "discarded_tokens": s.discarded_tokens,
        "wasted_tokens": s.wasted_tokens,
        "rejected": s.rejected,
        "reclaimed": s.reclaimed,
        "source_total": s.source_total if s.source_done else None,
        "unfed": unfed(s),
        "settled": s.settled,
    }
    return out


def _of(value: int, limit: int | None) -> str:
    return f"{value:,}" if limit is None else f"{value:,} / {limit:,}"


def status_table(snapshots: Sequence[DatasetSnapshot], title: str | None = None) -> Table:
    table = Table(title=title, header_style="bold")
    for col in ("dataset", "state", "tokens / budget", "samples / cap", "failed", "dropped", "queued"):
        table.add_column(col, justify="left" if col in ("dataset", "state") else "right")
    table.add_column("in flight", justify="right")
    table.add_column("rejected", justify="right")
    for s in snapshots:
        style = _STATE_STYLE.get(s.state, "")
        state = s.state + (" (settled)" if s.settled else "")
        table.add_row(
            s.name,
            f"[{style}]{state}[/]" if style else state,
            _of(s.tokens, s.token_budget),
            _of(s.samples, s.max_samples),
            f"{s.failed:,}",
            f"{s.pending:,}",
            f"{s.queued:,}",
            f"{s.inflight:,}",
            f"{s.rejected:,}",
        )
    return table
